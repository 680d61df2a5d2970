// polykv: shared-prefix decode attention for the CPU backend (see polykv-fattn.h).
//
// The computation for one KV head g of one stream, over one chunk of cells [c0, c1):
//   rows r = token i * rk2 + query head h (the rk2 query heads that read KV head g)
//   QT  [DK x Rp]  the rows' queries, scaled, transposed (Rp = rows padded to 16)
//   per tile of T cells:
//     Kf [T x DK], Vf [T x DV]   the tile's K and V rows as f32, converted once for all rows
//     shared tile (most rows see most cells): ST[T x Rp] = mask + Kf * QT (a GEMM), the online
//       softmax runs along the cells for all rows at once (vector over rows), ACC += P^T * Vf
//     private tile (each cell seen by few rows): each token's rows over only the cells it sees; on AVX-512
//       with f16 K/V up to 4 private tiles form a span, computed token by token from the cache's f16 rows (no
//       f32 copy), elsewhere the tile's f32 rows as (row, cell) pairs
//   the chunk's (M, S, ACC) per row go to a partials buffer; after a barrier each row's chunks
//   are merged in chunk order (log-sum-exp) and written to dst: the result does not depend on
//   which thread took which chunk. An attention sink (gpt-oss: a learned logit per query head) joins
//   that merge as one more term of the softmax's sum, with no value, as upstream's kernels add it.
//
// POLYKV_FA_CORE_ONLY builds only the computation (namespace POLYKV_FA_NS), so a test can compile
// it again with other instruction sets (AVX2, none) and compare every variant on one machine.
//
// SIMD: ggml's fixed-width F32 vector macros (AVX-512, AVX2, AVX, SSE, NEON, ...). On ARM SVE and
// RISC-V RVV those macros name sizeless types (no arrays of them, and a vector may be wider than
// GGML_F32_EPR), so there the scalar code is compiled (POLYKV_FA_SIMD undefined).

#include "polykv-fattn.h"

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include "vec.h"

#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define POLYKV_FA_SIMD 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#ifndef POLYKV_FA_NS
#define POLYKV_FA_NS polykv_fa
#endif

namespace POLYKV_FA_NS {

static constexpr int64_t TILE = 64;   // cells per tile
static constexpr int64_t RPAD = 16;   // rows are padded to a multiple of this (>= any f32 vector)
static constexpr int64_t ALIGN_F = 16; // scratch buffers start on 64-byte boundaries
static constexpr int64_t MAX_ROWS = 512; // from 512 query rows (a full default ubatch) upstream's tiled kernel takes over

enum kv_kind { KV_F16 = 0, KV_Q8_0 = 1 };

struct problem {
    int64_t DK, DV;
    int64_t N;          // tokens (query rows per head)
    int64_t n_head;     // query heads
    int64_t n_head_kv;  // KV heads
    int64_t ne3;        // streams of q
    int64_t n_kv;       // cells
    int64_t rk2, rk3;   // query heads per KV head, q streams per KV stream
    const char * q; size_t nbq1, nbq2, nbq3;
    const char * k; size_t nbk1, nbk2, nbk3; int k_kind;
    const char * v; size_t nbv1, nbv2, nbv3; int v_kind;
    size_t k_row, v_row; // bytes of one KV head's K / V row of one cell
    const char * mask; size_t nbm1, nbm3; int64_t mask_ne3;
    float scale;
    const float * sinks; // one logit per query head, or nullptr
    char * dst; size_t nb1;
    // derived
    int64_t Rg, Rp;       // rows of one KV head (tokens x its query heads), padded
    int64_t HG;           // KV heads per work item (their K/V rows of a cell are read together)
    int64_t n_groups;     // ceil(n_head_kv / HG)
    int64_t chunk;        // cells per chunk (multiple of TILE)
    int64_t n_chunks;
    int64_t n_rows_total; // N * n_head * ne3
    int64_t span_cells;   // a private span's tiles x TILE: the most cells one token can see in it
};

struct stats_delta {
    uint64_t shared = 0, priv = 0, skipped = 0;  // tiles (times KV heads) by kind
    uint64_t shared_ns = 0, private_ns = 0, item_ns = 0; // this thread's time in them, and in its work items
    uint64_t shared_flop = 0, private_flop = 0, private_bytes = 0; // their arithmetic; K/V bytes of private pairs
};

using clock_type = std::chrono::steady_clock;

static inline uint64_t ns_since(clock_type::time_point t0, clock_type::time_point t1) {
    return (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// floats of one KV head's state in a work item: QT, Qr, ACC, M, S
static inline int64_t head_floats(const problem & p) {
    const int64_t a = ALIGN_F;
    return round_up(p.DK*p.Rp, a) + round_up(p.Rp*p.DK, a) + round_up(p.Rp*p.DV, a) + 2*round_up(p.Rp, a);
}

static inline void set_chunking(problem & p, int nth) {
    // all KV heads in one work item (the mask tile is scanned once, a cell's K/V rows of all heads are
    // one contiguous read), unless their state would pass 256 KiB of scratch per thread
    const int64_t per_head = head_floats(p) + round_up(TILE*(p.DK + p.DV), ALIGN_F);
    p.HG       = std::max<int64_t>(1, std::min<int64_t>(p.n_head_kv, (256*1024/4) / per_head));
    p.n_groups = (p.n_head_kv + p.HG - 1) / p.HG;
    // about 4 items per thread so threads can even out, never below 4 tiles per chunk
    const int64_t want_chunks = std::max<int64_t>(1, (4*nth + p.ne3*p.n_groups - 1) / (p.ne3*p.n_groups));
    const int64_t want = (p.n_kv + want_chunks - 1) / want_chunks;
    p.chunk    = std::max<int64_t>(4*TILE, round_up(want, TILE));
    p.n_chunks = (p.n_kv + p.chunk - 1) / p.chunk;
}

// (row, cell) pairs of a private tile: each token's rows times the cells it sees; a private tile has fewer than
// N*TILE/4 (token, cell) pairs, padded for the last batch of PAIR_BATCH
static constexpr int64_t PAIR_BATCH = 16;
static inline int64_t max_pairs(const problem & p) {
    return p.Rg*TILE/4 + PAIR_BATCH;
}

// floats of scratch one thread needs
static inline int64_t scratch_floats(const problem & p) {
    const int64_t a = ALIGN_F;
    return p.HG*head_floats(p)           // per KV head: QT, Qr, ACC, M, S
         + round_up(p.HG*TILE*p.DK, a)   // Kf
         + round_up(p.HG*TILE*p.DV, a)   // Vf
         + 2*round_up(TILE*p.Rp, a)      // ST / P^T, MT (the tile's mask laid out as ST)
         + 4*round_up(p.Rp, a)           // mt, ms, sub, rs
         + round_up(p.N*TILE, a)         // MK: mask values per token and cell
         + 2*round_up(p.N, a)            // cnt, off
         + 5*round_up(max_pairs(p), a)   // a private tile's pairs: cell, row, mask, score, sub
         + 2*round_up(p.N*p.span_cells, a) // a private span: each token's cells and their mask values
         + round_up(p.N, a)              // how many each token has
         + round_up(4*p.span_cells, a)   // one token's scores for 4 of its rows
         + a;                            // alignment of the base
}

// private tiles computed together (f16 K/V on AVX-512). A token reads its cells all over the span, so the span's
// K/V stay in L2 while the next span's are requested: 4 tiles measured best on a Zen 4 with cold caches (2 and 3
// the same within noise, 8 and 16 10-15% slower: fewer cells per pass but more misses). Fewer as N grows, so the
// span's lists (N x span_cells) stay small.
static constexpr int64_t SPAN_TILES = 4;
static inline int64_t span_tiles(int64_t N) { return std::max<int64_t>(1, std::min<int64_t>(SPAN_TILES, 64 / N)); }

static inline int64_t partials_floats(const problem & p) {
    return p.n_chunks * p.n_rows_total * (2 + p.DV);
}

// ---------------------------------------------------------------------------- small vector ops

static inline void row_to_f32(int kind, const char * src, float * dst, int64_t n) {
    if (kind == KV_F16) {
        const ggml_fp16_t * s = (const ggml_fp16_t *) src;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
        }
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8) {
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
        }
#endif
        for (; i < n; ++i) {
            dst[i] = GGML_CPU_FP16_TO_FP32(s[i]);
        }
    } else {
        const block_q8_0 * b = (const block_q8_0 *) src;
        for (int64_t ib = 0; ib < n/QK8_0; ++ib) {
            const float d = GGML_CPU_FP16_TO_FP32(b[ib].d);
            for (int j = 0; j < QK8_0; ++j) {
                dst[ib*QK8_0 + j] = d * (float) b[ib].qs[j];
            }
        }
    }
}

static inline float dot_f32(const float * a, const float * b, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(POLYKV_FA_SIMD)
    GGML_F32_VEC acc = GGML_F32_VEC_ZERO;
    for (; i + GGML_F32_EPR <= n; i += GGML_F32_EPR) {
        acc = GGML_F32_VEC_FMA(acc, GGML_F32_VEC_LOAD(a + i), GGML_F32_VEC_LOAD(b + i));
    }
    float tmp[GGML_F32_EPR];
    GGML_F32_VEC_STORE(tmp, acc);
    for (int j = 0; j < GGML_F32_EPR; ++j) {
        sum += tmp[j];
    }
#endif
    for (; i < n; ++i) {
        sum += a[i]*b[i];
    }
    return sum;
}

// y += x*s
static inline void axpy_f32(float * y, const float * x, float s, int64_t n) {
    int64_t i = 0;
#if defined(POLYKV_FA_SIMD)
    const GGML_F32_VEC vs = GGML_F32_VEC_SET1(s);
    for (; i + GGML_F32_EPR <= n; i += GGML_F32_EPR) {
        GGML_F32_VEC_STORE(y + i, GGML_F32_VEC_FMA(GGML_F32_VEC_LOAD(y + i), GGML_F32_VEC_LOAD(x + i), vs));
    }
#endif
    for (; i < n; ++i) {
        y[i] += x[i]*s;
    }
}

static inline void scale_f32(float * y, float s, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        y[i] *= s;
    }
}

// a tile's scores S[c*ld + j] (c < tn, j < n; n a multiple of RPAD) = exp(S - sub[j]), and rs[j] = their sum over
// c, added in cell order: one column of vectors at a time, its sums and subtrahends held in registers
static inline void exp_sub_sum_tile(float * S, int64_t tn, int64_t ld, const float * sub, float * rs, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; j + 16 <= n; j += 16) {
        const __m512 vs = _mm512_loadu_ps(sub + j);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < tn; ++c) {
            const __m512 e = ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(S + c*ld + j), vs));
            _mm512_storeu_ps(S + c*ld + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(rs + j, sum);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= n; j += 8) {
        const __m256 vs = _mm256_loadu_ps(sub + j);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < tn; ++c) {
            const __m256 e = ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(S + c*ld + j), vs));
            _mm256_storeu_ps(S + c*ld + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(rs + j, sum);
    }
#endif
    for (; j < n; ++j) {
        float sum = 0.0f;
        for (int64_t c = 0; c < tn; ++c) {
            S[c*ld + j] = expf(S[c*ld + j] - sub[j]);
            sum += S[c*ld + j];
        }
        rs[j] = sum;
    }
}

// cache lines of the rows of cells [c0, c0+n) of hg heads (row bytes each), for reading soon
static inline void prefetch_rows(const char * base, int64_t c0, int64_t n, size_t nb1, size_t nb2, int64_t hg,
                                 size_t row) {
    for (int64_t c = c0; c < c0 + n; ++c) {
        for (int64_t gl = 0; gl < hg; ++gl) {
            const char * r = base + c*nb1 + gl*nb2;
            for (size_t b = 0; b < row; b += 64) {
                __builtin_prefetch(r + b, 0, 2);
            }
        }
    }
}

// K and V rows of a chunk's cells requested ahead of use, in cell order, each cell once (in a server they come from
// memory: each layer's weights and the other layers' K/V pass through the caches between two attention nodes)
struct prefetcher {
    const char * k, * v;   // the group's first head's rows of cell 0
    size_t nbk1, nbk2, k_row, nbv1, nbv2, v_row;
    int64_t hg;
    int64_t next, end;     // cells [next, end) not requested yet
    int64_t goal;          // drip() requests cells below this one
    // requests the rows of every cell below c
    void upto(int64_t c) {
        c = std::min(c, end);
        if (c > next) {
            prefetch_rows(k, next, c - next, nbk1, nbk2, hg, k_row);
            prefetch_rows(v, next, c - next, nbv1, nbv2, hg, v_row);
            next = c;
        }
    }
    // requests the rows of n more cells below the goal: a shared tile's GEMMs spread the requests for the next tile
    // over its computation instead of one burst of a tile's lines at its start (768 at the default model's heads)
    void drip(int64_t n) { upto(std::min(goal, next + n)); }
};

// mk[0..n) = the mask row m as f32; n_seen: values not -inf, n_zero: values 0
static inline void scan_mask(const char * m, float * mk, int64_t n, int32_t & n_seen, int32_t & n_zero) {
    const ggml_fp16_t * s = (const ggml_fp16_t *) m;
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    for (; c + 16 <= n; c += 16) {
        const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + c)));
        _mm512_storeu_ps(mk + c, v);
        n_seen += __builtin_popcount(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_UQ));
        n_zero += __builtin_popcount(_mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ));
    }
#endif
    for (; c < n; ++c) {
        mk[c] = GGML_CPU_FP16_TO_FP32(s[c]);
        n_seen += mk[c] != -INFINITY;
        n_zero += mk[c] == 0.0f;
    }
}

// list[0..) = the cells c < n with mk[c] not -inf, in order; returns how many
static inline int32_t seen_cells(const float * mk, int64_t n, int32_t * list) {
    int32_t nl = 0;
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512  ninf = _mm512_set1_ps(-INFINITY);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; c + 16 <= n; c += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(mk + c), ninf, _CMP_NEQ_UQ);
        _mm512_mask_compressstoreu_epi32(list + nl, k, idx);
        nl += __builtin_popcount(k);
        idx = _mm512_add_epi32(idx, step);
    }
#endif
    for (; c < n; ++c) {
        if (mk[c] != -INFINITY) {
            list[nl++] = (int32_t) c;
        }
    }
    return nl;
}

// ---------------------------------------------------------------------------- GEMM micro-kernel
// C[M x Ncols] = start + A * B, A(i, kk) = A[i*a_is + kk*a_ks], B row-major [K x Ncols] (ldb), C row-major (ldc);
// Ncols a multiple of the vector width. What C starts from and what else a block does as it goes (gemm_io): 0, or
// C0 (same layout as C; C itself to accumulate) times rs[i] per row where rs is given; where cmax is given and the
// CPU has a vector max (x86: AVX or AVX-512), cmax[j] = max(cmax[j], every C[i][j]), while the block is in registers.
// Each C value is computed as if C were set first and then added to: the same roundings, in the same order.

struct gemm_io {
    const float * C0 = nullptr;   // start values (nullptr: 0)
    const float * rs = nullptr;   // per row of C0 (nullptr: 1)
    float *       cmax = nullptr; // column maxima to raise (nullptr: none)
};

#if defined(POLYKV_FA_SIMD) && defined(__AVX512F__)
#define POLYKV_FA_VEC_MAX(a, b) _mm512_max_ps(a, b)
#elif defined(POLYKV_FA_SIMD) && defined(__AVX__) && !defined(__AVX512F__)
#define POLYKV_FA_VEC_MAX(a, b) _mm256_max_ps(a, b)
#endif

// whether gemm() raises io.cmax (else the caller takes the maxima itself)
static constexpr bool GEMM_MAX =
#if defined(POLYKV_FA_VEC_MAX)
    true;
#else
    false;
#endif

#if defined(POLYKV_FA_SIMD)
#if defined(__AVX512F__)
static constexpr int UK_RM = 4, UK_RN = 4;
#elif defined(__AVX2__) || defined(__AVX__)
static constexpr int UK_RM = 4, UK_RN = 2;
#else
static constexpr int UK_RM = 2, UK_RN = 2;
#endif

template <int RM, int RN>
static inline void ukernel(float * C, int64_t ldc, const gemm_io & io, // io.C0 may be C: each value is read before it is written
                           const float * GGML_RESTRICT A, int64_t a_is, int64_t a_ks,
                           const float * GGML_RESTRICT B, int64_t ldb, int64_t K) {
    constexpr int E = GGML_F32_EPR;
    GGML_F32_VEC acc[RM][RN];
    for (int i = 0; i < RM; ++i) {
        const GGML_F32_VEC s = GGML_F32_VEC_SET1(io.rs ? io.rs[i] : 1.0f);
        for (int r = 0; r < RN; ++r) {
            acc[i][r] = io.C0 ? GGML_F32_VEC_LOAD(io.C0 + i*ldc + r*E) : GGML_F32_VEC_ZERO;
            if (io.rs) {
                acc[i][r] = GGML_F32_VEC_MUL(acc[i][r], s);
            }
        }
    }
    for (int64_t kk = 0; kk < K; ++kk) {
        GGML_F32_VEC bv[RN];
        for (int r = 0; r < RN; ++r) {
            bv[r] = GGML_F32_VEC_LOAD(B + kk*ldb + r*E);
        }
        for (int i = 0; i < RM; ++i) {
            const GGML_F32_VEC a = GGML_F32_VEC_SET1(A[i*a_is + kk*a_ks]);
            for (int r = 0; r < RN; ++r) {
                acc[i][r] = GGML_F32_VEC_FMA(acc[i][r], bv[r], a);
            }
        }
    }
    for (int i = 0; i < RM; ++i) {
        for (int r = 0; r < RN; ++r) {
            GGML_F32_VEC_STORE(C + i*ldc + r*E, acc[i][r]);
        }
    }
#if defined(POLYKV_FA_VEC_MAX)
    if (io.cmax) {
        for (int r = 0; r < RN; ++r) {
            GGML_F32_VEC m = acc[0][r];
            for (int i = 1; i < RM; ++i) {
                m = POLYKV_FA_VEC_MAX(m, acc[i][r]);
            }
            GGML_F32_VEC_STORE(io.cmax + r*E, POLYKV_FA_VEC_MAX(GGML_F32_VEC_LOAD(io.cmax + r*E), m));
        }
    }
#endif
}

// the io of the block from row i, column j
static inline gemm_io at(const gemm_io & io, int64_t ldc, int64_t i, int64_t j) {
    return { io.C0 ? io.C0 + i*ldc + j : nullptr, io.rs ? io.rs + i : nullptr, io.cmax ? io.cmax + j : nullptr };
}

template <int RM>
static inline void gemm_rows(float * C, int64_t ldc, const gemm_io & io, const float * A, int64_t a_is, int64_t a_ks,
                             const float * B, int64_t ldb, int64_t K, int64_t Ncols) {
    constexpr int E = GGML_F32_EPR;
    int64_t j = 0;
    for (; j + UK_RN*E <= Ncols; j += UK_RN*E) {
        ukernel<RM, UK_RN>(C + j, ldc, at(io, ldc, 0, j), A, a_is, a_ks, B + j, ldb, K);
    }
    // the rest in one pass when it fits the registers (e.g. 48 rows = 3 vectors on AVX-512)
    const int64_t rest = (Ncols - j)/E;
    if (UK_RN >= 3 && rest == 3) {
        ukernel<RM, 3>(C + j, ldc, at(io, ldc, 0, j), A, a_is, a_ks, B + j, ldb, K);
        j += 3*E;
    } else if (UK_RN >= 2 && rest >= 2) {
        ukernel<RM, 2>(C + j, ldc, at(io, ldc, 0, j), A, a_is, a_ks, B + j, ldb, K);
        j += 2*E;
    }
    for (; j + E <= Ncols; j += E) {
        ukernel<RM, 1>(C + j, ldc, at(io, ldc, 0, j), A, a_is, a_ks, B + j, ldb, K);
    }
}
#endif

static void gemm(float * C, int64_t ldc, const gemm_io & io, const float * A, int64_t a_is, int64_t a_ks,
                 const float * B, int64_t ldb, int64_t M, int64_t K, int64_t Ncols, prefetcher * pf = nullptr) {
#if defined(POLYKV_FA_SIMD)
    int64_t i = 0;
#if defined(__AVX512F__)
    // a shared tile's two GEMMs at N = 16 and GQA 3 (48 and 64 columns) in blocks of more rows: 24 accumulators of
    // the 32 registers, fewer passes over B (on a Zen 4, with the next tile's requests dripped, the node ran 4-5%
    // faster than in blocks of 4 rows, warm and cold; 8 rows for 16 or 32 columns: within noise at N = 4 and 8)
    if (Ncols == 3*GGML_F32_EPR) {
        for (; i + 8 <= M; i += 8) {
            ukernel<8, 3>(C + i*ldc, ldc, at(io, ldc, i, 0), A + i*a_is, a_is, a_ks, B, ldb, K);
            if (pf) {
                pf->drip(2);
            }
        }
    } else if (Ncols == 4*GGML_F32_EPR) {
        for (; i + 6 <= M; i += 6) {
            ukernel<6, 4>(C + i*ldc, ldc, at(io, ldc, i, 0), A + i*a_is, a_is, a_ks, B, ldb, K);
            if (pf) {
                pf->drip(2);
            }
        }
    }
#endif
    for (; i + UK_RM <= M; i += UK_RM) {
        gemm_rows<UK_RM>(C + i*ldc, ldc, at(io, ldc, i, 0), A + i*a_is, a_is, a_ks, B, ldb, K, Ncols);
        if (pf) {
            pf->drip(1);
        }
    }
    for (; i < M; ++i) {
        gemm_rows<1>(C + i*ldc, ldc, at(io, ldc, i, 0), A + i*a_is, a_is, a_ks, B, ldb, K, Ncols);
    }
#else
    for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < Ncols; ++j) {
            C[i*ldc + j] = io.C0 ? io.C0[i*ldc + j]*(io.rs ? io.rs[i] : 1.0f) : 0.0f;
        }
        for (int64_t kk = 0; kk < K; ++kk) {
            const float a = A[i*a_is + kk*a_ks];
            for (int64_t j = 0; j < Ncols; ++j) {
                C[i*ldc + j] += a*B[kk*ldb + j];
            }
        }
    }
#endif
}

// ---------------------------------------------------------------------------- one work item

struct head_state {
    float * QT, * Qr, * ACC, * M, * S;
};

struct scratch {
    float * Kf, * Vf, * ST, * MT;
    float * mt, * ms, * sub, * rs;
    float * MK;
    int32_t * cnt, * off;
    int32_t * pc, * pr;   // private tile: pair k's cell and row
    float * pm, * psc, * psb; // its mask value, score, and the row's new max
    int32_t * sc, * sn;   // private span: token i's cells (from sc + i*span_cells, relative to the span), their count
    float * sm, * ssc;    // their mask values; a token's scores
    float * heads; // HG x head_floats
};

static scratch carve(const problem & p, float * base) {
    float * w = (float *) (((uintptr_t) base + 63) & ~(uintptr_t) 63);
    auto take = [&](int64_t n) { float * r = w; w += round_up(n, ALIGN_F); return r; };
    scratch s;
    s.Kf  = take(p.HG*TILE*p.DK);
    s.Vf  = take(p.HG*TILE*p.DV);
    s.ST  = take(TILE*p.Rp);
    s.MT  = take(TILE*p.Rp);
    s.mt  = take(p.Rp); s.ms = take(p.Rp); s.sub = take(p.Rp); s.rs = take(p.Rp);
    s.MK  = take(p.N*TILE);
    s.cnt  = (int32_t *) take(p.N);
    s.off  = (int32_t *) take(p.N);
    const int64_t np = max_pairs(p);
    s.pc  = (int32_t *) take(np); s.pr = (int32_t *) take(np);
    s.pm  = take(np); s.psc = take(np); s.psb = take(np);
    s.sc  = (int32_t *) take(p.N*p.span_cells);
    s.sm  = take(p.N*p.span_cells);
    s.sn  = (int32_t *) take(p.N);
    s.ssc = take(4*p.span_cells);
    s.heads = w;
    return s;
}

static head_state head_of(const problem & p, const scratch & s, int64_t gl) {
    float * w = s.heads + gl*head_floats(p);
    auto take = [&](int64_t n) { float * r = w; w += round_up(n, ALIGN_F); return r; };
    head_state h;
    h.QT  = take(p.DK*p.Rp);
    h.Qr  = take(p.Rp*p.DK);
    h.ACC = take(p.Rp*p.DV);
    h.M   = take(p.Rp);
    h.S   = take(p.Rp);
    return h;
}

// one shared tile of one KV head: all its rows at once (two GEMMs and a vectorised online softmax)
static void shared_tile(const problem & p, const scratch & s, const head_state & hs, const float * Kf, const float * Vf,
                        int64_t tn, bool unmasked, prefetcher & pf) {
    const int64_t DK = p.DK, DV = p.DV, Rg = p.Rg, Rp = p.Rp;
    for (int64_t r = 0; r < Rp; ++r) {
        s.mt[r] = -INFINITY;
    }
    // scores: from 0 where every row sees every cell (padded rows' scores are never used), else from the mask; each
    // row's max over the tile taken as the GEMM's blocks are stored, where the CPU has a vector max
    gemm_io scores;
    scores.C0   = unmasked ? nullptr : s.MT;
    scores.cmax = GEMM_MAX ? s.mt : nullptr;
    gemm(s.ST, Rp, scores, Kf, DK, 1, hs.QT, Rp, tn, DK, Rp, &pf);
    if (!GEMM_MAX) {
        for (int64_t c = 0; c < tn; ++c) {
            const float * row = s.ST + c*Rp;
            for (int64_t r = 0; r < Rp; ++r) {
                s.mt[r] = row[r] > s.mt[r] ? row[r] : s.mt[r];
            }
        }
    }
    for (int64_t r = 0; r < Rp; ++r) {
        const float Mold = hs.M[r];
        const float Mnew = std::max(Mold, s.mt[r]);
        s.sub[r] = Mnew == -INFINITY ? 0.0f : Mnew;
        s.ms[r]  = Mold == -INFINITY ? 0.0f : (Mold == Mnew ? 1.0f : expf(Mold - Mnew));
        hs.M[r]  = Mnew;
    }
    exp_sub_sum_tile(s.ST, tn, Rp, s.sub, s.rs, Rp);
    for (int64_t r = 0; r < Rg; ++r) {
        hs.S[r] = hs.S[r]*s.ms[r] + s.rs[r];
    }
    // ACC[Rg x DV] = ACC*ms (rescaled to the new maxima as the GEMM loads it) + P[Rg x tn] * Vf[tn x DV],
    // P(r, c) = ST[c*Rp + r]
    gemm_io acc;
    acc.C0 = hs.ACC;
    acc.rs = s.ms;
    gemm(hs.ACC, DV, acc, s.ST, 1, Rp, Vf, DV, Rg, tn, DV, &pf);
}

// ---------------------------------------------------------------------------- private tiles
// A private tile's work is token i's rk2 rows, each over the cells token i sees (in decode, about 64/N cells of
// a tile per token). On AVX-512 with f16 K and V, private spans (below): a token's rows scored 16/rows cells at
// a time from the cache's f16 rows (16 accumulators, one transposed reduction), each V row added into all of
// the token's rows at once. Elsewhere a list of (row, cell) pairs, row by row: the f32 tile scored PAIR_BATCH
// pairs at a time, the exps one vector pass over the tile's pairs, V added row by row.

#if defined(POLYKV_FA_SIMD) && defined(__AVX512F__)
// one vector of the 16 accumulators' sums, in order (halves, quarters, then pairs and lanes of each 128 bits)
static inline __m512 reduce16(const __m512 * acc) {
    __m512 v1[8], v2[4], v3[2];
    for (int j = 0; j < 8; ++j) { // lanes 0-7: acc[j], 8-15: acc[j+8]
        v1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[j], acc[j + 8], 0x44), _mm512_shuffle_f32x4(acc[j], acc[j + 8], 0xEE));
    }
    for (int j = 0; j < 4; ++j) { // quarters: acc[j], acc[j+8], acc[j+4], acc[j+12]
        v2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v1[j], v1[j + 4], 0x88), _mm512_shuffle_f32x4(v1[j], v1[j + 4], 0xDD));
    }
    for (int j = 0; j < 2; ++j) {
        v3[j] = _mm512_add_ps(_mm512_shuffle_ps(v2[j], v2[j + 2], 0x44), _mm512_shuffle_ps(v2[j], v2[j + 2], 0xEE));
    }
    const __m512 v4 = _mm512_add_ps(_mm512_shuffle_ps(v3[0], v3[1], 0x88), _mm512_shuffle_ps(v3[0], v3[1], 0xDD));
    // v4 holds acc[0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15]: put them in order
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, v4);
}
#endif

// out[j] = dot(Qr row pr[j], Kf row pc[j]) + pm[j] for the PAIR_BATCH pairs from k0 (DK a multiple of 32)
static inline void score_pairs(const float * Qr, const float * Kf, int64_t DK, const int32_t * pr, const int32_t * pc,
                               const float * pm, float * out) {
#if defined(POLYKV_FA_SIMD) && defined(__AVX512F__)
    __m512 acc[PAIR_BATCH];
    const float * qa[PAIR_BATCH];
    const float * ka[PAIR_BATCH];
    for (int j = 0; j < PAIR_BATCH; ++j) {
        acc[j] = _mm512_setzero_ps();
        qa[j]  = Qr + pr[j]*DK;
        ka[j]  = Kf + pc[j]*DK;
    }
    for (int64_t d = 0; d < DK; d += 16) {
        for (int j = 0; j < PAIR_BATCH; ++j) {
            acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qa[j] + d), _mm512_loadu_ps(ka[j] + d), acc[j]);
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(reduce16(acc), _mm512_loadu_ps(pm)));
#else
    for (int j = 0; j < PAIR_BATCH; ++j) {
        out[j] = dot_f32(Qr + pr[j]*DK, Kf + pc[j]*DK, DK) + pm[j];
    }
#endif
}

// y[j] = exp(x[j] - sub[j]) for j < n (n a multiple of PAIR_BATCH)
static inline void exp_sub(float * y, const float * x, const float * sub, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; j + 16 <= n; j += 16) {
        _mm512_storeu_ps(y + j, ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(sub + j))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(y + j, ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(sub + j))));
    }
#endif
    for (; j < n; ++j) {
        y[j] = expf(x[j] - sub[j]);
    }
}

// acc[0..DV) = acc*ms + sum_j w[j] * V row c[j], for the n cells of one row
static inline void accumulate_row(float * acc, float ms, const float * Vf, int64_t DV, const int32_t * c, const float * w,
                                  int64_t n) {
#if defined(POLYKV_FA_SIMD)
    constexpr int E = GGML_F32_EPR;
    constexpr int RV = 4; // vectors of the row kept in registers at a time
    int64_t d = 0;
    for (; d + RV*E <= DV; d += RV*E) {
        GGML_F32_VEC a[RV];
        const GGML_F32_VEC vms = GGML_F32_VEC_SET1(ms);
        for (int r = 0; r < RV; ++r) {
            a[r] = GGML_F32_VEC_MUL(GGML_F32_VEC_LOAD(acc + d + r*E), vms);
        }
        for (int64_t j = 0; j < n; ++j) {
            const GGML_F32_VEC wj = GGML_F32_VEC_SET1(w[j]);
            const float * v = Vf + c[j]*DV + d;
            for (int r = 0; r < RV; ++r) {
                a[r] = GGML_F32_VEC_FMA(a[r], GGML_F32_VEC_LOAD(v + r*E), wj);
            }
        }
        for (int r = 0; r < RV; ++r) {
            GGML_F32_VEC_STORE(acc + d + r*E, a[r]);
        }
    }
    if (d < DV) { // DV is a multiple of 32: the rest, vector by vector over the cells
        if (ms != 1.0f) {
            scale_f32(acc + d, ms, DV - d);
        }
        for (int64_t j = 0; j < n; ++j) {
            axpy_f32(acc + d, Vf + c[j]*DV + d, w[j], DV - d);
        }
    }
#else
    if (ms != 1.0f) {
        scale_f32(acc, ms, DV);
    }
    for (int64_t j = 0; j < n; ++j) {
        axpy_f32(acc, Vf + c[j]*DV, w[j], DV);
    }
#endif
}

#if defined(POLYKV_FA_SIMD) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define POLYKV_FA_F16_DIRECT 1
// Private spans, f16 K and V straight from the cache. A span is up to span_tiles private tiles of one chunk; each
// token's cells over all of them are listed, then each token's rows are computed over its list at once: one max,
// one rescale of its accumulators and one pass of exps per span, not per tile (in decode a token sees ~64/N cells
// of a tile, and that per-pass work cost more than the cells). A private cell is read by a few rows each:
// converting its f16 rows in registers costs less than writing and reading an f32 copy.

// scores of HN rows of one token (Q rows DK apart) over its cells c[0 .. cn) (cn <= CN, HN*CN <= 16; K rows f16 at
// k + cell*nbk1): out[h*ws + j] = q_h . k_j + m[j]
template <int HN, int CN>
static inline void score_cells_f16(const float * Q, int64_t DK, const char * k, size_t nbk1, const int32_t * c,
                                   int64_t cn, const float * m, float * out, int64_t ws) {
    static_assert(HN*CN <= 16, "16 accumulators");
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
    }
    const ggml_fp16_t * kr[CN];
    for (int j = 0; j < CN; ++j) {
        kr[j] = (const ggml_fp16_t *) (k + c[j < cn ? j : 0]*nbk1);
    }
    for (int64_t d = 0; d < DK; d += 16) {
        __m512 q[HN];
        for (int h = 0; h < HN; ++h) {
            q[h] = _mm512_loadu_ps(Q + h*DK + d);
        }
        for (int j = 0; j < CN; ++j) {
            const __m512 kv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (kr[j] + d)));
            for (int h = 0; h < HN; ++h) {
                acc[h*CN + j] = _mm512_fmadd_ps(q[h], kv, acc[h*CN + j]);
            }
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(acc));
    for (int h = 0; h < HN; ++h) {
        for (int64_t j = 0; j < cn; ++j) {
            out[h*ws + j] = sums[h*CN + j] + m[j];
        }
    }
}

// scores of HN rows of one token over its n cells: out[h*n + j]
template <int HN>
static inline void score_token_f16(const float * Q, int64_t DK, const char * k, size_t nbk1, const int32_t * c,
                                   int64_t n, const float * m, float * out) {
    constexpr int CN = 16/HN;
    for (int64_t j0 = 0; j0 < n; j0 += CN) {
        score_cells_f16<HN, CN>(Q, DK, k, nbk1, c + j0, std::min<int64_t>(CN, n - j0), m + j0, out + j0, n);
    }
}

// y[j] = exp(x[j] - sub) for j < n; returns their sum
static inline float exp_sub_sum(float * y, int64_t n, float sub) {
    const __m512 vs = _mm512_set1_ps(sub);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(y + j), vs));
        _mm512_storeu_ps(y + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
        const __mmask16 k = (__mmask16) ((1u << (n - j)) - 1);
        const __m512 e = ggml_v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, y + j), vs));
        _mm512_mask_storeu_ps(y + j, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(sum);
}

// the largest of x[0..n) and init
static inline float max_of(const float * x, int64_t n, float init) {
    __m512 mx = _mm512_set1_ps(init);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + j));
    }
    if (j < n) {
        const __mmask16 k = (__mmask16) ((1u << (n - j)) - 1);
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, x + j));
    }
    return _mm512_reduce_max_ps(mx);
}

// rows acc[h*DV + d ..] (h < HN) = acc*ms[h] + sum_j w[h*n + j] * V row c[j], dims [d, d + 16*NV), V rows f16 at
// v + cell*nbv1: the rows of one token read the same cells, so each V row is converted once for all of them
template <int HN, int NV>
static inline void accumulate_rows_f16(float * acc, int64_t DV, const float * ms, const char * v, size_t nbv1,
                                       const int32_t * c, const float * w, int64_t n, int64_t d) {
    __m512 a[HN][NV];
    for (int h = 0; h < HN; ++h) {
        const __m512 m = _mm512_set1_ps(ms[h]);
        for (int r = 0; r < NV; ++r) {
            a[h][r] = _mm512_mul_ps(_mm512_loadu_ps(acc + h*DV + d + 16*r), m);
        }
    }
    for (int64_t j = 0; j < n; ++j) {
        const ggml_fp16_t * row = (const ggml_fp16_t *) (v + c[j]*nbv1) + d;
        __m512 x[NV];
        for (int r = 0; r < NV; ++r) {
            x[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (row + 16*r)));
        }
        for (int h = 0; h < HN; ++h) {
            const __m512 wj = _mm512_set1_ps(w[h*n + j]);
            for (int r = 0; r < NV; ++r) {
                a[h][r] = _mm512_fmadd_ps(x[r], wj, a[h][r]);
            }
        }
    }
    for (int h = 0; h < HN; ++h) {
        for (int r = 0; r < NV; ++r) {
            _mm512_storeu_ps(acc + h*DV + d + 16*r, a[h][r]);
        }
    }
}

// HN rows of one token (from row r, Q rows of Qr, accumulators of ACC) over its n cells c with mask values m:
// scores into sc (HN*n floats), the online softmax's one step, V added (DV a multiple of 32)
template <int HN>
static inline void token_rows_f16(const problem & p, const head_state & hs, int64_t r, const char * k, const char * v,
                                  const int32_t * c, const float * m, int64_t n, float * sc) {
    score_token_f16<HN>(hs.Qr + r*p.DK, p.DK, k, p.nbk1, c, n, m, sc);
    float ms[HN];
    for (int h = 0; h < HN; ++h) {
        const float Mold = hs.M[r + h];
        const float Mnew = max_of(sc + h*n, n, Mold); // finite: every listed cell's mask value is
        ms[h] = Mold == -INFINITY ? 0.0f : (Mold == Mnew ? 1.0f : expf(Mold - Mnew));
        hs.S[r + h] = hs.S[r + h]*ms[h] + exp_sub_sum(sc + h*n, n, Mnew);
        hs.M[r + h] = Mnew;
    }
    float * acc = hs.ACC + r*p.DV;
    int64_t d = 0;
    for (; d + 64 <= p.DV; d += 64) {
        accumulate_rows_f16<HN, 4>(acc, p.DV, ms, v, p.nbv1, c, sc, n, d);
    }
    if (d < p.DV) {
        accumulate_rows_f16<HN, 2>(acc, p.DV, ms, v, p.nbv1, c, sc, n, d);
    }
}

// adds token i's cells of a private tile (from cell t0, its mask row in s.MK) to the span that starts at cell ts
static inline void span_add(const problem & p, const scratch & s, int64_t i, int64_t t0, int64_t tn, int64_t ts) {
    int32_t * c = s.sc + i*p.span_cells + s.sn[i];
    float   * m = s.sm + i*p.span_cells + s.sn[i];
    const float * mk = s.MK + i*TILE;
    const int32_t nl = seen_cells(mk, tn, c);
    for (int32_t j = 0; j < nl; ++j) {
        m[j] = mk[c[j]];
        c[j] += (int32_t) (t0 - ts);
    }
    s.sn[i] += nl;
}

// every KV head of the group over the span's listed cells (K/V of head gl at kbase/vbase + gl*nbk2/nbv2), token by
// token (a cell's rows of all heads lie together); empties the span. The cells after it are requested meanwhile, a
// span's worth spread over the tokens, so they arrive while this span is computed.
static void private_span(const problem & p, const scratch & s, int64_t hg, const char * kbase, const char * vbase,
                         int64_t ts, int64_t te, prefetcher & pf) {
    for (int64_t i = 0; i < p.N; ++i) {
        pf.upto(te + p.span_cells*(i + 1)/p.N);
        const int64_t n = s.sn[i];
        if (n == 0) {
            continue;
        }
        const int32_t * c = s.sc + i*p.span_cells;
        const float   * m = s.sm + i*p.span_cells;
        for (int64_t gl = 0; gl < hg; ++gl) {
            const head_state hs = head_of(p, s, gl);
            const char * k = kbase + ts*p.nbk1 + gl*p.nbk2;
            const char * v = vbase + ts*p.nbv1 + gl*p.nbv2;
            // the token's rows in groups of 4 (one V row converted once per group)
            for (int64_t h0 = 0; h0 < p.rk2; h0 += 4) {
                const int64_t r = i*p.rk2 + h0;
                switch (std::min<int64_t>(4, p.rk2 - h0)) {
                    case 1:  token_rows_f16<1>(p, hs, r, k, v, c, m, n, s.ssc); break;
                    case 2:  token_rows_f16<2>(p, hs, r, k, v, c, m, n, s.ssc); break;
                    case 3:  token_rows_f16<3>(p, hs, r, k, v, c, m, n, s.ssc); break;
                    default: token_rows_f16<4>(p, hs, r, k, v, c, m, n, s.ssc); break;
                }
            }
        }
        s.sn[i] = 0;
    }
}
#endif

// lists the pairs of a private tile (the same for every KV head): for each token that sees cells of it, its rk2
// rows over those cells; s.off[i] is where token i's pairs start (row h of it: off + h*cnt[i]). Returns the count.
static int64_t private_pairs(const problem & p, const scratch & s, int64_t tn) {
    int64_t np = 0;
    for (int64_t i = 0; i < p.N; ++i) {
        s.off[i] = (int32_t) np;
        if (s.cnt[i] == 0) {
            continue;
        }
        const float * mk = s.MK + i*TILE;
        int32_t * pc0 = s.pc + np;
        const int32_t nl = seen_cells(mk, tn, pc0);
        s.cnt[i] = nl; // as scan_mask counted (the same test); private_tile reads it
        for (int64_t h = 0; h < p.rk2; ++h) {
            const int32_t r = (int32_t) (i*p.rk2 + h);
            for (int32_t j = 0; j < nl; ++j) {
                s.pc[np + j] = pc0[j];
                s.pr[np + j] = r;
                s.pm[np + j] = mk[pc0[j]];
            }
            np += nl;
        }
    }
    // the last batch's padding: a valid pair whose score is never read
    for (int64_t k = np; k < round_up(np, PAIR_BATCH); ++k) {
        s.pc[k] = 0; s.pr[k] = 0; s.pm[k] = 0.0f;
    }
    return np;
}

// one KV head over a private tile's np pairs (private_pairs), K and V the tile's f32 rows
static void private_tile(const problem & p, const scratch & s, const head_state & hs, const float * Kf, const float * Vf,
                         int64_t np) {
    const int64_t DV = p.DV;
    const int64_t npad = round_up(np, PAIR_BATCH);
    for (int64_t k = 0; k < npad; k += PAIR_BATCH) {
        score_pairs(hs.Qr, Kf, p.DK, s.pr + k, s.pc + k, s.pm + k, s.psc + k);
    }
    // each row's new max over its cells, set for each of its pairs
    for (int64_t i = 0; i < p.N; ++i) {
        const int32_t n = s.cnt[i];
        for (int64_t h = 0; h < p.rk2 && n > 0; ++h) {
            const int64_t k0 = s.off[i] + h*n;
            const int64_t r  = i*p.rk2 + h;
            float mx = hs.M[r];
            for (int64_t j = 0; j < n; ++j) {
                mx = std::max(mx, s.psc[k0 + j]);
            }
            for (int64_t j = 0; j < n; ++j) {
                s.psb[k0 + j] = mx;
            }
        }
    }
    for (int64_t k = np; k < npad; ++k) { // the padding's scores are never read
        s.psb[k] = 0.0f;
    }
    exp_sub(s.psc, s.psc, s.psb, npad);
    for (int64_t i = 0; i < p.N; ++i) {
        const int32_t n = s.cnt[i];
        if (n == 0) {
            continue;
        }
        const int64_t k0 = s.off[i];
        // the token's rows in groups of 4 (one V row converted once per group)
        for (int64_t h0 = 0; h0 < p.rk2; h0 += 4) {
            const int64_t hn = std::min<int64_t>(4, p.rk2 - h0);
            float ms[4];
            for (int64_t h = 0; h < hn; ++h) {
                const int64_t kh   = k0 + (h0 + h)*n;
                const int64_t r    = i*p.rk2 + h0 + h;
                const float   Mold = hs.M[r];
                const float   Mnew = s.psb[kh];
                ms[h] = Mold == -INFINITY ? 0.0f : (Mold == Mnew ? 1.0f : expf(Mold - Mnew));
                float sum = 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    sum += s.psc[kh + j];
                }
                hs.S[r] = hs.S[r]*ms[h] + sum;
                hs.M[r] = Mnew;
            }
            float * acc = hs.ACC + (i*p.rk2 + h0)*DV;
            for (int64_t h = 0; h < hn; ++h) {
                const int64_t kh = k0 + (h0 + h)*n;
                accumulate_row(acc + h*DV, ms[h], Vf, DV, s.pc + kh, s.psc + kh, n);
            }
        }
    }
}

// item = (stream i3, group of KV heads, chunk ch); writes the chunk's partials of the group's rows
static void run_item(const problem & p, int64_t item, float * scratch_base, float * partials, stats_delta & st) {
    const int64_t ch = item % p.n_chunks;
    const int64_t gi = (item / p.n_chunks) % p.n_groups;
    const int64_t i3 = item / (p.n_chunks * p.n_groups);
    const int64_t g0 = gi*p.HG;
    const int64_t hg = std::min(p.HG, p.n_head_kv - g0);

    const int64_t c0 = ch*p.chunk;
    const int64_t c1 = std::min(c0 + p.chunk, p.n_kv);

    const int64_t DK = p.DK, DV = p.DV, N = p.N, rk2 = p.rk2, Rg = p.Rg, Rp = p.Rp;
    const int64_t ik3 = i3 / p.rk3;

    const scratch s = carve(p, scratch_base);
    // where the item's time goes: each lap adds the time since the last one to a tile kind's counter
    const clock_type::time_point t_item = clock_type::now();
    clock_type::time_point t_lap = t_item;
    auto lap = [&](uint64_t & ns) {
        const clock_type::time_point t = clock_type::now();
        ns += ns_since(t_lap, t);
        t_lap = t;
    };
    uint64_t other_ns = 0; // queries, skipped tiles, partials

    // queries of each KV head's rows, scaled: Qr row-major, QT transposed (padded rows are zero)
    for (int64_t gl = 0; gl < hg; ++gl) {
        const head_state hs = head_of(p, s, gl);
        const int64_t    g  = g0 + gl;
        for (int64_t i = 0; i < N; ++i) {
            for (int64_t h = 0; h < rk2; ++h) {
                const int64_t r   = i*rk2 + h;
                const int64_t iq2 = g*rk2 + h;
                const float * q = (const float *) (p.q + i*p.nbq1 + iq2*p.nbq2 + i3*p.nbq3);
                for (int64_t d = 0; d < DK; ++d) {
                    const float x = q[d]*p.scale;
                    hs.Qr[r*DK + d] = x;
                    hs.QT[d*Rp + r] = x;
                }
            }
        }
        for (int64_t d = 0; d < DK; ++d) {
            for (int64_t r = Rg; r < Rp; ++r) {
                hs.QT[d*Rp + r] = 0.0f;
            }
        }
        for (int64_t r = 0; r < Rp; ++r) {
            hs.M[r] = -INFINITY;
            hs.S[r] = 0.0f;
        }
        memset(hs.ACC, 0, sizeof(float)*Rp*DV);
    }

    const char * kbase = p.k + g0*p.nbk2 + ik3*p.nbk3;
    const char * vbase = p.v + g0*p.nbv2 + ik3*p.nbv3;
    const char * mbase = p.mask + (i3 % p.mask_ne3)*p.nbm3;

#if defined(POLYKV_FA_F16_DIRECT)
    const bool raw = p.k_kind == KV_F16 && p.v_kind == KV_F16; // private tiles go to spans
    memset(s.sn, 0, sizeof(int32_t)*N);
#endif
    prefetcher pf = { kbase, vbase, p.nbk1, p.nbk2, p.k_row, p.nbv1, p.nbv2, p.v_row, hg, c0, c1, c0 };
    const uint64_t pair_flop = (uint64_t) (rk2*hg*2*(DK + DV));          // per visible (token, cell) pair
    const uint64_t pair_bytes = (uint64_t) (hg*(p.k_row + p.v_row));
    lap(other_ns);
    int64_t span_t0 = -1, span_n = 0, span_te = 0; // the open span's first cell (-1: none), its tiles, its end
    auto flush = [&]() {
#if defined(POLYKV_FA_F16_DIRECT)
        if (span_t0 >= 0) {
            private_span(p, s, hg, kbase, vbase, span_t0, span_te, pf);
            lap(st.private_ns);
        }
#endif
        span_t0 = -1;
        span_n  = 0;
    };

    for (int64_t t0 = c0; t0 < c1; t0 += TILE) {
        const int64_t tn = std::min(TILE, c1 - t0);
        pf.upto(t0 + tn);

        // mask values of the tile per token (once for all KV heads), how many cells each token sees, and
        // whether every value is 0 (the usual shared tile: then the scores need no mask)
        int64_t seen = 0, zeros = 0;
        for (int64_t i = 0; i < N; ++i) {
            int32_t n_seen = 0, n_zero = 0;
            scan_mask(mbase + i*p.nbm1 + t0*sizeof(ggml_fp16_t), s.MK + i*TILE, tn, n_seen, n_zero);
            s.cnt[i] = n_seen;
            seen  += n_seen;
            zeros += n_zero;
        }
        // the next tile's K and V on their way while this one is computed: dripped by a shared tile's GEMMs
        const bool shared = seen > 0 && 4*seen >= N*tn;
        pf.goal = t0 + 2*TILE;
        if (!shared) {
            pf.upto(pf.goal);
        }
        if (seen == 0) {
            st.skipped += hg;
            lap(other_ns);
            continue;
        }

        // K and V of every head of the group as f32: a cell's rows of all heads lie together in the cache
        auto convert = [&]() {
            for (int64_t c = 0; c < tn; ++c) {
                const char * kc = kbase + (t0 + c)*p.nbk1;
                const char * vc = vbase + (t0 + c)*p.nbv1;
                for (int64_t gl = 0; gl < hg; ++gl) {
                    row_to_f32(p.k_kind, kc + gl*p.nbk2, s.Kf + (gl*TILE + c)*DK, DK);
                    row_to_f32(p.v_kind, vc + gl*p.nbv2, s.Vf + (gl*TILE + c)*DV, DV);
                }
            }
        };

        if (shared) {
            // shared tile: all rows of each KV head at once
            lap(st.shared_ns); // its mask's scan
            flush();
            st.shared += hg;
            st.shared_flop += (uint64_t) seen*pair_flop;
            convert();
            const bool unmasked = zeros == N*tn;
            if (!unmasked) {
                for (int64_t c = 0; c < tn; ++c) {
                    float * row = s.MT + c*Rp;
                    for (int64_t i = 0; i < N; ++i) {
                        const float mv = s.MK[i*TILE + c];
                        for (int64_t h = 0; h < rk2; ++h) {
                            row[i*rk2 + h] = mv;
                        }
                    }
                    for (int64_t r = Rg; r < Rp; ++r) {
                        row[r] = -INFINITY;
                    }
                }
            }
            for (int64_t gl = 0; gl < hg; ++gl) {
                shared_tile(p, s, head_of(p, s, gl), s.Kf + gl*TILE*DK, s.Vf + gl*TILE*DV, tn, unmasked, pf);
            }
            pf.upto(pf.goal);
            lap(st.shared_ns);
        } else {
            // private tile: each token's rows over the cells that token sees
            st.priv += hg;
            st.private_flop  += (uint64_t) seen*pair_flop;
            st.private_bytes += (uint64_t) seen*pair_bytes;
#if defined(POLYKV_FA_F16_DIRECT)
            if (raw) {
                if (span_t0 < 0) {
                    span_t0 = t0;
                }
                for (int64_t i = 0; i < N; ++i) {
                    if (s.cnt[i] > 0) {
                        span_add(p, s, i, t0, tn, span_t0);
                    }
                }
                span_te = t0 + tn;
                lap(st.private_ns);
                if (++span_n*TILE == p.span_cells) {
                    flush();
                }
                continue;
            }
#endif
            // as (row, cell) pairs of the tile's f32 rows
            const int64_t np = private_pairs(p, s, tn);
            convert();
            for (int64_t gl = 0; gl < hg; ++gl) {
                private_tile(p, s, head_of(p, s, gl), s.Kf + gl*TILE*DK, s.Vf + gl*TILE*DV, np);
            }
            lap(st.private_ns);
        }
    }
    flush();

    // partials of this chunk: [M, S, ACC] per row
    for (int64_t gl = 0; gl < hg; ++gl) {
        const head_state hs = head_of(p, s, gl);
        for (int64_t i = 0; i < N; ++i) {
            for (int64_t h = 0; h < rk2; ++h) {
                const int64_t r   = i*rk2 + h;
                const int64_t iq2 = (g0 + gl)*rk2 + h;
                const int64_t gr  = (i3*p.n_head + iq2)*N + i;
                float * part = partials + (ch*p.n_rows_total + gr)*(2 + DV);
                part[0] = hs.M[r];
                part[1] = hs.S[r];
                memcpy(part + 2, hs.ACC + r*DV, sizeof(float)*DV);
            }
        }
    }
    lap(other_ns);
    st.item_ns += ns_since(t_item, t_lap);
}

// merges the chunks of global rows [gr0, gr1) in chunk order and writes dst
static void reduce_rows(const problem & p, int64_t gr0, int64_t gr1, const float * partials, float * tmp) {
    const int64_t DV = p.DV;
    for (int64_t gr = gr0; gr < gr1; ++gr) {
        float M = -INFINITY, S = 0.0f;
        memset(tmp, 0, sizeof(float)*DV);
        for (int64_t ch = 0; ch < p.n_chunks; ++ch) {
            const float * part = partials + (ch*p.n_rows_total + gr)*(2 + DV);
            if (part[1] == 0.0f) {
                continue;
            }
            const float Mn = std::max(M, part[0]);
            const float so = M == -INFINITY ? 0.0f : expf(M - Mn);
            const float sn = expf(part[0] - Mn);
            for (int64_t d = 0; d < DV; ++d) {
                tmp[d] = tmp[d]*so + part[2 + d]*sn;
            }
            S = S*so + part[1]*sn;
            M = Mn;
        }
        const int64_t i1 = gr % p.N;
        const int64_t i2 = (gr / p.N) % p.n_head;
        const int64_t i3 = gr / (p.N*p.n_head);
        if (p.sinks != nullptr) { // as ggml_compute_forward_flash_attn_ext_f16_one_chunk: exp(sink - M) joins S
            const float sink = p.sinks[i2];
            float ms = 1.0f, vs = 1.0f;
            if (sink > M) {
                ms = expf(M - sink);
                M  = sink;
                for (int64_t d = 0; d < DV; ++d) {
                    tmp[d] *= ms;
                }
            } else {
                vs = expf(sink - M);
            }
            // one rounding, written out: GCC fused this multiply-add in one build and not in the next after an
            // unrelated change, which moved the last bit of gpt-oss rows whose sink is their largest logit
            S = std::fma(S, ms, vs);
        }
        const float S_inv = S == 0.0f ? 0.0f : 1.0f/S;
        for (int64_t d = 0; d < DV; ++d) {
            tmp[d] *= S_inv;
        }
        // dst is [DV, n_head, N, ne3] (permuted back)
        memcpy(p.dst + (i3*p.N*p.n_head + i2 + i1*p.n_head)*p.nb1, tmp, sizeof(float)*DV);
    }
}

static int kv_kind_of(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16:  return KV_F16;
        case GGML_TYPE_Q8_0: return KV_Q8_0;
        default:             return -1;
    }
}

// fills p if dst qualifies (shape, types, options); independent of the on/off switch
static bool describe(const ggml_tensor * dst, int nth, problem & p) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    if (dst->op != GGML_OP_FLASH_ATTN_EXT || !q || !k || !v || !mask) {
        return false;
    }
    if (sinks && (sinks->type != GGML_TYPE_F32 || sinks->ne[0] != q->ne[2] || sinks->nb[0] != sizeof(float))) {
        return false;
    }
    const int k_kind = kv_kind_of(k->type);
    const int v_kind = kv_kind_of(v->type);
    if (q->type != GGML_TYPE_F32 || k_kind < 0 || v_kind < 0 || mask->type != GGML_TYPE_F16 || dst->type != GGML_TYPE_F32) {
        return false;
    }
    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (max_bias != 0.0f || softcap != 0.0f) {
        return false;
    }
    const int64_t DK = k->ne[0], DV = v->ne[0], N = q->ne[1];
    if (N < 2 || N >= MAX_ROWS || q->ne[0] != DK || DK % 32 != 0 || DV % 32 != 0 || DK > 512 || DV > 512) {
        return false;
    }
    if (k->ne[1] != v->ne[1] || k->ne[2] != v->ne[2] || k->ne[3] != v->ne[3] || k->ne[2] == 0 ||
        q->ne[2] % k->ne[2] != 0 || q->ne[3] % k->ne[3] != 0) {
        return false;
    }
    if (mask->ne[0] < k->ne[1] || mask->ne[1] < N || mask->ne[2] != 1 || q->ne[3] % mask->ne[3] != 0) {
        return false;
    }
    if (q->nb[0] != sizeof(float) || k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type) ||
        mask->nb[0] != sizeof(ggml_fp16_t) || dst->nb[0] != sizeof(float) ||
        dst->ne[0] != DV || dst->ne[1] != q->ne[2] || dst->ne[2] != N) {
        return false;
    }

    p.DK = DK; p.DV = DV; p.N = N;
    p.n_head = q->ne[2]; p.n_head_kv = k->ne[2]; p.ne3 = q->ne[3]; p.n_kv = k->ne[1];
    p.rk2 = q->ne[2] / k->ne[2]; p.rk3 = q->ne[3] / k->ne[3];
    p.q = (const char *) q->data; p.nbq1 = q->nb[1]; p.nbq2 = q->nb[2]; p.nbq3 = q->nb[3];
    p.k = (const char *) k->data; p.nbk1 = k->nb[1]; p.nbk2 = k->nb[2]; p.nbk3 = k->nb[3]; p.k_kind = k_kind;
    p.v = (const char *) v->data; p.nbv1 = v->nb[1]; p.nbv2 = v->nb[2]; p.nbv3 = v->nb[3]; p.v_kind = v_kind;
    p.k_row = ggml_row_size(k->type, DK); p.v_row = ggml_row_size(v->type, DV);
    p.mask = (const char *) mask->data; p.nbm1 = mask->nb[1]; p.nbm3 = mask->nb[3]; p.mask_ne3 = mask->ne[3];
    p.scale = scale;
    p.sinks = sinks ? (const float *) sinks->data : nullptr;
    p.dst = (char *) dst->data; p.nb1 = dst->nb[1];
    p.Rg = N*p.rk2;
    p.Rp = round_up(p.Rg, RPAD);
    p.n_rows_total = N*p.n_head*p.ne3;
    p.span_cells = span_tiles(N)*TILE;
    set_chunking(p, nth);
    return true;
}

static size_t wsize_of(const problem & p, int nth) {
    return sizeof(float)*(size_t)(nth*scratch_floats(p) + partials_floats(p));
}

#ifdef POLYKV_FA_CORE_ONLY
// one thread, own buffers: lets a test run this build of the computation on dst's sources
bool run_single(ggml_tensor * dst) {
    problem p;
    if (!describe(dst, 1, p)) {
        return false;
    }
    std::vector<float> scratch_buf(scratch_floats(p)), part(partials_floats(p));
    stats_delta st;
    for (int64_t item = 0; item < p.ne3*p.n_groups*p.n_chunks; ++item) {
        run_item(p, item, scratch_buf.data(), part.data(), st);
    }
    reduce_rows(p, 0, p.n_rows_total, part.data(), carve(p, scratch_buf.data()).ST);
    return true;
}
#endif

} // namespace POLYKV_FA_NS

#ifndef POLYKV_FA_CORE_ONLY

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

using namespace POLYKV_FA_NS;

static std::atomic<bool>     g_on{false};
static std::atomic<uint64_t> g_stats[4];
static std::atomic<uint64_t> g_times[POLYKV_FA_N_TIMES];

void ggml_backend_cpu_polykv_set_shared_decode(bool on) { g_on.store(on); }
bool ggml_backend_cpu_polykv_get_shared_decode(void)    { return g_on.load(); }

void ggml_backend_cpu_polykv_shared_decode_stats(uint64_t out[4]) {
    for (int i = 0; i < 4; ++i) {
        out[i] = g_stats[i].load();
    }
}

void ggml_backend_cpu_polykv_shared_decode_times(uint64_t out[POLYKV_FA_N_TIMES]) {
    for (int i = 0; i < POLYKV_FA_N_TIMES; ++i) {
        out[i] = g_times[i].load();
    }
}

void * ggml_backend_cpu_polykv_proc_address(const char * name) {
    static const struct { const char * name; void * fn; } entries[] = {
        { "ggml_backend_cpu_polykv_set_shared_decode",   (void *) ggml_backend_cpu_polykv_set_shared_decode },
        { "ggml_backend_cpu_polykv_get_shared_decode",   (void *) ggml_backend_cpu_polykv_get_shared_decode },
        { "ggml_backend_cpu_polykv_shared_decode_stats", (void *) ggml_backend_cpu_polykv_shared_decode_stats },
        { "ggml_backend_cpu_polykv_shared_decode_times", (void *) ggml_backend_cpu_polykv_shared_decode_times },
    };
    for (const auto & e : entries) {
        if (strcmp(name, e.name) == 0) {
            return e.fn;
        }
    }
    return nullptr;
}

size_t ggml_cpu_polykv_fa_wsize(const ggml_tensor * dst, int n_tasks) {
    // nothing while the switch is off (the reference server's buffers stay upstream's); a graph planned
    // off and computed on finds the buffer too small and leaves the node to upstream's kernel
    problem p;
    return g_on.load(std::memory_order_relaxed) && describe(dst, n_tasks, p) ? wsize_of(p, n_tasks) : 0;
}

bool ggml_cpu_polykv_fa_decode(const ggml_compute_params * params, ggml_tensor * dst) {
    // the switch as this graph compute read it (ggml_graph_compute, once): a set_shared_decode() while the graph
    // runs cannot send the threads of one node down different paths
    if (!params->polykv_shared_decode) {
        return false;
    }
    const int ith = params->ith, nth = params->nth;
    problem p;
    if (!describe(dst, nth, p) || params->wsize < wsize_of(p, nth)) {
        return false;
    }

    const clock_type::time_point t_node = clock_type::now();
    float * wbase    = (float *) params->wdata;
    float * partials = wbase + nth*scratch_floats(p);
    float * mine     = wbase + ith*scratch_floats(p);

    const int64_t n_items = p.ne3 * p.n_groups * p.n_chunks;

    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    stats_delta st;
    for (int64_t item = ith; item < n_items; item = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        run_item(p, item, mine, partials, st);
    }

    ggml_barrier(params->threadpool);

    const int64_t per = (p.n_rows_total + nth - 1) / nth;
    const int64_t gr0 = std::min<int64_t>(ith*per, p.n_rows_total);
    const int64_t gr1 = std::min<int64_t>(gr0 + per, p.n_rows_total);
    reduce_rows(p, gr0, gr1, partials, carve(p, mine).ST);

    if (ith == 0) {
        g_stats[0].fetch_add(1, std::memory_order_relaxed);
        g_times[0].fetch_add(ns_since(t_node, clock_type::now()), std::memory_order_relaxed);
    }
    g_stats[1].fetch_add(st.shared, std::memory_order_relaxed);
    g_stats[2].fetch_add(st.priv, std::memory_order_relaxed);
    g_stats[3].fetch_add(st.skipped, std::memory_order_relaxed);
    const uint64_t times[POLYKV_FA_N_TIMES] = { 0, st.shared_ns, st.private_ns, st.item_ns, st.shared_flop,
                                                st.private_flop, st.private_bytes };
    for (int i = 1; i < POLYKV_FA_N_TIMES; ++i) {
        g_times[i].fetch_add(times[i], std::memory_order_relaxed);
    }
    return true;
}

#endif // POLYKV_FA_CORE_ONLY
