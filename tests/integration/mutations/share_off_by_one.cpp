// Planted mutation for the gate's test: a share decision one cell too long.
//
// Preloaded (LD_PRELOAD) into the patched server, it wraps polykv_share_decide (native/server/server-polykv.cpp,
// exported from libllama-server-impl and called through the PLT): every share it allows takes P + 1 cells
// instead of P. It sits after every guard the decision makes, so the server's own checks pass where the
// source holds a cell at position P (its own next token): the sharer's KV at P is another prompt's token,
// the status is "hit", and the counters add up; only an exact comparison of the answer sees the wrong KV.
// The real function is found by this wrapper's own (mangled) name.
#include "server-polykv.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

polykv_share_decision polykv_share_decide(const polykv_share_input & in, int n_past) {
    using fn = polykv_share_decision (*)(const polykv_share_input &, int);
    static const fn real = [] {
        Dl_info self{};
        void *  sym = nullptr;
        if (dladdr(reinterpret_cast<void *>(&polykv_share_decide), &self) != 0 && self.dli_sname != nullptr) {
            sym = dlsym(RTLD_NEXT, self.dli_sname);
        }
        if (sym == nullptr) {
            std::fprintf(stderr, "share_off_by_one mutation: the real polykv_share_decide was not found\n");
            std::abort();
        }
        return reinterpret_cast<fn>(sym);
    }();
    polykv_share_decision d = real(in, n_past);
    if (d.n_share > 0 && in.tokens != nullptr && d.n_share + 1 < (int32_t) in.tokens->size()) {
        d.n_share += 1;
    }
    return d;
}
