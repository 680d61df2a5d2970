// polykv: Q4_1 weight matmuls in register tiles (see polykv-mm.h).
//
// One call computes a block of at most 16 rows (weights) x 16 columns (activations). Per block of 32
// weights (ib), a row's 4-bit values are unpacked once into both 256-bit halves of a 512-bit vector
// and a pair of columns' 8-bit values is loaded side by side, so one VNNI dot product (vpdpbusd) gives
// the 8 partial sums of two (row, column) outputs; each output keeps ggml's 8 f32 lanes in its half of
// an accumulator. Tiles of 4 rows x 4 column pairs keep 16 accumulators in flight.
//
// The operations per output are exactly ggml_vec_dot_q4_1_q8_1's (arch/x86/quants.c, AVX2 branch; the
// compiler contracts its `summs += m * s` into an FMA, checked in the built library): per block
// acc = fma(d0 * d1, float(dot(qx, qy)), acc) in 8 lanes and summs = fma(m0, s1, summs); then
// hsum_float_8(acc) + summs. Integer dot products are exact whichever instruction forms them.
// Whether a compiler contracts that `summs += m * s` is its choice, so before the first block the kernel
// checks itself: a 16 x 16 block of pseudo-random values through the tiles and through this build's
// ggml_vec_dot_q4_1_q8_1 must agree bit for bit in every output, or the tiles stay off (with a warning).

#include "polykv-mm.h"

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "simd-mappings.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define POLYKV_MM_AVX512 1
#endif

namespace {

constexpr int64_t BLOCK = 16;  // rows and columns of the chunk ggml's mul_mat hands one call

std::atomic<int> g_switch{-1};  // -1: not read yet, 0: off, 1: on (POLYKV_MM_TILES, ggml_cpu_polykv_mm_set)
std::atomic<uint64_t> g_blocks{0};

bool verified();

bool switched_on() {
    int s = g_switch.load(std::memory_order_relaxed);
    if (s < 0) {
        const char * v = std::getenv("POLYKV_MM_TILES");
        s = (v != nullptr && std::strcmp(v, "0") == 0) ? 0 : 1;
        int expected = -1;
        g_switch.compare_exchange_strong(expected, s, std::memory_order_relaxed);
        s = g_switch.load(std::memory_order_relaxed);
    }
    return s == 1;
}

#ifdef POLYKV_MM_AVX512

// ggml's hsum_float_8 (arch/x86/quants.c): the same adds in the same order
inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

inline __m256 upper_half(const __m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// 16 bytes of nibbles in each 128-bit lane -> their low nibbles in lanes 0 and 2, high nibbles in lanes 1 and 3
// (each 256-bit half: one block's 32 values in order, as ggml's bytes_from_nibbles_32)
inline __m512i nibbles(const __m512i q) {
    const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi64(q, shift), _mm512_set1_epi8(0x0F));
}

inline __m128i load_qs(const block_q4_1 * b) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i *>(b->qs));
}

// a row's block as 32 bytes (low nibbles: values 0-15, high nibbles: 16-31), in both 256-bit halves
inline __m512i unpack_row(const block_q4_1 * b) {
    return nibbles(_mm512_broadcast_i32x4(load_qs(b)));
}

// two rows' blocks: row a in the lower 256-bit half, row b in the upper
inline __m512i unpack_rows(const block_q4_1 * a, const block_q4_1 * b) {
    return nibbles(_mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(load_qs(a)), 0xFF00, load_qs(b)));
}

// two columns' blocks side by side: a in the lower half, b in the upper
inline __m512i load_pair(const block_q8_1 * a, const block_q8_1 * b) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a->qs));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b->qs));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// a block's two f16 scales, as the C declaration names them: Q4_1 (d, m), Q8_1 (d, s)
template <typename block> inline float scale_d(const block & b) {
    return GGML_CPU_FP16_TO_FP32(reinterpret_cast<const ggml_half *>(&b)[0]);
}
template <typename block> inline float scale_2(const block & b) {
    return GGML_CPU_FP16_TO_FP32(reinterpret_cast<const ggml_half *>(&b)[1]);
}

// what one call's block needs besides the quantized values, as f32 (per thread, grown once)
struct scratch {
    std::vector<float> d0;  // [row][ib]   the rows' scales
    std::vector<float> d1;  // [ib][16]    the columns' scales
    std::vector<float> s1;  // [ib][16]    the columns' d * sum(qs)
    void fit(int64_t nb) {
        if ((int64_t) d0.size() < BLOCK * nb) {
            d0.resize(BLOCK * nb);
            d1.resize(BLOCK * nb);
            s1.resize(BLOCK * nb);
        }
    }
};

thread_local scratch t_scratch;

// R rows x CP column pairs; out[r][k] = the dot products without the m * s terms (k < 2 * CP).
// x[r]: the rows' blocks; y[k]: the columns' blocks (pairs y[2p], y[2p + 1]); d0 + r * nb: row r's
// scales; d1 + ib * 16 + c0: the scales of this tile's first column.
template <int R, int CP>
inline void tile(int64_t nb, const block_q4_1 * const * x, const block_q8_1 * const * y, const float * d0,
                 const float * d1, int c0, float out[R][2 * CP]) {
    __m512 acc[R][CP];
    __m512i sel[CP];  // picks column c0 + 2p into the lower half of a vector of scales, c0 + 2p + 1 into the upper
    for (int p = 0; p < CP; ++p) {
        sel[p] = _mm512_inserti64x4(_mm512_set1_epi32(c0 + 2 * p), _mm256_set1_epi32(c0 + 2 * p + 1), 1);
        for (int r = 0; r < R; ++r) {
            acc[r][p] = _mm512_setzero_ps();
        }
    }
    for (int64_t ib = 0; ib < nb; ++ib) {
        __m512i qx[R];
        for (int r = 0; r < R; ++r) {
            qx[r] = unpack_row(x[r] + ib);
        }
        const __m512 d1v = _mm512_loadu_ps(d1 + ib * BLOCK);
        for (int p = 0; p < CP; ++p) {
            const __m512i qy = load_pair(y[2 * p] + ib, y[2 * p + 1] + ib);
            const __m512 d1p = _mm512_permutexvar_ps(sel[p], d1v);
            for (int r = 0; r < R; ++r) {
                const __m512 d0d1 = _mm512_mul_ps(_mm512_set1_ps(d0[r * nb + ib]), d1p);
                const __m512 xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qx[r], qy));
                acc[r][p] = _mm512_fmadd_ps(d0d1, xy, acc[r][p]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int p = 0; p < CP; ++p) {
            out[r][2 * p] = hsum_float_8(_mm512_castps512_ps256(acc[r][p]));
            out[r][2 * p + 1] = hsum_float_8(upper_half(acc[r][p]));
        }
    }
}

struct block_job {
    int64_t nb;
    int64_t nrows, ncols;
    const block_q4_1 * x[BLOCK];  // the rows
    const block_q8_1 * y[BLOCK];  // the columns (past ncols: the last one again, never computed)
    const float * d0;
    const float * d1;
    float summs[BLOCK][BLOCK];  // [row][column]
    char * dst;                 // output (row 0, column 0)
    size_t dst_col_stride;      // bytes between columns
};

template <int R, int CP>
void run_tile(const block_job & job, int64_t r0, int64_t c0) {
    float out[R][2 * CP];
    tile<R, CP>(job.nb, job.x + r0, job.y + c0, job.d0 + r0 * job.nb, job.d1, (int) c0, out);
    for (int r = 0; r < R; ++r) {
        for (int k = 0; k < 2 * CP; ++k) {
            float * d = reinterpret_cast<float *>(job.dst + (c0 + k) * job.dst_col_stride) + r0 + r;
            *d = out[r][k] + job.summs[r0 + r][c0 + k];
        }
    }
}

// rows [r0, r0 + R) over the column pairs [0, npairs): 4 pairs (8 columns) at a time, then what is left
template <int R>
void run_pairs(const block_job & job, int64_t r0, int64_t npairs) {
    int64_t p = 0;
    for (; p + 4 <= npairs; p += 4) {
        run_tile<R, 4>(job, r0, 2 * p);
    }
    switch (npairs - p) {
        case 3: run_tile<R, 3>(job, r0, 2 * p); break;
        case 2: run_tile<R, 2>(job, r0, 2 * p); break;
        case 1: run_tile<R, 1>(job, r0, 2 * p); break;
        default: break;
    }
}

// One column c against RP pairs of rows: rows x[2i] and x[2i + 1] side by side in one vector, the column's
// block in both halves. out[2i], out[2i + 1]: the two rows' dot products without the m * s terms.
template <int RP>
inline void column_tile(int64_t nb, const block_q4_1 * const * x, const float * const * d0, const block_q8_1 * y,
                        const float * d1, int c, float out[2 * RP]) {
    __m512 acc[RP];
    for (int i = 0; i < RP; ++i) {
        acc[i] = _mm512_setzero_ps();
    }
    for (int64_t ib = 0; ib < nb; ++ib) {
        const __m512i qy = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(y[ib].qs)));
        const __m512 d1v = _mm512_set1_ps(d1[ib * BLOCK + c]);
        for (int i = 0; i < RP; ++i) {
            const __m512i qx = unpack_rows(x[2 * i] + ib, x[2 * i + 1] + ib);
            const __m512 d0v = _mm512_mask_broadcastss_ps(_mm512_set1_ps(d0[2 * i][ib]), 0xFF00,
                                                          _mm_set_ss(d0[2 * i + 1][ib]));
            const __m512 d0d1 = _mm512_mul_ps(d0v, d1v);
            const __m512 xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, qy));
            acc[i] = _mm512_fmadd_ps(d0d1, xy, acc[i]);
        }
    }
    for (int i = 0; i < RP; ++i) {
        out[2 * i] = hsum_float_8(_mm512_castps512_ps256(acc[i]));
        out[2 * i + 1] = hsum_float_8(upper_half(acc[i]));
    }
}

template <int RP>
void run_column(const block_job & job, int64_t r0, int64_t c) {
    const block_q4_1 * x[2 * RP];
    const float * d0[2 * RP];
    for (int k = 0; k < 2 * RP; ++k) {
        const int64_t r = r0 + k < job.nrows ? r0 + k : job.nrows - 1;  // an odd last row is paired with itself
        x[k] = job.x[r];
        d0[k] = job.d0 + r * job.nb;
    }
    float out[2 * RP];
    column_tile<RP>(job.nb, x, d0, job.y[c], job.d1, (int) c, out);
    float * d = reinterpret_cast<float *>(job.dst + c * job.dst_col_stride);
    for (int k = 0; k < 2 * RP && r0 + k < job.nrows; ++k) {
        d[r0 + k] = out[k] + job.summs[r0 + k][c];
    }
}

void compute(block_job & job, scratch & s) {
    const int64_t nb = job.nb;
    for (int64_t ib = 0; ib < nb; ++ib) {
        _mm512_storeu_ps(s.d1.data() + ib * BLOCK, _mm512_setzero_ps());
        _mm512_storeu_ps(s.s1.data() + ib * BLOCK, _mm512_setzero_ps());
        for (int64_t c = 0; c < job.ncols; ++c) {
            s.d1[ib * BLOCK + c] = scale_d(job.y[c][ib]);
            s.s1[ib * BLOCK + c] = scale_2(job.y[c][ib]);
        }
    }
    job.d0 = s.d0.data();
    job.d1 = s.d1.data();
    // the rows' scales, and the m * s terms 16 columns at once: lane c does ggml's scalar summs = fma(m0, s1,
    // summs); 4 rows' chains interleaved (a row's blocks are a chain of dependent FMAs)
    for (int64_t r0 = 0; r0 < job.nrows; r0 += 4) {
        const int64_t rows = job.nrows - r0 < 4 ? job.nrows - r0 : 4;
        const block_q4_1 * x[4];
        for (int k = 0; k < 4; ++k) {
            x[k] = job.x[r0 + (k < rows ? k : rows - 1)];
        }
        __m512 sm[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t ib = 0; ib < nb; ++ib) {
            const __m512 s1v = _mm512_loadu_ps(s.s1.data() + ib * BLOCK);
            for (int k = 0; k < 4; ++k) {
                sm[k] = _mm512_fmadd_ps(_mm512_set1_ps(scale_2(x[k][ib])), s1v, sm[k]);
            }
            for (int k = 0; k < rows; ++k) {
                s.d0[(r0 + k) * nb + ib] = scale_d(x[k][ib]);
            }
        }
        for (int k = 0; k < rows; ++k) {
            _mm512_storeu_ps(job.summs[r0 + k], sm[k]);
        }
    }
    // columns in pairs, each pair in one vector (4 rows x 8 columns per tile) ...
    const int64_t npairs = job.ncols / 2;
    if (npairs > 0) {
        int64_t r0 = 0;
        for (; r0 + 4 <= job.nrows; r0 += 4) {
            run_pairs<4>(job, r0, npairs);
        }
        for (; r0 < job.nrows; ++r0) {
            run_pairs<1>(job, r0, npairs);
        }
    }
    // ... and an odd last column with pairs of rows in one vector, 8 rows per tile
    if (job.ncols % 2 == 1) {
        int64_t r0 = 0;
        for (; r0 + 8 <= job.nrows; r0 += 8) {
            run_column<4>(job, r0, job.ncols - 1);
        }
        for (; r0 < job.nrows; r0 += 2) {
            run_column<1>(job, r0, job.ncols - 1);
        }
    }
}

// ggml_cpu_polykv_mm_block's work on one block, without the checks
void compute_block(const block_q4_1 * const * x, int64_t nrows, const block_q8_1 * const * y, int64_t ncols,
                   int64_t nb, char * dst, size_t dst_col_stride) {
    block_job job;
    job.nb = nb;
    job.nrows = nrows;
    job.ncols = ncols;
    for (int64_t r = 0; r < nrows; ++r) {
        job.x[r] = x[r];
    }
    for (int64_t c = 0; c < BLOCK; ++c) {
        job.y[c] = y[c < ncols ? c : ncols - 1];
    }
    job.dst = dst;
    job.dst_col_stride = dst_col_stride;
    scratch & s = t_scratch;
    s.fit(nb);
    compute(job, s);
}

// The tiles against this build's ggml_vec_dot_q4_1_q8_1 on one 16 x 16 block (and a 16 x 15 one, for the odd
// column's path) of pseudo-random blocks: true if every output is bit for bit the same.
bool self_test() {
    constexpr int64_t NB = 6;
    std::vector<block_q4_1> xs(BLOCK * NB);
    std::vector<block_q8_1> ys(BLOCK * NB);
    uint32_t state = 0x9E3779B9u;
    auto next = [&state]() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        return state;
    };
    auto scale = [&next](float lo, float hi) {
        return GGML_CPU_FP32_TO_FP16(lo + (hi - lo) * (float) (next() % 10007) / 10007.0f);
    };
    for (block_q4_1 & b : xs) {
        ggml_half * h = reinterpret_cast<ggml_half *>(&b);
        h[0] = scale(0.001f, 0.1f);
        h[1] = scale(-0.8f, -0.01f);
        for (uint8_t & q : b.qs) {
            q = (uint8_t) next();
        }
    }
    for (block_q8_1 & b : ys) {
        ggml_half * h = reinterpret_cast<ggml_half *>(&b);
        int sum = 0;
        for (int8_t & q : b.qs) {
            q = (int8_t) (next() % 255 - 127);
            sum += q;
        }
        const float d = GGML_CPU_FP16_TO_FP32(scale(0.001f, 0.05f));
        h[0] = GGML_CPU_FP32_TO_FP16(d);
        h[1] = GGML_CPU_FP32_TO_FP16(d * (float) sum);
    }
    const block_q4_1 * x[BLOCK];
    const block_q8_1 * y[BLOCK];
    for (int64_t i = 0; i < BLOCK; ++i) {
        x[i] = xs.data() + i * NB;
        y[i] = ys.data() + i * NB;
    }
    const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(GGML_TYPE_Q4_1)->vec_dot;
    for (int64_t ncols : {BLOCK, BLOCK - 1}) {
        float out[BLOCK * BLOCK];
        compute_block(x, BLOCK, y, ncols, NB, reinterpret_cast<char *>(out), BLOCK * sizeof(float));
        for (int64_t c = 0; c < ncols; ++c) {
            for (int64_t r = 0; r < BLOCK; ++r) {
                float ref = 0.0f;
                vec_dot((int) (NB * QK4_1), &ref, 0, x[r], 0, y[c], 0, 1);
                if (std::memcmp(&ref, &out[c * BLOCK + r], sizeof(float)) != 0) {
                    return false;
                }
            }
        }
    }
    return true;
}

bool verified() {
    static const bool ok = [] {
        const bool pass = self_test();
        if (!pass) {
            GGML_LOG_WARN("polykv: the Q4_1 register tiles differ from this build's ggml_vec_dot_q4_1_q8_1 "
                          "(its compiler rounds differently); they stay off\n");
        }
        return pass;
    }();
    return ok;
}

#else

bool verified() {
    return false;
}

#endif  // POLYKV_MM_AVX512

}  // namespace

extern "C" {

bool ggml_cpu_polykv_mm_enabled(void) {
    return switched_on() && verified();
}

void ggml_cpu_polykv_mm_set(bool on) {
    g_switch.store(on ? 1 : 0, std::memory_order_relaxed);
}

uint64_t ggml_cpu_polykv_mm_blocks(void) {
    return g_blocks.load(std::memory_order_relaxed);
}

bool ggml_cpu_polykv_mm_block(const struct ggml_tensor * dst, const void * wdata, size_t row_size, int64_t ir0,
                              int64_t ir0_end, int64_t ir1, int64_t ir1_end) {
#ifdef POLYKV_MM_AVX512
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    if (src0->type != GGML_TYPE_Q4_1 || src1->type != GGML_TYPE_F32 || !switched_on() || !verified()) {
        return false;
    }
    if (src0->ne[2] != 1 || src0->ne[3] != 1 || src1->ne[2] != 1 || src1->ne[3] != 1 ||
        dst->nb[0] != sizeof(float) || src0->ne[0] % QK4_1 != 0) {
        return false;
    }
    const int64_t nrows = ir0_end - ir0;
    const int64_t ncols = ir1_end - ir1;
    // one column (a single sequence's decode): upstream's loop is as fast (measured: the tiles 0.64-0.76x)
    if (nrows <= 0 || ncols < 2 || nrows > BLOCK || ncols > BLOCK) {
        return false;
    }
    const block_q4_1 * x[BLOCK];
    const block_q8_1 * y[BLOCK];
    for (int64_t r = 0; r < nrows; ++r) {
        x[r] = reinterpret_cast<const block_q4_1 *>(static_cast<const char *>(src0->data) + (ir0 + r) * src0->nb[1]);
    }
    for (int64_t c = 0; c < ncols; ++c) {
        y[c] = reinterpret_cast<const block_q8_1 *>(static_cast<const char *>(wdata) + (ir1 + c) * row_size);
    }
    compute_block(x, nrows, y, ncols, src0->ne[0] / QK4_1,
                  static_cast<char *>(dst->data) + ir1 * dst->nb[1] + ir0 * sizeof(float), dst->nb[1]);
    g_blocks.fetch_add(1, std::memory_order_relaxed);
    return true;
#else
    (void) dst; (void) wdata; (void) row_size; (void) ir0; (void) ir0_end; (void) ir1; (void) ir1_end;
    return false;
#endif
}

}  // extern "C"
