/* Planted mutation for the gate's test: ggml_rms_norm's epsilon doubled.
 *
 * Preloaded (LD_PRELOAD) into both servers of the gate's default_output check, it changes every
 * RMS norm the patched server's libllama builds through libggml-base's exported ggml_rms_norm, as a
 * one-line change in ggml would.  The reference server is linked statically from the pristine tree:
 * its calls are bound inside the executable, so the same environment leaves it unchanged and the
 * check must fail.  (With the old reference, which loaded the patched build's libggml-base, both
 * servers changed alike and the check passed.)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

struct ggml_context;
struct ggml_tensor;

typedef struct ggml_tensor * (*rms_norm_fn)(struct ggml_context *, struct ggml_tensor *, float);

struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps) {
    static rms_norm_fn real = NULL;
    if (real == NULL) {
        real = (rms_norm_fn) dlsym(RTLD_NEXT, "ggml_rms_norm");
        if (real == NULL) {
            fprintf(stderr, "rms_norm_eps mutation: ggml_rms_norm not found\n");
            abort();
        }
    }
    return real(ctx, a, 2.0f * eps);
}
