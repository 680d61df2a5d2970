// polykv: Q4_1 weight matmuls in register tiles, bit for bit what ggml's row-by-row dot products give.
//
// ggml's CPU backend multiplies a Q4_1 weight matrix by a batch of activations one (row, column)
// pair at a time (ggml_vec_dot_q4_1_q8_1): each pair unpacks the row's 4-bit block, converts four
// f16 scales and waits on one accumulator's FMA chain, so a decode batch of N agents (N columns)
// runs at the latency of that chain. Q4_1 (the default model's format) has no repacked GEMM and no
// tinyBLAS kernel in the pinned ggml, unlike Q4_0. This kernel computes a block of up to 16 rows x
// 16 columns (the chunk ggml's mul_mat hands a thread) in tiles of 4 rows x 8 columns, each row's
// unpacked block reused for 8 columns and each column's block for 4 rows, 16 independent
// accumulators in flight. Every output goes through the same float operations in the same order
// as ggml_vec_dot_q4_1_q8_1 on AVX2/AVX-512 (per block: d0*d1 rounded, the integer dot product
// converted, one FMA into 8 lanes; m*s added by an FMA into a scalar; the 8 lanes summed as
// hsum_float_8, then the scalar added), so results are identical to upstream's, bit for bit.
//
// On by default where it is compiled (x86-64 with AVX-512 F/BW/VL/VNNI) and where it passes its own check
// against the build's ggml_vec_dot_q4_1_q8_1, run once before its first block (every bit of a 16 x 16
// block); POLYKV_MM_TILES=0 in the environment turns it off (read once per process), for A/B measurements.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;

// Computes rows [ir0, ir0_end) x columns [ir1, ir1_end) of the mul_mat node dst, whose src1 has been
// quantized to Q8_1 rows of row_size bytes at wdata, and returns true; returns false and writes
// nothing where it does not apply (src0 not Q4_1, src1 not F32, operands with more than 2
// dimensions, more than 16 rows or columns, one column, switched off, or not compiled for this CPU).
bool ggml_cpu_polykv_mm_block(const struct ggml_tensor * dst, const void * wdata, size_t row_size,
                              int64_t ir0, int64_t ir0_end, int64_t ir1, int64_t ir1_end);

// whether the kernel is compiled in, switched on and has passed its check in this process
bool ggml_cpu_polykv_mm_enabled(void);

// switch it on or off for this process (overrides POLYKV_MM_TILES; for checks and A/B runs)
void ggml_cpu_polykv_mm_set(bool on);

// blocks computed by the kernel since start (a check's proof that it ran)
uint64_t ggml_cpu_polykv_mm_blocks(void);

#ifdef __cplusplus
}
#endif
