// polykv-fattn-check: the shared-prefix decode attention path (patch 0076) against ggml's own
// path and a double-precision reference, on random Q/K/V and masks.
//
// For every case it builds one GGML_OP_FLASH_ATTN_EXT node shaped like llama.cpp's decode graph
// (Q a permuted view, K/V views of an interleaved KV cache, an f16 mask), computes it with the
// path off (upstream's kernel) and on (through the CPU backend's proc address), and, on x86-64,
// with the same computation compiled for AVX2 and without SIMD. One JSON object per case on
// stdout; the pytest module (test_fattn_kernel.py) asserts the bounds. "on_bits" hashes the path's
// result bit for bit: two builds whose every case has the same hash compute the same floats (a change
// meant to keep every bit, such as a loop reordered, shows it by diffing their outputs).
//
// usage: polykv-fattn-check [--quick]
//        polykv-fattn-check --toggle [computes]
//            the switch flipped by another thread as fast as it can while one node is computed again and again
//            on a kept threadpool: every result must be the path's or upstream's, bit for bit (the switch is read
//            once per graph compute, so the threads of a node never split between the two)
//        polykv-fattn-check --bench [N] [n_kv] [threads] [n_priv] [layout] [cold]
//            ms per node, path off and on (default 16 4608 2, a quarter of the cells private, "prefix";
//            "causal": one sequence's prompt batch), the attention's GFLOP/s each way and, on x86-64,
//            the machine's FP32 FMA peak and read bandwidth from memory on as many threads, measured in the same
//            run; "cold": 64 MiB read before every computation (untimed), as a server's weights pass through the
//            caches between two attention nodes

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(POLYKV_FA_VARIANTS)
namespace polykv_fa_avx2   { bool run_single(ggml_tensor * dst); }
namespace polykv_fa_scalar { bool run_single(ggml_tensor * dst); }
#endif

namespace {

using set_fn   = void (*)(bool);
using stats_fn = void (*)(uint64_t out[4]);

struct cpu_switch {
    set_fn   set   = nullptr;
    stats_fn stats = nullptr;
    cpu_switch() {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        if (reg) {
            set   = (set_fn)   ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_set_shared_decode");
            stats = (stats_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_shared_decode_stats");
        }
    }
};

struct test_case {
    std::string layout;  // prefix | random | holes | causal | agents
    int DK, DV, n_head, n_head_kv, N, n_kv, threads;
    ggml_type kv_type;
    uint32_t seed;
    std::string decline = ""; // a node the path must leave to upstream: softcap | alibi | kv_type | rows
    int n_priv = -1;          // "prefix"/"holes"/"agents": cells after the prefix (-1: a quarter of n_kv)
    bool sinks = false;       // an attention sink per query head (gpt-oss): a logit in every row's softmax
};

// visibility of cell c to token i
std::vector<uint8_t> make_mask(const test_case & tc, std::mt19937 & rng) {
    std::vector<uint8_t> vis((size_t) tc.N * tc.n_kv, 0);
    auto at = [&](int i, int c) -> uint8_t & { return vis[(size_t) i*tc.n_kv + c]; };
    if (tc.layout == "random") {
        std::bernoulli_distribution b(0.5);
        for (int i = 0; i < tc.N; ++i) {
            for (int c = 0; c < tc.n_kv; ++c) {
                at(i, c) = b(rng);
            }
            at(i, i % tc.n_kv) = 1;
        }
        return vis;
    }
    if (tc.layout == "causal") {
        // one sequence's prompt batch: token i is at cell n_kv - N + i and sees every cell up to it
        for (int i = 0; i < tc.N; ++i) {
            for (int c = 0; c <= tc.n_kv - tc.N + i; ++c) {
                at(i, c) = 1;
            }
        }
        return vis;
    }
    // a shared prefix, then private cells interleaved one per token per step (decode order)
    const int priv = tc.n_priv >= 0 ? std::min(tc.n_priv, tc.n_kv) : tc.n_kv / 4;
    const int P    = tc.n_kv - priv;
    for (int i = 0; i < tc.N; ++i) {
        for (int c = 0; c < P; ++c) {
            at(i, c) = 1;
        }
    }
    for (int c = P; c < tc.n_kv; ++c) {
        at((c - P) % tc.N, c) = 1;
    }
    if (tc.layout == "agents") {
        // the server's layout in decode: after the prefix each token's own prompt suffix (a block of cells only it
        // sees), a stretch nobody sees (another slot's freed cells), then the generated cells interleaved, the
        // tokens finishing one by one (token i after 20 + 9i steps), the rest unused
        for (int c = P; c < tc.n_kv; ++c) {
            for (int i = 0; i < tc.N; ++i) {
                at(i, c) = 0;
            }
        }
        int c = P;
        for (int i = 0; i < tc.N; ++i) {
            for (int j = 0; j < 40 + (37*i) % 60 && c < tc.n_kv; ++j) {
                at(i, c++) = 1;
            }
        }
        c += 150;
        for (int step = 0; step < 20 + 9*tc.N; ++step) {
            for (int i = 0; i < tc.N && c < tc.n_kv; ++i) {
                if (step < 20 + 9*i) {
                    at(i, c++) = 1;
                }
            }
        }
    }
    if (tc.layout == "holes") {
        // two whole tiles nobody sees (another slot's cells), a stretch only token 0 sees,
        // and a token that sees only part of the prefix
        for (int c = 64; c < std::min(tc.n_kv, 64 + 130); ++c) {
            for (int i = 0; i < tc.N; ++i) {
                at(i, c) = 0;
            }
        }
        for (int c = P/2; c < std::min(P, P/2 + 100); ++c) {
            for (int i = 1; i < tc.N; ++i) {
                at(i, c) = 0;
            }
        }
        for (int c = P/3; c < P; ++c) {
            at(tc.N - 1, c) = 0;
        }
    }
    return vis;
}

struct result {
    double ms_off = 0, ms_on = 0; // --bench: median ms per node
    uint64_t visible = 0;         // (token, cell) pairs the mask lets through
    double err_off = 0, err_on = 0, on_vs_off = 0, err_avx2 = -1, err_scalar = -1;
    uint64_t ops = 0, shared = 0, priv = 0, skipped = 0;
    uint64_t on_bits = 0; // FNV-1a of the path's result, bit for bit: a change meant to keep every bit can show it
    bool ran = false;
    int toggle_on = 0, toggle_off = 0, toggle_mixed = 0; // --toggle: results equal to the path's, upstream's, neither
};

double max_abs(const std::vector<float> & a, const std::vector<double> & b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double d = std::fabs((double) a[i] - b[i]);
        m = std::isnan(d) ? INFINITY : std::max(m, d);
    }
    return m;
}

result run_case(const test_case & tc, const cpu_switch & sw, int bench_reps = 0, int toggle_reps = 0,
                bool cold = false) {
    std::mt19937 rng(tc.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);

    const int64_t mask_rows = tc.N + 3; // rows past N (padding) are never read
    ggml_init_params ip = { (size_t) 512*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);

    // q as llama.cpp has it: [DK, n_head, N] permuted to [DK, N, n_head]
    ggml_tensor * q_raw = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, tc.DK, tc.n_head, tc.N);
    // the KV cache: rows of all KV heads per cell, viewed per head
    ggml_tensor * k_raw = ggml_new_tensor_3d(ctx, tc.kv_type, tc.DK, tc.n_head_kv, tc.n_kv);
    ggml_tensor * v_raw = ggml_new_tensor_3d(ctx, tc.kv_type, tc.DV, tc.n_head_kv, tc.n_kv);
    ggml_tensor * mask  = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, tc.n_kv, mask_rows);

    std::vector<float> qv(ggml_nelements(q_raw)), kv(ggml_nelements(k_raw)), vv(ggml_nelements(v_raw));
    for (float & x : qv) { x = 2.0f*nd(rng); }
    for (float & x : kv) { x = nd(rng); }
    for (float & x : vv) { x = nd(rng); }
    memcpy(q_raw->data, qv.data(), qv.size()*sizeof(float));
    const auto * tr_k = ggml_get_type_traits(tc.kv_type);
    GGML_ASSERT(tc.DK % ggml_blck_size(tc.kv_type) == 0);
    for (int64_t r = 0; r < ggml_nrows(k_raw); ++r) {
        ggml_quantize_chunk(tc.kv_type, kv.data() + r*tc.DK, (char *) k_raw->data + r*k_raw->nb[1], 0, 1, tc.DK, nullptr);
    }
    for (int64_t r = 0; r < ggml_nrows(v_raw); ++r) {
        ggml_quantize_chunk(tc.kv_type, vv.data() + r*tc.DV, (char *) v_raw->data + r*v_raw->nb[1], 0, 1, tc.DV, nullptr);
    }
    // the values the kernels see (after rounding to the cache type)
    std::vector<float> kd(kv.size()), vd(vv.size());
    for (int64_t r = 0; r < ggml_nrows(k_raw); ++r) {
        tr_k->to_float((const char *) k_raw->data + r*k_raw->nb[1], kd.data() + r*tc.DK, tc.DK);
    }
    for (int64_t r = 0; r < ggml_nrows(v_raw); ++r) {
        tr_k->to_float((const char *) v_raw->data + r*v_raw->nb[1], vd.data() + r*tc.DV, tc.DV);
    }

    const std::vector<uint8_t> vis = make_mask(tc, rng);
    result res;
    for (uint8_t x : vis) {
        res.visible += x;
    }
    ggml_fp16_t * m = (ggml_fp16_t *) mask->data;
    for (int64_t i = 0; i < mask_rows; ++i) {
        for (int c = 0; c < tc.n_kv; ++c) {
            const bool seen = i < tc.N && vis[(size_t) i*tc.n_kv + c];
            m[i*tc.n_kv + c] = ggml_fp32_to_fp16(seen ? 0.0f : -INFINITY);
        }
    }

    ggml_tensor * q = ggml_permute(ctx, q_raw, 0, 2, 1, 3);
    ggml_tensor * k = ggml_permute(ctx, k_raw, 0, 2, 1, 3);
    ggml_tensor * v = ggml_permute(ctx, v_raw, 0, 2, 1, 3);
    const float scale = 1.0f/std::sqrt((float) tc.DK);
    const float max_bias = tc.decline == "alibi" ? 8.0f : 0.0f;
    const float softcap  = tc.decline == "softcap" ? 30.0f : 0.0f;
    ggml_tensor * fa = ggml_flash_attn_ext(ctx, q, k, v, mask, scale, max_bias, softcap);
    // sinks above every score on even heads (the row's maximum becomes the sink's), below on odd ones; large enough
    // that leaving one out moves the output by far more than MAX_ERR
    std::vector<double> sink(tc.n_head, -INFINITY);
    if (tc.sinks) {
        ggml_tensor * sinks = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, tc.n_head);
        for (int h = 0; h < tc.n_head; ++h) {
            ((float *) sinks->data)[h] = (h % 2 == 0 ? 5.0f : -1.0f) + nd(rng);
            sink[h] = ((float *) sinks->data)[h];
        }
        ggml_flash_attn_ext_add_sinks(fa, sinks);
    }

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, fa);

    // reference in double: dst[i, h, :] = softmax(scale q k^T over visible cells, and the sink) v (the sink has no v)
    std::vector<double> ref((size_t) tc.DV * tc.n_head * tc.N, 0.0);
    const int rk2 = tc.n_head / tc.n_head_kv;
    std::vector<double> s(tc.n_kv);
    for (int i = 0; i < tc.N; ++i) {
        for (int h = 0; h < tc.n_head; ++h) {
            const int g = h / rk2;
            double mx = -INFINITY;
            for (int c = 0; c < tc.n_kv; ++c) {
                if (!vis[(size_t) i*tc.n_kv + c]) { s[c] = -INFINITY; continue; }
                double d = 0;
                for (int e = 0; e < tc.DK; ++e) {
                    d += (double) qv[((size_t) i*tc.n_head + h)*tc.DK + e] * kd[((size_t) c*tc.n_head_kv + g)*tc.DK + e];
                }
                s[c] = d*scale;
                mx = std::max(mx, s[c]);
            }
            mx = std::max(mx, sink[h]);
            double sum = tc.sinks ? std::exp(sink[h] - mx) : 0.0;
            double * out = ref.data() + ((size_t) i*tc.n_head + h)*tc.DV;
            for (int c = 0; c < tc.n_kv; ++c) {
                if (s[c] == -INFINITY) { continue; }
                const double p = std::exp(s[c] - mx);
                sum += p;
                for (int e = 0; e < tc.DV; ++e) {
                    out[e] += p * vd[((size_t) c*tc.n_head_kv + g)*tc.DV + e];
                }
            }
            for (int e = 0; e < tc.DV; ++e) {
                out[e] = sum > 0 ? out[e]/sum : 0.0;
            }
        }
    }

    auto output = [&]() {
        std::vector<float> o(ggml_nelements(fa));
        memcpy(o.data(), fa->data, o.size()*sizeof(float));
        return o;
    };

    sw.set(false);
    ggml_graph_compute_with_ctx(ctx, gf, tc.threads);
    const std::vector<float> off = output();

    uint64_t before[4], after[4];
    sw.stats(before);
    sw.set(true);
    ggml_graph_compute_with_ctx(ctx, gf, tc.threads);
    sw.set(false);
    sw.stats(after);
    const std::vector<float> on = output();
    res.on_bits = 14695981039346656037ull;
    for (size_t b = 0; b < on.size()*sizeof(float); ++b) {
        res.on_bits = (res.on_bits ^ ((const uint8_t *) on.data())[b]) * 1099511628211ull;
    }

    // (the reference knows no ALiBi or softcap: a declined node is only compared with upstream's)
    res.err_off = max_abs(off, ref);
    res.err_on  = max_abs(on, ref);
    std::vector<double> offd(off.begin(), off.end());
    res.on_vs_off = max_abs(on, offd);
    if (!tc.decline.empty() && memcmp(on.data(), off.data(), on.size()*sizeof(float)) != 0) {
        res.on_vs_off = std::max(res.on_vs_off, 1e-30); // not bit-identical
    }
    res.ops     = after[0] - before[0];
    res.shared  = after[1] - before[1];
    res.priv    = after[2] - before[2];
    res.skipped = after[3] - before[3];
    res.ran = true;

    // --bench: median of bench_reps computations per switch setting, alternating, on one threadpool kept
    // across them as llama.cpp keeps it (ggml_graph_compute_with_ctx would start the threads every time)
    if (bench_reps > 0) {
        sw.set(true); // the plan sizes the path's work buffer only while the switch is on
        ggml_threadpool_params tpp = ggml_threadpool_params_default(tc.threads);
        ggml_threadpool * tp = ggml_threadpool_new(&tpp);
        ggml_cplan plan = ggml_graph_plan(gf, tc.threads, tp);
        std::vector<uint8_t> work(plan.work_size);
        plan.work_data = work.data();
        std::vector<double> t_off, t_on;
        std::vector<uint8_t> evict(cold ? (size_t) 64 << 20 : 0, 1);
        std::atomic<unsigned> kept{0}; // keeps the reads
        for (int r = 0; r < bench_reps; ++r) {
            for (bool on : { false, true }) {
                sw.set(on);
                if (cold) { // one reader per compute thread, so every core's L2 is refilled too
                    std::vector<std::thread> readers;
                    for (int t = 0; t < tc.threads; ++t) {
                        readers.emplace_back([&]() {
                            uint8_t sum = 0; // read, not written: weights leave no dirty lines behind
                            for (size_t b = 0; b < evict.size(); b += 64) {
                                sum = (uint8_t) (sum + evict[b]);
                            }
                            kept.fetch_add(sum, std::memory_order_relaxed);
                        });
                    }
                    for (auto & th : readers) {
                        th.join();
                    }
                }
                const auto t0 = std::chrono::steady_clock::now();
                ggml_graph_compute(gf, &plan);
                const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
                (on ? t_on : t_off).push_back(ms);
            }
        }
        ggml_threadpool_free(tp);
        sw.set(false);
        std::sort(t_off.begin(), t_off.end());
        std::sort(t_on.begin(), t_on.end());
        res.ms_off = t_off[t_off.size()/2];
        res.ms_on  = t_on[t_on.size()/2];
    }

    // --toggle: another thread flips the switch while the node is computed toggle_reps times
    if (toggle_reps > 0) {
        sw.set(true); // the plan sizes the path's work buffer
        ggml_threadpool_params tpp = ggml_threadpool_params_default(tc.threads);
        ggml_threadpool * tp = ggml_threadpool_new(&tpp);
        ggml_cplan plan = ggml_graph_plan(gf, tc.threads, tp);
        std::vector<uint8_t> work(plan.work_size);
        plan.work_data = work.data();
        std::vector<float> want[2];
        for (bool on : { false, true }) {
            sw.set(on);
            ggml_graph_compute(gf, &plan);
            want[on] = output();
        }
        std::atomic<bool> stop{false};
        std::thread flipper([&]() {
            for (bool on = false; !stop.load(); on = !on) {
                sw.set(on);
            }
        });
        for (int r = 0; r < toggle_reps; ++r) {
            memset(fa->data, 0, ggml_nbytes(fa));
            ggml_graph_compute(gf, &plan);
            const std::vector<float> got = output();
            const size_t n = got.size()*sizeof(float);
            if (memcmp(got.data(), want[1].data(), n) == 0) {
                res.toggle_on++;
            } else if (memcmp(got.data(), want[0].data(), n) == 0) {
                res.toggle_off++;
            } else {
                res.toggle_mixed++;
            }
        }
        stop.store(true);
        flipper.join();
        ggml_threadpool_free(tp);
        sw.set(false);
    }

#if defined(POLYKV_FA_VARIANTS)
    memset(fa->data, 0, ggml_nbytes(fa));
    // the AVX2 build runs only where the CPU has AVX2, FMA and F16C (-1 in the report otherwise)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        polykv_fa_avx2::run_single(fa)) {
        res.err_avx2 = max_abs(output(), ref);
    }
    memset(fa->data, 0, ggml_nbytes(fa));
    if (polykv_fa_scalar::run_single(fa)) {
        res.err_scalar = max_abs(output(), ref);
    }
#endif
    ggml_free(ctx);
    return res;
}

// ---------------------------------------------------------------------------- FP32 FMA peak

// 12 independent FMA chains per thread (more than latency x ports on current x86 cores), vectors
// of the widest kind the CPU has; GFLOP/s over all threads, best of 3 runs of 0.05-0.3 s.
#if defined(__x86_64__)
__attribute__((target("avx512f"))) float fma_chains_512(int64_t iters) {
    __m512 a[12];
    for (int j = 0; j < 12; ++j) {
        a[j] = _mm512_set1_ps(1.0f + 0.001f*j);
    }
    const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
    for (int64_t i = 0; i < iters; ++i) {
        for (int j = 0; j < 12; ++j) {
            a[j] = _mm512_fmadd_ps(a[j], b, c);
        }
    }
    float out = 0;
    for (int j = 0; j < 12; ++j) {
        out += _mm512_reduce_add_ps(a[j]);
    }
    return out;
}

__attribute__((target("avx2,fma"))) float fma_chains_256(int64_t iters) {
    __m256 a[12];
    for (int j = 0; j < 12; ++j) {
        a[j] = _mm256_set1_ps(1.0f + 0.001f*j);
    }
    const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t i = 0; i < iters; ++i) {
        for (int j = 0; j < 12; ++j) {
            a[j] = _mm256_fmadd_ps(a[j], b, c);
        }
    }
    alignas(32) float v[8];
    float out = 0;
    for (int j = 0; j < 12; ++j) {
        _mm256_store_ps(v, a[j]);
        for (float x : v) {
            out += x;
        }
    }
    return out;
}
#endif

// -1 where it is not measured (no AVX2+FMA, or not x86-64)
double fma_peak_gflops(int threads) {
#if defined(__x86_64__)
    const bool w512 = __builtin_cpu_supports("avx512f");
    if (!w512 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        return -1;
    }
    const int lanes = w512 ? 16 : 8;
    const int64_t iters = w512 ? 40000000 : 80000000; // 0.05-0.3 s per thread on current cores
    volatile float sink = 0;
    double best = 0;
    for (int run = 0; run < 3; ++run) {
        std::vector<std::thread> pool;
        std::vector<float> got(threads);
        const auto t0 = std::chrono::steady_clock::now();
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&, t] { got[t] = w512 ? fma_chains_512(iters) : fma_chains_256(iters); });
        }
        for (std::thread & th : pool) {
            th.join();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (float g : got) {
            sink = sink + g;
        }
        best = std::max(best, 2.0*12*lanes*(double) iters*threads/s/1e9);
    }
    return best;
#else
    (void) threads;
    return -1;
#endif
}

// the machine's read bandwidth from memory on as many threads (GB/s, the best of 3): each thread sums its part of a
// 256 MiB buffer (far beyond the caches) with 64-byte loads, as the path reads K/V rows that are not cached
double read_gbs(int threads) {
    const size_t bytes = (size_t) 256 << 20, lines = bytes / 64;
    std::vector<uint64_t> buf(bytes / sizeof(uint64_t), 1); // written once: its pages are mapped before timing
    std::atomic<uint64_t> kept{0};
    double best = 0;
    for (int run = 0; run < 3; ++run) {
        std::vector<std::thread> pool;
        const auto t0 = std::chrono::steady_clock::now();
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&, t] {
                uint64_t sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (size_t l = lines * t / threads; l < lines * (t + 1) / threads; ++l) {
                    for (int w = 0; w < 8; ++w) { // every word of the line: the compiler makes vector loads of it
                        sum[w] += buf[l*8 + w];
                    }
                }
                kept.fetch_add(sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5] + sum[6] + sum[7]);
            });
        }
        for (std::thread & th : pool) {
            th.join();
        }
        best = std::max(best, bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    }
    return kept.load() == bytes / sizeof(uint64_t) * 3 ? best : -1; // every word read, in every run
}

} // namespace

int main(int argc, char ** argv) {
    const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
    const bool bench = argc > 1 && std::string(argv[1]) == "--bench";
    const bool toggle = argc > 1 && std::string(argv[1]) == "--toggle";
    ggml_cpu_init();
    cpu_switch sw;
    if (!sw.set || !sw.stats) {
        fprintf(stderr, "polykv-fattn-check: the CPU backend has no ggml_backend_cpu_polykv_* entry points (patch 0076 missing)\n");
        return 2;
    }
    if (toggle) {
        const int reps = argc > 2 ? atoi(argv[2]) : 400;
        const test_case tc = { "prefix", 64, 64, 9, 3, 16, 1500, 2, GGML_TYPE_F16, 7 };
        const result r = run_case(tc, sw, 0, reps);
        printf("{\"computes\": %d, \"on\": %d, \"off\": %d, \"mixed\": %d}\n", reps, r.toggle_on, r.toggle_off,
               r.toggle_mixed);
        return r.toggle_mixed == 0 ? 0 : 1;
    }
    if (bench) {
        // the default model's heads (9 query, 3 KV, 64 wide) over a shared prefix, f16 KV
        const int N = argc > 2 ? atoi(argv[2]) : 16, n_kv = argc > 3 ? atoi(argv[3]) : 4096 + 512;
        const int threads = argc > 4 ? atoi(argv[4]) : 2;
        const int n_priv  = argc > 5 ? atoi(argv[5]) : -1;
        const std::string layout = argc > 6 ? argv[6] : "prefix";
        const bool cold = argc > 7 && std::string(argv[7]) == "cold";
        const test_case tc = { layout, 64, 64, 9, 3, N, n_kv, threads, GGML_TYPE_F16, 1, "", n_priv };
        const result r = run_case(tc, sw, 21, 0, cold);
        // the attention's own arithmetic: per query head and visible (token, cell) pair, a DK dot
        // product and a DV axpy, 2 flops per multiply-add (upstream does the same amount)
        const double gflop = (double) r.visible * tc.n_head * 2 * (tc.DK + tc.DV) / 1e9;
        const double peak  = fma_peak_gflops(threads);
        const double gbs   = read_gbs(threads);
        printf("{\"N\": %d, \"n_kv\": %d, \"threads\": %d, \"ms_off\": %.3f, \"ms_on\": %.3f, \"on_over_off\": %.3f, "
               "\"err_on\": %.3g, \"gflop\": %.6f, \"gflops_off\": %.1f, \"gflops_on\": %.1f, "
               "\"fma_peak_gflops\": %.1f, \"on_of_peak\": %.3f, \"read_gbs\": %.1f}\n",
               N, n_kv, threads, r.ms_off, r.ms_on, r.ms_on / r.ms_off, r.err_on, gflop, gflop / r.ms_off * 1e3,
               gflop / r.ms_on * 1e3, peak, peak > 0 ? gflop / r.ms_on * 1e3 / peak : -1.0, gbs);
        return 0;
    }

    std::vector<test_case> cases;
    uint32_t seed = 1234;
    // GQA ratios 1, 3, 8; head sizes 64, 128; f16 and q8_0; 1-3 threads; masks of every kind
    const int gqa[][2] = { {4, 4}, {9, 3}, {16, 2} };
    for (const char * layout : { "prefix", "holes", "random" }) {
        for (const auto & hk : gqa) {
            for (int D : { 64, 128 }) {
                for (ggml_type t : { GGML_TYPE_F16, GGML_TYPE_Q8_0 }) {
                    const int N       = (seed % 3 == 0) ? 16 : (seed % 3 == 1 ? 4 : 33);
                    const int n_kv    = quick ? 700 : ((seed % 2) ? 1500 : 777);
                    const int threads = 1 + (int) (seed % 3);
                    cases.push_back({ layout, D, D, hk[0], hk[1], N, n_kv, threads, t, seed++ });
                }
            }
        }
    }
    // the shape: the default model's heads over a 4k prefix, 16 agents, 2 threads
    cases.push_back({ "prefix", 64, 64, 9, 3, 16, 4096 + 512, 2, GGML_TYPE_F16, seed++ });
    cases.push_back({ "prefix", 64, 64, 9, 3, 2, 300, 2, GGML_TYPE_F16, seed++ });
    // the server's decode layout (own suffixes, another slot's freed cells, tokens finishing): private spans across
    // skipped tiles, tiles one token sees whole; f16 (spans on AVX-512), q8_0 (pairs), one-tile spans (N = 33), sinks
    cases.push_back({ "agents", 64, 64, 9, 3, 16, 4096, 2, GGML_TYPE_F16, seed++, "", 2500 });
    cases.push_back({ "agents", 128, 128, 16, 2, 5, 1500, 3, GGML_TYPE_Q8_0, seed++, "", 900 });
    cases.push_back({ "agents", 64, 64, 4, 4, 33, 5000, 2, GGML_TYPE_F16, seed++, "", 4000 });
    cases.push_back({ "agents", 64, 64, 8, 2, 16, 2000, 2, GGML_TYPE_F16, seed++, "", 1200, true });
    // multi-query (Falcon 7B: 71 query heads on one KV head): a token's rows in groups of 4, the last of 3
    cases.push_back({ "holes", 64, 64, 71, 1, 16, 700, 2, GGML_TYPE_F16, seed++ });
    // prompt batches of 64-511 rows: 8 agents' turns over a shared prefix and their transcripts, and one
    // sequence's prompt (causal)
    cases.push_back({ "prefix", 64, 64, 9, 3, 144, 1500, 2, GGML_TYPE_F16, seed++, "", 700 });
    cases.push_back({ "holes", 64, 64, 4, 4, 100, 1000, 3, GGML_TYPE_Q8_0, seed++ });
    cases.push_back({ "causal", 64, 64, 9, 3, 200, 777, 2, GGML_TYPE_F16, seed++ });
    cases.push_back({ "causal", 128, 128, 16, 2, 511, 600, 1, GGML_TYPE_F16, seed++ });
    // attention sinks (gpt-oss: GQA 64/8, head size 64): decode and prompt batches, f16 and q8_0, every mask kind
    cases.push_back({ "prefix", 64, 64, 8, 2, 16, 700, 2, GGML_TYPE_F16, seed++, "", -1, true });
    cases.push_back({ "holes", 64, 64, 8, 2, 4, 1500, 3, GGML_TYPE_Q8_0, seed++, "", -1, true });
    cases.push_back({ "random", 64, 64, 8, 8, 33, 777, 1, GGML_TYPE_F16, seed++, "", -1, true });
    cases.push_back({ "causal", 64, 64, 8, 2, 200, 777, 2, GGML_TYPE_F16, seed++, "", -1, true });
    // nodes the path must decline (switch on, upstream's kernel computes them, bit for bit as with it off)
    cases.push_back({ "prefix", 64, 64, 9, 3, 16, 700, 2, GGML_TYPE_F16, seed++, "softcap" });
    cases.push_back({ "prefix", 64, 64, 8, 8, 16, 700, 2, GGML_TYPE_F16, seed++, "alibi" });
    cases.push_back({ "prefix", 64, 64, 9, 3, 16, 700, 2, GGML_TYPE_Q4_0, seed++, "kv_type" });
    cases.push_back({ "prefix", 64, 64, 9, 3, 16, 700, 2, GGML_TYPE_Q5_1, seed++, "kv_type" });
    cases.push_back({ "prefix", 64, 64, 9, 3, 1, 700, 2, GGML_TYPE_F16, seed++, "rows" });
    cases.push_back({ "prefix", 64, 64, 9, 3, 512, 700, 2, GGML_TYPE_F16, seed++, "rows" });

    int bad = 0;
    for (const test_case & tc : cases) {
        const result r = run_case(tc, sw);
        printf("{\"decline\": \"%s\", \"sinks\": %s, \"layout\": \"%s\", \"DK\": %d, \"n_head\": %d, \"n_head_kv\": %d, \"N\": %d, \"n_kv\": %d, "
               "\"threads\": %d, \"kv_type\": \"%s\", \"err_off\": %.3g, \"err_on\": %.3g, \"on_vs_off\": %.3g, "
               "\"err_avx2\": %.3g, \"err_scalar\": %.3g, \"ops\": %llu, \"tiles_shared\": %llu, "
               "\"tiles_private\": %llu, \"tiles_skipped\": %llu, \"on_bits\": \"%016llx\"}\n",
               tc.decline.c_str(), tc.sinks ? "true" : "false", tc.layout.c_str(), tc.DK, tc.n_head, tc.n_head_kv, tc.N, tc.n_kv, tc.threads,
               ggml_type_name(tc.kv_type), r.err_off, r.err_on, r.on_vs_off, r.err_avx2, r.err_scalar,
               (unsigned long long) r.ops, (unsigned long long) r.shared, (unsigned long long) r.priv,
               (unsigned long long) r.skipped, (unsigned long long) r.on_bits);
        fflush(stdout);
        bad += tc.decline.empty() ? r.ops != 1 : (r.ops != 0 || r.on_vs_off != 0);
    }
    return bad ? 1 : 0;
}
