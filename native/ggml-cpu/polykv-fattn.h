// polykv: flash attention for decode batches whose rows share KV cells (shared-prefix decode).
//
// A decode batch of N agents over one shared prefix has N query rows that all see the prefix
// cells. The upstream CPU kernel scores each row on its own (one-row path below 64 rows), so the
// prefix K/V is read and converted N x (query heads per KV head) times. This path groups, per KV
// head, the N rows times the query heads that share that KV head, loads each K/V tile once for
// all of them (a small GEMM against the tile), splits the KV range into chunks that threads take
// one at a time (partials merged with log-sum-exp), and skips tiles where every row is masked.
// Tiles that only a few rows see (private cells) are scored as (row, cell) pairs. Prompt batches of
// up to 511 rows take it too: several agents' turns over unified KV, where upstream's tiled kernel
// scores every row against every agent's cells.
//
// Off by default: only a caller that sets it (the patched llama-server's --shared-decode, the
// polykv engine) turns it on, through the CPU backend's proc address
// "ggml_backend_cpu_polykv_set_shared_decode". Off, ggml computes exactly what upstream computes.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;
struct ggml_compute_params;

// turn the path on or off for this process (all CPU backends)
void ggml_backend_cpu_polykv_set_shared_decode(bool on);
bool ggml_backend_cpu_polykv_get_shared_decode(void);

// counters since start: [0] flash-attention ops computed by this path, [1] tiles scored as a
// block (shared), [2] tiles scored as (row, cell) pairs (private), [3] tiles skipped (every row masked)
void ggml_backend_cpu_polykv_shared_decode_stats(uint64_t out[4]);

// where the path's time goes, counted since start: [0] ns of its nodes (thread 0, from a node's start to its last
// row written: the wall time), then summed over threads: [1] ns in shared tiles (mask scan, K/V conversion, GEMMs,
// softmax), [2] ns in private tiles and spans, [3] ns in work items (the rest: queries, skipped tiles, partials);
// [4] flops of shared tiles and [5] of private ones (2 (DK + DV) per query head and visible (token, cell) pair),
// [6] K/V row bytes of the private pairs (each pair's rows of its KV heads)
#define POLYKV_FA_N_TIMES 7
void ggml_backend_cpu_polykv_shared_decode_times(uint64_t out[POLYKV_FA_N_TIMES]);

// the entry points above by name, for the CPU backend's get_proc_address (nullptr for any other name)
void * ggml_backend_cpu_polykv_proc_address(const char * name);

// work buffer this op needs if the switch is on and it qualifies for the path (else 0)
size_t ggml_cpu_polykv_fa_wsize(const struct ggml_tensor * dst, int n_tasks);

// computes dst and returns true if the path is on and applies; false: nothing was touched
// (all threads reach the same answer)
bool ggml_cpu_polykv_fa_decode(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
