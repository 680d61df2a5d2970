#include "server-polykv-provenance.h"

#include "server-common.h" // are_lora_equal, lora_all_alora
#include "log.h"

#include <algorithm>

bool polykv_prov_matches(const polykv_provenance & prov, const std::string & salt,
                         const std::vector<common_adapter_lora_info> & lora) {
    return prov.salt_known && prov.salt == salt && prov.lora_known && !lora_all_alora(lora) && are_lora_equal(prov.lora, lora);
}

int32_t polykv_prov_shareable(const polykv_provenance & prov, const std::string & salt,
                              const std::vector<common_adapter_lora_info> & lora) {
    return polykv_prov_matches(prov, salt, lora) ? prov.n_exact : 0;
}

void polykv_prov_start(polykv_provenance & prov, bool isolate, bool task_reuses_chunks, const std::string & salt,
                       const std::vector<common_adapter_lora_info> & lora, int id_slot, int & n_past) {
    if (n_past > 0) {
        const bool salt_same = prov.salt_known && prov.salt == salt;
        const bool lora_same = prov.lora_known && are_lora_equal(prov.lora, lora);
        if (!salt_same || !lora_same) {
            if (isolate) {
                LOG_INF("slot %12.*s: id %2d | task -1 | polykv: cached cells were computed under another %s - recomputing the prompt (n_past %d -> 0)\n",
                        12, "polykv_prov", id_slot, !salt_same ? "cache_salt" : "LoRA set", n_past);
                n_past = 0;
            } else {
                // upstream's own cache reuse keeps the cells [0, n_past): their origin is mixed from now on
                prov.salt_known = prov.salt_known && salt_same;
                prov.lora_known = prov.lora_known && lora_same;
                if (n_past <= prov.n_exact) {
                    prov.n_exact = polykv_provenance::ALL;
                }
                return;
            }
        } else if (isolate && !task_reuses_chunks && n_past > prov.n_exact) {
            // cells moved by an earlier request's chunk reuse or context shift: a task that asked for nothing
            // approximate recomputes them
            LOG_INF("slot %12.*s: id %2d | task -1 | polykv: cached cells from %d on were shifted - recomputing them (n_past %d -> %d)\n",
                    12, "polykv_prov", id_slot, prov.n_exact, n_past, prov.n_exact);
            n_past = prov.n_exact;
        }
    }
    if (n_past <= prov.n_exact) {
        prov.n_exact = polykv_provenance::ALL; // every cell left is exact, and so is every cell computed over them
    }
    prov.salt       = salt;
    prov.salt_known = true;
    prov.lora       = lora;
    prov.lora_known = true;
}

void polykv_prov_shared(polykv_provenance & dst, const polykv_provenance & src) {
    dst = src;
    dst.n_exact = polykv_provenance::ALL; // the cells taken are exact (at most the source's exact length)
}

void polykv_prov_shifted(polykv_provenance & prov, int32_t pos) {
    prov.n_exact = std::min(prov.n_exact, std::max<int32_t>(pos, 0));
}

void polykv_prov_unknown(polykv_provenance & prov) {
    prov.salt.clear();
    prov.salt_known = false;
    prov.lora.clear();
    prov.lora_known = false;
    prov.n_exact    = 0;
}
