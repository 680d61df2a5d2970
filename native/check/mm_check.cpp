// polykv-mm-check: the Q4_1 register tiles (native/ggml-cpu/polykv-mm.cpp, patch 0079) against ggml's own dot
// products, bit for bit.
//
//   polykv-mm-check                       every case: a mul_mat node (Q4_1 weights x F32 activations) computed by
//                                         ggml's CPU backend, each output compared with ggml_vec_dot_q4_1_q8_1 on
//                                         the same Q8_1 activations; prints one JSON object
//   polykv-mm-check --bench R K C runs T  R x K weights times K x C activations on T threads, the tiles and
//                                         upstream's loop alternating; prints one JSON object with the medians
//
// Exit status 0 only if every output is identical and the tiles computed blocks (where they are compiled in).

#include "ggml.h"
#include "ggml-cpu.h"
#include "polykv-mm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct node {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * w = nullptr;  // [K, R] Q4_1
    ggml_tensor * a = nullptr;  // [K, C] F32
    ggml_tensor * out = nullptr;  // [R, C] F32
    ~node() { if (ctx) { ggml_free(ctx); } }
};

// weights N(0, 1) plus a per-row offset (so the Q4_1 minimum matters), activations N(0, 1)
void make_node(node & nd, int64_t R, int64_t K, int64_t C, std::mt19937 & rng) {
    // the tensors and the graph (the work buffer is compute()'s own)
    const size_t mem = ggml_row_size(GGML_TYPE_Q4_1, K) * R + sizeof(float) * (K * C + R * C) +
                       ggml_graph_overhead() + 1024 * 1024;
    ggml_init_params ip = {mem, nullptr, false};
    nd.ctx = ggml_init(ip);
    nd.w = ggml_new_tensor_2d(nd.ctx, GGML_TYPE_Q4_1, K, R);
    nd.a = ggml_new_tensor_2d(nd.ctx, GGML_TYPE_F32, K, C);
    std::normal_distribution<float> nrm(0.0f, 1.0f);
    std::vector<float> wf(K * R);
    for (int64_t r = 0; r < R; ++r) {
        const float off = nrm(rng) * 0.5f;
        for (int64_t k = 0; k < K; ++k) {
            wf[r * K + k] = nrm(rng) + off;
        }
    }
    ggml_quantize_chunk(GGML_TYPE_Q4_1, wf.data(), nd.w->data, 0, R, K, nullptr);
    float * af = static_cast<float *>(nd.a->data);
    for (int64_t i = 0; i < K * C; ++i) {
        af[i] = nrm(rng);
    }
    nd.out = ggml_mul_mat(nd.ctx, nd.w, nd.a);
    nd.gf = ggml_new_graph(nd.ctx);
    ggml_build_forward_expand(nd.gf, nd.out);
}

// computes the node on `threads` threads with a work buffer of the size ggml's plan asks for
void compute(const node & nd, int threads) {
    ggml_cplan plan = ggml_graph_plan(nd.gf, threads, nullptr);
    std::vector<uint8_t> work(plan.work_size);
    plan.work_data = work.data();
    if (ggml_graph_compute(nd.gf, &plan) != GGML_STATUS_SUCCESS) {
        std::fprintf(stderr, "ggml_graph_compute failed\n");
        std::exit(3);
    }
}

// outputs of the node that differ in any bit from ggml_vec_dot_q4_1_q8_1; *max_diff: the largest |difference|
int64_t compare_with_vec_dot(const node & nd, double * max_diff) {
    const int64_t K = nd.w->ne[0], R = nd.w->ne[1], C = nd.a->ne[1];
    const auto * q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_1);
    const auto * q4 = ggml_get_type_traits_cpu(GGML_TYPE_Q4_1);
    std::vector<uint8_t> col(ggml_row_size(GGML_TYPE_Q8_1, K));
    int64_t bad = 0;
    for (int64_t c = 0; c < C; ++c) {
        q8->from_float(static_cast<const float *>(nd.a->data) + c * K, col.data(), K);
        for (int64_t r = 0; r < R; ++r) {
            float ref = 0.0f;
            q4->vec_dot(static_cast<int>(K), &ref, 0, static_cast<const char *>(nd.w->data) + r * nd.w->nb[1], 0,
                        col.data(), 0, 1);
            const float got = static_cast<const float *>(nd.out->data)[c * R + r];
            if (std::memcmp(&ref, &got, sizeof(float)) != 0) {
                ++bad;
                *max_diff = std::max(*max_diff, (double) std::fabs((double) ref - (double) got));
            }
        }
    }
    return bad;
}

int run_checks() {
    std::mt19937 rng(1234);
    const int64_t Ks[] = {32, 96, 576, 1536};
    const int64_t Rs[] = {1, 3, 4, 5, 16, 17, 48, 192};
    const int64_t Cs[] = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 33};
    int64_t cases = 0, bad_cases = 0, bad = 0, outputs = 0, untiled = 0;
    double max_diff = 0.0;
    const uint64_t blocks0 = ggml_cpu_polykv_mm_blocks();
    for (int threads = 1; threads <= 2; ++threads) {
        for (int64_t K : Ks) {
            for (int64_t R : Rs) {
                for (int64_t C : Cs) {
                    node nd;
                    make_node(nd, R, K, C, rng);
                    const uint64_t before = ggml_cpu_polykv_mm_blocks();
                    compute(nd, threads);
                    // from 2 columns per thread the tiles take it (ggml may split a node's columns over the threads)
                    if (ggml_cpu_polykv_mm_enabled() && C >= 2 * threads && ggml_cpu_polykv_mm_blocks() == before) {
                        ++untiled;
                        std::fprintf(stderr, "not tiled: K=%lld R=%lld C=%lld threads=%d\n", (long long) K,
                                     (long long) R, (long long) C, threads);
                    }
                    const int64_t b = compare_with_vec_dot(nd, &max_diff);
                    ++cases;
                    outputs += R * C;
                    bad += b;
                    bad_cases += b > 0;
                    if (b > 0 && bad_cases <= 10) {
                        std::fprintf(stderr, "differs: K=%lld R=%lld C=%lld threads=%d: %lld outputs\n", (long long) K,
                                     (long long) R, (long long) C, threads, (long long) b);
                    }
                }
            }
        }
    }
    // the model's largest shape, a decode batch of 16 agents
    {
        node nd;
        make_node(nd, 1536, 576, 16, rng);
        compute(nd, 2);
        const int64_t b = compare_with_vec_dot(nd, &max_diff);
        ++cases;
        outputs += 1536 * 16;
        bad += b;
        bad_cases += b > 0;
    }
    const uint64_t blocks = ggml_cpu_polykv_mm_blocks() - blocks0;
    const bool enabled = ggml_cpu_polykv_mm_enabled();
    std::printf("{\"cases\": %lld, \"outputs\": %lld, \"differing_outputs\": %lld, \"differing_cases\": %lld, "
                "\"max_abs_diff\": %.9g, \"enabled\": %s, \"tile_blocks\": %llu, \"untiled_cases\": %lld}\n",
                (long long) cases, (long long) outputs, (long long) bad, (long long) bad_cases, max_diff,
                enabled ? "true" : "false", (unsigned long long) blocks, (long long) untiled);
    if (bad != 0) {
        return 1;
    }
    return (enabled && (blocks == 0 || untiled != 0)) ? 2 : 0;
}

double time_ms(node & nd, int threads) {
    const auto t0 = std::chrono::steady_clock::now();
    compute(nd, threads);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

int run_bench(int64_t R, int64_t K, int64_t C, int runs, int threads) {
    std::mt19937 rng(99);
    node nd;
    make_node(nd, R, K, C, rng);
    std::vector<double> on, off;
    for (int i = 0; i < runs + 1; ++i) {  // run 0 warms both up and is not counted
        ggml_cpu_polykv_mm_set(true);
        const double a = time_ms(nd, threads);
        ggml_cpu_polykv_mm_set(false);
        const double b = time_ms(nd, threads);
        if (i > 0) {
            on.push_back(a);
            off.push_back(b);
        }
    }
    const double mon = median(on), moff = median(off);
    const double gmac = (double) R * K * C / 1e9;
    std::printf("{\"R\": %lld, \"K\": %lld, \"C\": %lld, \"threads\": %d, \"runs\": %d, \"tiles_ms\": %.4f, "
                "\"upstream_ms\": %.4f, \"speedup\": %.3f, \"tiles_gmac_s\": %.2f, \"upstream_gmac_s\": %.2f}\n",
                (long long) R, (long long) K, (long long) C, threads, runs, mon, moff, moff / mon, gmac / (mon / 1e3),
                gmac / (moff / 1e3));
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc >= 2 && std::string(argv[1]) == "--bench") {
        if (argc != 7) {
            std::fprintf(stderr, "usage: %s --bench ROWS K COLS RUNS THREADS\n", argv[0]);
            return 64;
        }
        const int64_t R = std::atoll(argv[2]), K = std::atoll(argv[3]), C = std::atoll(argv[4]);
        const int runs = std::atoi(argv[5]), threads = std::atoi(argv[6]);
        if (R < 1 || K < 32 || K % 32 != 0 || C < 1 || runs < 1 || threads < 1) {
            std::fprintf(stderr, "usage: %s --bench ROWS K COLS RUNS THREADS (all >= 1, K a multiple of 32)\n", argv[0]);
            return 64;
        }
        return run_bench(R, K, C, runs, threads);
    }
    if (argc != 1) {
        std::fprintf(stderr, "usage: %s [--bench ROWS K COLS RUNS THREADS]\n", argv[0]);
        return 64;
    }
    return run_checks();
}
