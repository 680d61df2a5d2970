#include "server-polykv.h"

#include "server-polykv-files.h" // polykv_pool_files::identity (0075)
#include "polykv-memory.h"       // polykv_memory_swa_seq_rm, polykv_memory_rs_pos, polykv_memory_attn_pos_min
#include "server-task.h"

#include "ggml-backend.h"

#include <algorithm>
#include <stdexcept>

// The log lines of a share carry the prefix of polykv_share_prefix (server-polykv-slots.cpp), which runs it:
// "slot polykv_share: id <slot> | task <task> | polykv: ..." (as server-context.cpp's SLT_INF writes them).
#define POLYKV_LOG(LEVEL, in, fmt, ...) \
    LEVEL("slot %12.*s: id %2d | task %d | " fmt, 12, "polykv_share_prefix", (in).id_slot, (in).id_task, __VA_ARGS__)

json server_shared_prefix_outcome::to_json() const {
    json res = json {
        {"pool_slot", pool_slot},
        {"requested", requested_given ? json(requested) : json(nullptr)},
        {"shared",    shared},
        {"status",    status},
    };
    if (status == "mismatch") {
        res["common"] = common;
    }
    if (status == "inexact") {
        res["exact"] = exact;
    }
    if (status == "swa_window") {
        res["window"] = window;
    }
    if (status == "recurrent_state") {
        res["state"] = state;
    }
    if (!auto_kind.empty()) {
        res["auto"] = auto_kind;
    }
    if (!reason.empty()) {
        res["reason"] = reason;
    }
    if (waited) {
        res["waited"] = true;
    }
    return res;
}

polykv_share_decision polykv_share_decide(const polykv_share_input & in, int n_past) {
    polykv_share_decision d;

    auto & out = d.outcome;

    out.pool_slot = in.pool_slot;
    out.requested = in.auto_n ? 0 : in.requested;
    out.requested_given = !in.auto_n && !in.auto_any;
    out.auto_kind = in.auto_any ? "any" : in.auto_pool ? "pool" : in.auto_n ? "prefix" : "";

    const int id_pool = out.pool_slot;
    int n_req = std::min<int>(out.requested, (int) in.tokens->size());

    if (!in.auto_n && n_req <= 0) {
        POLYKV_LOG(LOG_INF, in, "polykv: no prefix requested from slot %d (shared_prefix_n_tokens = %d)\n", id_pool, out.requested);
        out.status = "no_prefix";
        return d;
    }

    if (id_pool == in.id_slot) {
        POLYKV_LOG(LOG_INF, in, "polykv: task runs on the pool slot %d itself, using its own cache (n_past = %d)\n", id_pool, n_past);
        out.status = "self";
        return d;
    }

    // a pool whose cells another cache_salt computed: refused before anything about its tokens is looked at
    // (no common prefix, no length is reported)
    if (in.pool_tokens != nullptr && in.salt_differs) {
        POLYKV_LOG(LOG_INF, in, "polykv: pool slot %d was computed under another cache_salt - not sharing\n", id_pool);
        out.status = "salt_mismatch";
        return d;
    }

    // P not given: the longest common prefix of the pool's cached tokens and the prompt, leaving at least one
    // prompt token to evaluate (the residency check below still applies)
    if (in.auto_n && in.pool_tokens != nullptr) {
        const int n_common = (int) in.pool_tokens->get_common_prefix(*in.tokens);
        n_req = std::min<int>(n_common, polykv_share_max(*in.tokens));
        if (n_req <= 0) {
            const bool empty = in.pool_tokens->size() == 0;
            POLYKV_LOG(LOG_INF, in, "polykv: pool slot %d %s - nothing to share\n", id_pool, empty ? "holds no tokens" : "has no common prefix with the prompt");
            out.status = empty ? "not_resident" : "no_prefix";
            return d;
        }
        // a named pool that holds something else (another base was primed there): the few tokens the two have in
        // common (BOS, a chat header) are not what the caller meant to share, so say "mismatch" as an explicit P
        // would, and the caller can prime the pool again. (The pool's last cached token may be one it generated.)
        const int n_pool_tok = (int) in.pool_tokens->size();
        if (!in.auto_pool && n_common < in.auto_min && n_common < n_pool_tok - 1 && n_common < polykv_share_max(*in.tokens)) {
            out.common = (int32_t) n_common;
            POLYKV_LOG(LOG_INF, in, "polykv: pool slot %d has only %d tokens in common with the prompt (< %d) - not sharing\n",
                       id_pool, n_common, in.auto_min);
            out.status = "mismatch";
            return d;
        }
        // only the pool's exact cells: those a shift moved (n_cache_reuse, context shift) are never shared
        if (n_req > in.pool_exact) {
            n_req = in.pool_exact;
            if (n_req <= 0) {
                POLYKV_LOG(LOG_INF, in, "polykv: pool slot %d holds no exact cells (shifted from 0) - not sharing\n", id_pool);
                out.exact  = 0;
                out.status = "inexact";
                return d;
            }
        }
    }

    if (n_req > 0 && n_past >= n_req) {
        POLYKV_LOG(LOG_INF, in, "polykv: own cache already covers the %d-token prefix (n_past = %d), not sharing\n", n_req, n_past);
        out.status = "own_cache";
        return d;
    }

    const char * reason = nullptr;
    if (in.pool_tokens == nullptr) {
        reason = "no such pool slot";
    } else if (in.not_completion) {
        reason = "task type";
    } else if (in.multimodal) {
        reason = "multimodal";
    } else if (in.no_partial_seq_rm && in.pool_rs_pos == POLYKV_MEMORY_NO_PART) {
        reason = "memory without sequence removal";
    } else if (in.speculative) {
        reason = "speculative decoding";
    } else if (in.ctx_shift) {
        reason = "context shift enabled";
    } else if (in.lora_differs) {
        reason = "lora adapters differ from the pool slot";
    }

    if (reason != nullptr) {
        POLYKV_LOG(LOG_WRN, in, "polykv: cannot share from slot %d: %s - full reprocess\n", id_pool, reason);
        out.status = "unsupported";
        out.reason = reason;
        return d;
    }

    // the pool's cells may change while it processes a task
    if (in.pool_busy) {
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d is busy - skipping share, full reprocess\n", id_pool);
        out.status = "pool_busy";
        return d;
    }

    // residency guard: the pool sequence must hold cells [0, P) (with SWA its sliding-window layers start later,
    // checked below) (idle-slot caching clears idle slots when a task launches unless --no-clear-idle)
    const int n_pool = (int) in.pool_tokens->size();
    const bool starts_ok = in.n_swa > 0 ? in.pool_pos_min >= 0 : in.pool_pos_min == 0;
    if (n_pool < n_req || !starts_ok || in.pool_pos_max < (llama_pos) (n_req - 1)) {
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d not resident to %d (tokens %d, pos [%d, %d]) - "
                   "skipping share, full reprocess (boot with --no-clear-idle)\n",
                   id_pool, n_req - 1, n_pool, (int) in.pool_pos_min, (int) in.pool_pos_max);
        out.status = "not_resident";
        return d;
    }

    // the pool's cached tokens [0, P) must be this prompt's first P tokens
    const size_t n_common = in.pool_tokens->get_common_prefix(*in.tokens);
    if (n_common < (size_t) n_req) {
        out.common = (int32_t) n_common;
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d holds different tokens: common prefix %zu < %d requested - "
                   "skipping share, full reprocess\n", id_pool, n_common, n_req);
        out.status = "mismatch";
        return d;
    }

    // the pool's cells [0, P) must be exact: computed from those tokens at those positions, none moved by a shift
    if (n_req > in.pool_exact) {
        out.exact = in.pool_exact;
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d's cells from position %d on were shifted (not exact) - "
                   "skipping share, full reprocess\n", id_pool, (int) in.pool_exact);
        out.status = "inexact";
        return d;
    }

    // recurrent layers: the pool's state is exact for a continuation at exactly its position + 1, and the task must
    // evaluate from P on (a whole-prompt share would re-evaluate token P - 1 from the state that already holds it:
    // [TAG_PROMPT_LOGITS])
    if (in.pool_rs_pos != POLYKV_MEMORY_NO_PART && (in.pool_rs_pos != (llama_pos) (n_req - 1) || n_req >= (int) in.tokens->size())) {
        out.state = (int32_t) in.pool_rs_pos + 1;
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d's recurrent state follows position %d, a share of %d tokens of a "
                   "%d-token prompt needs it after %d - skipping share, full reprocess\n", id_pool, (int) in.pool_rs_pos, n_req,
                   (int) in.tokens->size(), n_req - 1);
        out.status = "recurrent_state";
        return d;
    }

    // sliding-window layers: the pool must still hold the window of the first token the task evaluates (P, or
    // P - 1 when P is the whole prompt: [TAG_PROMPT_LOGITS]); a pool forked at its full length always does
    const llama_pos p_first = std::min<llama_pos>(n_req, polykv_share_max(*in.tokens));
    if (in.pool_pos_min > polykv_window_start(in.n_swa, p_first)) {
        out.window = (int32_t) in.pool_pos_min;
        POLYKV_LOG(LOG_WRN, in, "polykv: pool slot %d's sliding-window layers start at position %d, a continuation at %d "
                   "needs %d - skipping share, full reprocess\n", id_pool, (int) in.pool_pos_min, (int) p_first,
                   (int) polykv_window_start(in.n_swa, p_first));
        out.status = "swa_window";
        return d;
    }

    d.n_share = n_req;
    return d;
}

const char * polykv_share_kv(const polykv_share_input & in, int32_t n, const common_memory & mem, bool kv_unified) {
    const char * status = nullptr;

    mem.seq_rm(in.id_slot, -1, -1);

    if (kv_unified) {
        // same stream: the cells [0, P) get this sequence id added, no data is copied
        mem.seq_cp(in.pool_slot, in.id_slot, 0, n);
        status = "hit";
    } else {
        // one stream per slot: only whole-sequence copies between streams are supported (a partial
        // range aborts), so copy the pool's whole stream and drop what lies beyond P
        mem.seq_cp(in.pool_slot, in.id_slot, -1, -1);
        mem.seq_rm(in.id_slot, n, -1);
        status = "copied";
    }

    // with SWA the sliding-window layers keep only the window of the first token the task evaluates: the cells
    // below it are masked for all its tokens, and held by two sequences they would never be reused
    auto * llama_mem = llama_get_memory(mem.ctx_tgt);
    const llama_pos need = polykv_window_start(in.n_swa, std::min<llama_pos>(n, polykv_share_max(*in.tokens)));
    polykv_memory_swa_seq_rm(llama_mem, in.id_slot, need);

    // the sequence must now hold exactly [0, P) (with SWA: from the window's start on in the sliding-window layers;
    // with recurrent layers: the state after P - 1)
    const llama_pos own_min = polykv_memory_attn_pos_min(llama_mem, in.id_slot);
    const llama_pos own_max = llama_memory_seq_pos_max(llama_mem, in.id_slot);
    const llama_pos own_rs  = polykv_memory_rs_pos(llama_mem, in.id_slot);
    if (own_min < 0 || own_min > need || own_max != (llama_pos) (n - 1) || (own_rs != POLYKV_MEMORY_NO_PART && own_rs != own_max)) {
        POLYKV_LOG(LOG_ERR, in, "polykv: shared sequence has pos [%d, %d] (recurrent state %d), expected [%d, %d] - "
                   "dropping it, full reprocess\n", (int) own_min, (int) own_max, (int) own_rs, (int) need, n - 1);
        mem.seq_rm(in.id_slot, -1, -1);
        return nullptr;
    }

    return status;
}

void polykv_share_record(server_metrics & metrics, const server_shared_prefix_outcome & out) {
    metrics.polykv_n_requests++;
    if (out.auto_kind == "pool") {
        metrics.polykv_n_auto++;
    } else if (out.auto_kind == "any") {
        metrics.polykv_n_any++;
    }
    metrics.polykv_n_status[out.status]++;
    if (out.is_share()) {
        metrics.polykv_n_hits++;
        metrics.polykv_n_shared_tokens += out.shared;
    } else {
        metrics.polykv_n_misses++;
    }
}

server_shared_prefix_outcome polykv_share_run(polykv_share_input in, bool kv_unified, const common_memory & mem,
                                              server_prompt & prompt, int32_t & n_shared, int32_t * pool_n_shared,
                                              int & n_past, server_metrics & metrics) {
    if (in.pool_tokens != nullptr) {
        auto * llama_mem = llama_get_memory(mem.ctx_tgt);
        in.pool_pos_min = polykv_memory_attn_pos_min(llama_mem, in.pool_slot);
        in.pool_pos_max = llama_memory_seq_pos_max(llama_mem, in.pool_slot);
        in.pool_rs_pos  = polykv_memory_rs_pos(llama_mem, in.pool_slot);
    }
    in.n_swa = polykv_n_swa(mem.ctx_tgt);

    polykv_share_decision d = polykv_share_decide(in, n_past);
    auto & out = d.outcome;

    if (d.n_share > 0) {
        const int32_t n_req = d.n_share;

        const char * status = polykv_share_kv(in, n_req, mem, kv_unified);

        if (kv_unified && pool_n_shared != nullptr) {
            // the pool's cells [0, P) now also belong to this slot's sequence
            *pool_n_shared = std::max(*pool_n_shared, n_req);
        }

        if (status == nullptr) {
            prompt.clear();
            n_shared = 0;
            n_past   = 0;
            out.status = "unsupported";
            out.reason = "shared sequence failed verification";
        } else {
            n_shared = kv_unified ? n_req : 0;

            // mirror the token bookkeeping, as server_slot::copy_state_to() does
            server_tokens shared = in.tokens->clone();
            shared.keep_first(n_req);
            prompt.tokens = std::move(shared);
            prompt.checkpoints.clear(); // they described this slot's previous KV

            n_past = n_req;

            // [TAG_PROMPT_LOGITS] will recompute the last token if the whole prompt was shared
            out.shared = n_past == (int) in.tokens->size() ? n_past - 1 : n_past;

            POLYKV_LOG(LOG_INF, in, "polykv: shared %d-token prefix from slot %d (%s, n_past -> %d)\n", n_req, in.pool_slot, status, n_past);
            out.status = status;
        }
    }

    polykv_share_record(metrics, out);

    return out;
}

server_shared_prefix_outcome polykv_share_final(const server_shared_prefix_outcome & slot_outcome, const task_params & params,
                                                server_metrics & metrics) {
    server_shared_prefix_outcome out = slot_outcome;
    if (out.status.empty() && params.shared_pool_slot >= 0) {
        // the task ended before its prompt was processed (e.g. empty prompt)
        out.pool_slot = params.shared_pool_slot;
        out.requested = params.shared_prefix_given ? params.shared_prefix_n_tokens : 0;
        out.requested_given = params.shared_prefix_given;
        out.auto_kind = params.shared_prefix_given ? "" : "prefix";
        out.status    = "skipped";

        polykv_share_record(metrics, out);
    }
    return out;
}

json polykv_add_shared_prefix(json res, const server_task_result_cmpl_final & result) {
    // requests that set shared_pool_slot get "shared_prefix" at the top level of the response object;
    // in a stream, in the last chunk. Nothing is added for any other request.
    if (!result.shared_prefix.opted_in()) {
        return res;
    }
    switch (result.res_type) {
        case TASK_RESPONSE_TYPE_NONE:
        case TASK_RESPONSE_TYPE_OAI_CMPL:
        case TASK_RESPONSE_TYPE_OAI_CHAT:
            if (res.is_object()) {
                res["shared_prefix"] = result.shared_prefix.to_json();
            } else if (res.is_array() && !res.empty() && res.back().is_object()) {
                res.back()["shared_prefix"] = result.shared_prefix.to_json();
            }
            break;
        default:
            break; // other response formats have a fixed schema: the outcome is logged and counted only
    }
    return res;
}

int32_t polykv_json_int32(const json & v, int64_t min, int64_t max) {
    if (!v.is_number_integer()) {
        throw std::invalid_argument("Value must be an integer, but got " + v.dump());
    }
    // compare as double first: an integer beyond int64 would wrap in get<long long>()
    const double d = v.get<double>();
    if (!(d >= (double) min && d <= (double) max) || v.get<long long>() < min || v.get<long long>() > max) {
        throw std::invalid_argument("Value must be between " + std::to_string(min) + " <= value <= " + std::to_string(max) + ", but got " + v.dump());
    }
    return (int32_t) v.get<long long>();
}

void polykv_write_metrics(const server_metrics & metrics, std::ostream & prometheus) {
    // default off: upstream's text exactly unless --pool-slots is given or a request has opted in
    if (!metrics.polykv_enabled && metrics.polykv_n_requests == 0) {
        return;
    }

    struct item {
        const char * name;
        const char * description;
        double       value;
    };

    const item counters[] = {
        {
            "polykv_share_requests_total",
            "polykv: requests that set shared_pool_slot",
            (double) metrics.polykv_n_requests
        }, {
            "polykv_share_hits_total",
            "polykv: requests that took their prefix KV from the pool slot (status hit or copied)",
            (double) metrics.polykv_n_hits
        }, {
            "polykv_share_misses_total",
            "polykv: requests that set shared_pool_slot but took no KV from the pool slot",
            (double) metrics.polykv_n_misses
        }, {
            "polykv_share_auto_total",
            "polykv: requests that shared from a pool chosen by --pool-auto (also in polykv_share_requests_total)",
            (double) metrics.polykv_n_auto
        }, {
            "polykv_share_any_total",
            "polykv: requests that shared a prefix another slot had computed, chosen by --share-any (also in polykv_share_requests_total)",
            (double) metrics.polykv_n_any
        }, {
            "polykv_share_promoted_total",
            "polykv: prefixes --share-any copied into a reserved pool slot so that they outlive the slot they came from",
            (double) metrics.polykv_n_promoted
        }, {
            "polykv_share_waits_total",
            "polykv: requests whose prompt waited for another slot to compute their common prefix (--share-any coalescing)",
            (double) metrics.polykv_n_waits
        }, {
            "polykv_shared_tokens_total",
            "polykv: prompt tokens whose KV came from a pool slot instead of being computed",
            (double) metrics.polykv_n_shared_tokens
        },
    };

    // the same lines as to_metrics()'s add_items("counter", ...)
    for (const auto & it : counters) {
        prometheus << "# HELP llamacpp:" << it.name << " " << it.description << "\n"
                   << "# TYPE llamacpp:" << it.name << " " << "counter"      << "\n"
                   << "llamacpp:"        << it.name << " " << it.value       << "\n";
    }

    if (!metrics.polykv_n_status.empty()) {
        prometheus << "# HELP llamacpp:polykv_share_outcomes_total polykv: requests per shared_prefix status\n"
                   << "# TYPE llamacpp:polykv_share_outcomes_total counter\n";
        for (const auto & it : metrics.polykv_n_status) {
            prometheus << "llamacpp:polykv_share_outcomes_total{status=\"" << it.first << "\"} " << it.second << "\n";
        }
    }
}

llama_pos polykv_window_start(int32_t n_swa, llama_pos p) {
    return n_swa > 0 ? std::max<llama_pos>(0, p - n_swa + 1) : 0;
}

int32_t polykv_n_swa(llama_context * ctx) {
    return llama_model_n_swa(llama_get_model(ctx));
}

int32_t polykv_seq_resident(llama_context * ctx, llama_seq_id seq) {
    auto *          mem     = llama_get_memory(ctx);
    const llama_pos pos_min = polykv_memory_attn_pos_min(mem, seq);
    const llama_pos pos_max = llama_memory_seq_pos_max(mem, seq);
    const llama_pos rs_pos  = polykv_memory_rs_pos(mem, seq);
    if (pos_min < 0 || pos_max < 0 || (rs_pos != POLYKV_MEMORY_NO_PART && rs_pos != pos_max)) {
        return 0;
    }
    return pos_min <= polykv_window_start(polykv_n_swa(ctx), pos_max + 1) ? (int32_t) pos_max + 1 : 0;
}

bool polykv_share_any_init(common_params & params_base, const char * unsupported) {
    if (!params_base.share_any) {
        return true;
    }
    if (!params_base.kv_unified) {
        SRV_ERR("%s", "--share-any needs unified KV (-kvu): a share adds the task's sequence id to cells another slot computed\n");
        return false;
    }
    if (unsupported == nullptr && params_base.ctx_shift) {
        unsupported = "context shift enabled";
    }
    if (unsupported != nullptr) {
        SRV_WRN("--share-any: no prefix can be shared here (%s) - option off\n", unsupported);
        params_base.share_any = false;
        return true;
    }
    SRV_INF("polykv: --share-any on: a prompt shares the longest computed prefix (>= %d tokens) any slot of its cache_salt "
            "and LoRA set holds, and waits for a slot that is computing one; idle slots are kept resident\n",
            params_base.pool_auto_min_tokens);
    return true;
}

void polykv_check_schedulable(const task_params & params, int id_slot, const common_params & params_base) {
    const int n_slots = params_base.n_parallel;
    const auto is_reserved = [&](int id) {
        return std::find(params_base.pool_slots.begin(), params_base.pool_slots.end(), id) != params_base.pool_slots.end();
    };
    const int n_unreserved = n_slots - (int) params_base.pool_slots.size();

    if (!params_base.pool_slots.empty() && params.n_cmpl > n_unreserved) {
        throw std::invalid_argument("n_cmpl = " + std::to_string(params.n_cmpl) + " completions need as many unreserved slots, but only " +
                                    std::to_string(n_unreserved) + " of " + std::to_string(n_slots) +
                                    " slots are not reserved by --pool-slots: the request could never be scheduled");
    }

    if (id_slot == -1 && params.shared_pool_slot >= 0) {
        // the slots an unpinned sharer may run on: not reserved, and not its own pool (with more than one slot)
        int n_eligible = 0;
        for (int id = 0; id < n_slots; id++) {
            if (!is_reserved(id) && !(id == params.shared_pool_slot && n_slots > 1)) {
                n_eligible++;
            }
        }
        if (n_eligible == 0) {
            throw std::invalid_argument("shared_pool_slot = " + std::to_string(params.shared_pool_slot) +
                                        ": an unpinned request that shares from it can run on no slot (the others are reserved by --pool-slots): "
                                        "the request could never be scheduled; pin it with id_slot");
        }
    }
}

void polykv_check_pool_slot(int32_t id, const common_params & params_base) {
    if (id < 0 || params_base.pool_slots.empty()) {
        return;
    }
    if (std::find(params_base.pool_slots.begin(), params_base.pool_slots.end(), id) == params_base.pool_slots.end()) {
        std::string ids;
        for (const int32_t p : params_base.pool_slots) {
            ids += (ids.empty() ? "" : ",") + std::to_string(p);
        }
        throw std::invalid_argument("slot " + std::to_string(id) + " is not a pool slot: with --pool-slots only the reserved slots (" + ids + ") can be shared from");
    }
}

std::string polykv_json_salt(const json & v) {
    if (!v.is_string()) {
        throw std::invalid_argument("Value must be a string of 1 to 256 characters, but got " + v.dump());
    }
    const std::string s = v.get<std::string>();
    size_t n_chars = 0;
    for (const unsigned char c : s) {
        n_chars += (c & 0xC0) != 0x80; // UTF-8: count the bytes that start a character
    }
    if (n_chars < 1 || n_chars > 256) {
        throw std::invalid_argument("Value must be a string of 1 to 256 characters, but got " + std::to_string(n_chars) + " characters");
    }
    return s;
}

// the CPU backend's entry points of patch 0076, looked up by name once (the server does not link ggml-cpu itself;
// the backend registry is filled before the model loads, and a process has one CPU backend)
struct polykv_cpu_entries {
    void (*set)(bool)         = nullptr;
    bool (*get)(void)         = nullptr;
    void (*stats)(uint64_t *) = nullptr;
    void (*times)(uint64_t *) = nullptr;

    polykv_cpu_entries() {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        if (reg) {
            set   = (void (*)(bool)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_set_shared_decode");
            get   = (bool (*)(void)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_get_shared_decode");
            stats = (void (*)(uint64_t *)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_shared_decode_stats");
            times = (void (*)(uint64_t *)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_polykv_shared_decode_times");
        }
    }
};

static const polykv_cpu_entries & polykv_cpu() {
    static const polykv_cpu_entries entries;
    return entries;
}

bool polykv_shared_decode_init(const common_params & params_base) {
    auto set = polykv_cpu().set;
    if (!set) {
        if (params_base.polykv_shared_decode) {
            SRV_ERR("%s", "--shared-decode: this build's CPU backend has no shared-prefix decode path\n");
            return false;
        }
        return true;
    }
    set(params_base.polykv_shared_decode);
    if (params_base.polykv_shared_decode) {
        auto kv_ok = [](ggml_type t) { return t == GGML_TYPE_F16 || t == GGML_TYPE_Q8_0; };
        if (params_base.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED ||
            !kv_ok(params_base.cache_type_k) || !kv_ok(params_base.cache_type_v)) {
            SRV_WRN("%s", "--shared-decode: needs flash attention and f16/q8_0 KV; attention keeps upstream's kernel\n");
        } else {
            SRV_INF("%s", "polykv: --shared-decode on: batches of 2-511 tokens score shared KV tiles once per KV head\n");
        }
        // a CPU kernel: layers offloaded to a GPU keep their KV and attention there, with the backend's own kernel
        for (size_t i = 0; i < ggml_backend_dev_count() && params_base.n_gpu_layers != 0; i++) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(dev);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
                SRV_WRN("--shared-decode: a CPU kernel; layers offloaded to %s (-ngl %d) keep their attention on it, "
                        "computed by its own kernel (their output does not change); only layers kept on the CPU take the path\n",
                        ggml_backend_dev_name(dev), params_base.n_gpu_layers);
                break;
            }
        }
    }
    return true;
}

json polykv_shared_decode_state() {
    auto get   = polykv_cpu().get;
    auto stats = polykv_cpu().stats;
    if (!get || !stats) {
        return json(nullptr);
    }
    uint64_t st[4] = {0, 0, 0, 0};
    stats(st);
    json out = {
        {"enabled",       get()},
        {"ops",           st[0]},
        {"tiles_shared",  st[1]},
        {"tiles_private", st[2]},
        {"tiles_skipped", st[3]},
    };
    if (auto times = polykv_cpu().times) {
        // where the path's time went (polykv-fattn.h): its nodes' wall time, the threads' time by tile kind, the
        // arithmetic of each kind and the K/V bytes of the private pairs
        uint64_t t[7] = {0, 0, 0, 0, 0, 0, 0}; // POLYKV_FA_N_TIMES
        times(t);
        out["time"] = json {
            {"node_ns",       t[0]},
            {"shared_ns",     t[1]},
            {"private_ns",    t[2]},
            {"items_ns",      t[3]},
            {"shared_flop",   t[4]},
            {"private_flop",  t[5]},
            {"private_bytes", t[6]},
        };
    }
    return out;
}

void polykv_add_props(json & props, const common_params & params_base, const polykv_pool_files * files) {
    if (params_base.polykv_shared_decode) {
        props["polykv_shared_decode"] = polykv_shared_decode_state();
    }
    if (params_base.pool_slots.empty() && !params_base.share_any) {
        return;
    }
    props["polykv"] = json {
        {"pool_slots",           params_base.pool_slots},
        {"pool_auto",            params_base.pool_auto},
        {"pool_auto_min_tokens", params_base.pool_auto_min_tokens},
        {"share_any",            params_base.share_any},
        {"pool_files",           files ? files->identity() : json(nullptr)},
    };
}

void polykv_shared_prefix_per_choice(json & results) {
    if (!results.is_array() || results.size() < 2) {
        return;
    }
    for (auto & r : results) {
        if (r.is_object() && r.contains("shared_prefix") && r.contains("choices") && r.at("choices").is_array() && !r.at("choices").empty()) {
            r["choices"][0]["shared_prefix"] = r.at("shared_prefix");
            r.erase("shared_prefix");
        }
    }
}
