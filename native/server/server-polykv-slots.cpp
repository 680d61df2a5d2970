#include "server-polykv-slots.h"

#include "polykv-memory.h" // polykv_memory_swa_seq_rm
#include "server-task.h"

#include <algorithm>
#include <stdexcept>

// A slot's log line, as server-context.cpp's SLT_* macros write it ("slot <func>: id <slot> | task <task> | ...").
#define POLYKV_SLOT_LOG(LEVEL, view, fmt, ...) \
    LEVEL("slot %12.*s: id %2d | task %d | " fmt, 12, __func__, (view).id, ((view).task ? (view).task->id : -1), __VA_ARGS__)

static bool is_completion(const server_task & task) {
    return task.type == SERVER_TASK_TYPE_COMPLETION || task.type == SERVER_TASK_TYPE_INFILL;
}

bool polykv_server_init(const polykv_server & srv, const llama_model * model) {
    const common_params & params = srv.params;
    for (const int32_t id : params.pool_slots) {
        if (id < 0 || id >= (int) srv.slots.size()) {
            SRV_ERR("--pool-slots: slot %d does not exist (n_slots = %zu, ids 0..%zu)\n", id, srv.slots.size(), srv.slots.size() - 1);
            return false;
        }
        srv.slots[id].pk->is_pool = true;
    }
    if (!params.pool_slots.empty()) {
        if (params.pool_slots.size() >= srv.slots.size()) {
            SRV_ERR("--pool-slots: all %zu slots are reserved, at least one must stay for other requests (raise --parallel)\n", srv.slots.size());
            return false;
        }
        std::string ids;
        for (const int32_t id : params.pool_slots) {
            ids += (ids.empty() ? "" : ",") + std::to_string(id);
        }
        SRV_INF("polykv: slots %s reserved as pools (pinned tasks only, never purged or cleared when idle)\n", ids.c_str());
    }
    if (params.pool_auto && params.pool_slots.empty()) {
        SRV_ERR("%s", "--pool-auto needs --pool-slots: automatic sharing takes prefixes only from reserved pool slots\n");
        return false;
    }
    srv.files.init(params, model, srv.ctx); // hashes the model file in the background (0075)
    if (!polykv_shared_decode_init(params)) { // 0076
        return false;
    }
    // --share-any (0077), off with a warning where a share is never possible
    const char * unsupported = srv.multimodal ? "multimodal"
        : srv.no_partial_seq_rm ? "memory without partial sequence removal (recurrent/hybrid)"
        : !srv.slots.empty() && srv.slots[0].speculative ? "speculative decoding" : nullptr;
    if (!polykv_share_any_init(srv.params, unsupported)) {
        return false;
    }
    srv.metrics.polykv_enabled = !params.pool_slots.empty() || params.share_any;
    return true;
}

// The leading cells of a sequence holding `held` (provenance prov) a task with this key may take: their common
// prefix, cut at the sequence's exact length; 0 if the provenance does not match.
static int32_t shareable_prefix(const polykv_provenance & prov, const server_tokens & held, const polykv_prompt_key & key) {
    const int32_t n_exact = polykv_prov_shareable(prov, key.salt, key.lora);
    return n_exact > 0 ? std::min<int32_t>((int32_t) held.get_common_prefix(key.tokens), n_exact) : 0;
}

int polykv_auto_pool(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens) {
    int best = -1;
    int best_n = -1;
    bool best_busy = true;
    for (const auto & p : srv.slots) {
        if (!p.pk->is_pool || p.id == self) {
            continue;
        }
        const int32_t n_held = shareable_prefix(p.prompt->polykv, p.prompt->tokens, key);
        if (n_held <= 0) {
            continue;
        }
        const int n = std::min<int>(n_held, key.n_max());
        if (n > best_n || (n == best_n && best_busy && !p.busy)) {
            best = p.id;
            best_n = n;
            best_busy = p.busy;
        }
    }
    return best_n >= std::max<int32_t>(min_tokens, 1) ? best : -1;
}

int polykv_pick_slot(const polykv_server & srv, const server_task & task, const std::vector<common_adapter_lora_info> & lora) {
    if (!srv.params.share_any || task.params.shared_pool_slot >= 0) {
        return -1;
    }
    const polykv_prompt_key key { task.tokens, task.params.cache_salt, lora };
    const int32_t min_tokens = srv.params.pool_auto_min_tokens;

    // the key, smallest first: (cached tokens lost, -common prefix, last use); a slot that holds fewer than min_tokens
    // of the prompt (or cells of another salt / LoRA set) loses all it holds, and those slots rank by last use alone
    constexpr size_t all_lost = SIZE_MAX;

    const polykv_slot_view * best = nullptr;
    size_t  best_loss = 0;
    size_t  best_lcp  = 0;
    for (const auto & s : srv.slots) {
        if (s.busy || s.pk->is_pool) {
            continue;
        }
        size_t lcp  = (size_t) shareable_prefix(s.prompt->polykv, s.prompt->tokens, key);
        size_t loss = s.prompt->tokens.size() - lcp;
        if (loss > 0 && lcp < (size_t) std::max<int32_t>(min_tokens, 1)) {
            lcp  = 0;
            loss = all_lost;
        }
        const bool better = best == nullptr || loss < best_loss || (loss == best_loss && lcp > best_lcp) ||
                            (loss == best_loss && lcp == best_lcp && s.t_last_used < best->t_last_used);
        if (better) {
            best      = &s;
            best_loss = loss;
            best_lcp  = lcp;
        }
    }
    if (best != nullptr) {
        POLYKV_SLOT_LOG(LOG_INF, *best, "%s", "polykv: selected slot by least cache lost (--share-any)\n");
    }
    return best != nullptr ? best->id : -1;
}

polykv_any_source polykv_share_any_source(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens) {
    polykv_any_source best;
    polykv_any_source lost; // the longest prefix whose sliding window is gone
    const int32_t n_min = std::max<int32_t>(min_tokens, 1);
    if (key.n_max() < n_min || key.tokens.has_mtmd) {
        return best;
    }
    auto *        mem   = llama_get_memory(srv.ctx);
    const int32_t n_swa = polykv_n_swa(srv.ctx);
    for (const auto & s : srv.slots) {
        if (s.id == self) {
            continue;
        }
        int32_t n = std::min<int32_t>(shareable_prefix(s.prompt->polykv, s.prompt->tokens, key), key.n_max());
        if (n < n_min || n <= best.n) {
            continue;
        }
        // only cells the sequence holds: a prefilling slot's tokens include those of the batch not decoded yet;
        // with SWA, only if the window of the task's first token (at n) is still there
        const llama_pos pos_min = llama_memory_seq_pos_min(mem, s.id);
        if (pos_min < 0 || (n_swa == 0 && pos_min != 0)) {
            continue;
        }
        n = std::min<int32_t>(n, (int32_t) llama_memory_seq_pos_max(mem, s.id) + 1);
        if (pos_min > polykv_window_start(n_swa, n)) {
            if (n >= n_min && n > lost.n) {
                lost.id = s.id; // reported as "swa_window" by the share if no source holds its window
                lost.n  = n;
            }
            continue;
        }
        if (n >= n_min && n > best.n) {
            best.id = s.id;
            best.n  = n;
        }
    }
    return best.id >= 0 ? best : lost;
}

bool polykv_share_any_wait(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens, int32_t n_now) {
    if (key.n_max() < std::max<int32_t>(min_tokens, 1) || n_now >= key.n_max() || key.tokens.has_mtmd) {
        return false;
    }
    for (const auto & s : srv.slots) {
        // a leader of another salt or LoRA set is never waited for (its cells could not be shared anyway, and the
        // wait would tell this request that another tenant is computing the same prefix)
        if (s.id == self || !s.prefilling || s.task == nullptr) {
            continue;
        }
        const int32_t n = std::min<int32_t>(shareable_prefix(s.prompt->polykv, s.task->tokens, key), key.n_max());
        if (n >= min_tokens && n > n_now) {
            return true;
        }
    }
    return false;
}

bool polykv_prefix_wait(const polykv_server & srv, int id) {
    const polykv_slot_view & self   = srv.slots[id];
    const server_task &   task   = *self.task;
    const common_params & params = srv.params;
    if (!params.share_any || task.params.shared_pool_slot >= 0 || !task.params.cache_prompt || !is_completion(task)) {
        return false;
    }
    const polykv_prompt_key key { task.tokens, task.params.cache_salt, *self.lora };
    const int32_t min   = params.pool_auto_min_tokens;
    const int32_t n_own = (int32_t) self.prompt->tokens.get_common_prefix(task.tokens);
    const int32_t n_src = polykv_share_any_source(srv, id, key, min).n;
    if (!polykv_share_any_wait(srv, id, key, min, std::max(n_own, n_src))) {
        return false;
    }
    server_shared_prefix_outcome & out = self.pk->shared_prefix;
    if (out.waited && ggml_time_us() - out.t_wait_us > 1000ll * params.share_any_max_wait_ms) {
        POLYKV_SLOT_LOG(LOG_INF, self, "polykv: stopped waiting after %d ms (--share-any-max-wait), computing the rest itself\n",
                        params.share_any_max_wait_ms);
        return false; // 0078: a wait is bounded
    }
    if (!out.waited) {
        out.t_wait_us = ggml_time_us();
        out.waited    = true;
        srv.metrics.polykv_n_waits++;
        POLYKV_SLOT_LOG(LOG_INF, self, "polykv: waiting for another slot to compute this prompt's common prefix (task %d)\n", task.id);
    }
    return true;
}

int polykv_promote_target(const polykv_server & srv, const server_tokens & tokens, int32_t n, const polykv_provenance & prov) {
    const polykv_slot_view * best = nullptr;
    bool best_empty = false;
    const polykv_prompt_key key { tokens, prov.salt, prov.lora };
    for (const auto & s : srv.slots) {
        if (!s.pk->is_pool) {
            continue;
        }
        const bool empty = s.prompt->tokens.size() == 0;
        if (!empty && prov.salt_known && prov.lora_known && shareable_prefix(s.prompt->polykv, s.prompt->tokens, key) >= n) {
            return -1; // already held by a pool
        }
        if (s.busy || (!empty && !s.pk->stats.promoted)) {
            continue;
        }
        if (best == nullptr || (empty && !best_empty) ||
            (empty == best_empty && s.pk->stats.t_last_use_us < best->pk->stats.t_last_use_us)) {
            best       = &s;
            best_empty = empty;
        }
    }
    return best != nullptr ? best->id : -1;
}

bool polykv_copy_prefix(const common_memory & mem, int src, int dst, int32_t n) {
    mem.seq_rm(dst, -1, -1);
    mem.seq_cp(src, dst, 0, n);
    auto * llama_mem = llama_get_memory(mem.ctx_tgt);
    // with SWA, as in polykv_share_kv, but the pool keeps POLYKV_SWA_POOL_MARGIN cells more: a later prompt often
    // parts from the promoted prefix a few tokens before its end (another question's first tokens), and a share of
    // those m < n tokens needs the window of m. (Held by the source too, they stay while it does; then they are
    // masked cells of the pool's alone, which the SWA cache reuses when it needs room.)
    const llama_pos keep = polykv_window_start(polykv_n_swa(mem.ctx_tgt), n) - POLYKV_SWA_POOL_MARGIN;
    polykv_memory_swa_seq_rm(llama_mem, dst, keep);
    const llama_pos pos_min = llama_memory_seq_pos_min(llama_mem, dst);
    const llama_pos pos_max = llama_memory_seq_pos_max(llama_mem, dst);
    if (polykv_seq_resident(mem.ctx_tgt, dst) != n) { // n = pos_max + 1, the window and any state there
        LOG_ERR("slot %12.*s: id %2d | task -1 | polykv: prefix copied from slot %d has pos [%d, %d], expected [0, %d] - dropped\n",
                12, "polykv_promote", dst, src, (int) pos_min, (int) pos_max, n - 1);
        mem.seq_rm(dst, -1, -1);
        return false;
    }
    return true;
}

// --share-any promotion (0077): copies the prefix [0, n) of src into a free reserved pool.
static void promote(const polykv_server & srv, const server_task & task, const polykv_slot_view & src, int32_t n) {
    const int id = polykv_promote_target(srv, task.tokens, n, src.prompt->polykv);
    if (id < 0) {
        return;
    }
    const polykv_slot_view & dst = srv.slots[id];
    if (!polykv_copy_prefix(*src.mem, src.id, dst.id, n)) {
        dst.prompt->clear();
        dst.pk->on_clear();
        return;
    }
    server_tokens kept = task.tokens.clone();
    kept.keep_first(n);
    dst.prompt->tokens = std::move(kept);
    dst.prompt->checkpoints.clear();
    polykv_prov_shared(dst.prompt->polykv, src.prompt->polykv); // 0078: a salted prefix stays salted
    dst.pk->n_shared             = n;
    dst.pk->stats                = {};
    dst.pk->stats.promoted       = true;
    dst.pk->stats.t_last_use_us  = ggml_time_us();
    src.pk->n_shared = std::max(src.pk->n_shared, n);
    srv.metrics.polykv_n_promoted++;
    POLYKV_SLOT_LOG(LOG_INF, dst, "polykv: promoted the %d-token prefix shared from slot %d into this reserved pool\n", n, src.id);
}

void polykv_share_prefix(const polykv_server & srv, int id, int & n_past) {
    const polykv_slot_view & self   = srv.slots[id];
    polykv_slot &         pk     = *self.pk;
    const server_task &   task   = *self.task;
    const common_params & params = srv.params;

    // cells from n_past on are dropped from the slot's sequence next
    pk.n_shared = std::min<int32_t>(pk.n_shared, n_past);

    // what computes the slot's cells from n_past on (a reserved pool, or any slot with --share-any, recomputes cells
    // of another salt / LoRA set, and shifted ones unless the task asked for chunk reuse)
    polykv_prov_start(self.prompt->polykv, pk.is_pool || params.share_any, task.params.n_cache_reuse > 0,
                      task.params.cache_salt, *self.lora, id, n_past);

    if (pk.is_pool) {
        pk.stats.promoted      = false; // 0077: a task on the pool: its content is the client's now
        pk.stats.t_last_use_us = ggml_time_us();
        if (n_past == 0) {
            pk.stats.restored_from.clear(); // computed here from the first token
        }
    }

    const polykv_prompt_key key { task.tokens, task.params.cache_salt, *self.lora };
    int  id_pool   = task.params.shared_pool_slot;
    bool auto_pool = false;

    // --pool-auto: an unpinned request that names no pool takes the best-matching reserved pool of its salt
    if (id_pool < 0 && params.pool_auto && task.id_slot == -1) {
        id_pool   = polykv_auto_pool(srv, id, key, params.pool_auto_min_tokens);
        auto_pool = id_pool >= 0;
    }

    // --share-any (0077): a task that names no pool takes the longest computed prefix another slot holds
    int32_t any_n = 0;
    if (id_pool < 0 && params.share_any && task.params.cache_prompt) {
        const polykv_any_source src = polykv_share_any_source(srv, id, key, params.pool_auto_min_tokens);
        if (src.id >= 0 && src.n > n_past) {
            id_pool = src.id;
            any_n   = src.n;
        }
    }
    if (id_pool < 0) {
        return;
    }

    const polykv_slot_view * pool = id_pool < (int) srv.slots.size() ? &srv.slots[id_pool] : nullptr;
    const polykv_provenance * pool_prov = pool ? &pool->prompt->polykv : nullptr;

    polykv_share_input in;
    in.id_slot           = id;
    in.id_task           = task.id;
    in.pool_slot         = id_pool;
    in.requested         = task.params.shared_prefix_n_tokens;
    in.auto_n            = auto_pool || !task.params.shared_prefix_given;
    if (any_n > 0) { // 0077: P and the source chosen above, verified as if given; a busy source is fine
        in.requested = any_n;
        in.auto_n    = false;
        in.auto_any  = true;
    }
    in.auto_pool         = auto_pool;
    in.auto_min          = params.pool_auto_min_tokens;
    in.salt_differs      = pool_prov && (!pool_prov->salt_known || pool_prov->salt != task.params.cache_salt);
    in.pool_exact        = pool_prov ? pool_prov->n_exact : polykv_provenance::ALL;
    in.tokens            = &task.tokens;
    in.pool_tokens       = pool ? &pool->prompt->tokens : nullptr;
    in.not_completion    = !is_completion(task);
    in.multimodal        = srv.multimodal || task.tokens.has_mtmd;
    in.no_partial_seq_rm = srv.no_partial_seq_rm;
    in.speculative       = self.speculative;
    in.ctx_shift         = params.ctx_shift;
    in.lora_differs      = pool_prov && (lora_all_alora(*self.lora) || !pool_prov->lora_known || !are_lora_equal(*self.lora, pool_prov->lora));
    in.pool_busy         = pool && pool->busy && !in.auto_any; // 0077: computed cells only, checked by position

    const bool waited = pk.shared_prefix.waited;
    pk.shared_prefix = polykv_share_run(in, params.kv_unified, *self.mem, *self.prompt, pk.n_shared,
                                        pool ? &pool->pk->n_shared : nullptr, n_past, srv.metrics);
    pk.shared_prefix.waited = waited;

    if (pk.shared_prefix.is_share()) {
        polykv_prov_shared(self.prompt->polykv, *pool_prov); // cells [0, P) are the pool's, their salt and LoRA set this task's
        pk.shared_from = pool->id;
        pool->pk->stats.hits++;
        pool->pk->stats.t_last_use_us = ggml_time_us();

        // 0077: a prefix shared from an unreserved slot is kept in a reserved pool, so it outlives that slot
        if (in.auto_any && !pool->pk->is_pool) {
            promote(srv, task, *pool, any_n);
        }
    }
}

void polykv_pool_snapshots(const polykv_server & srv) {
    for (const auto & s : srv.slots) {
        if (s.pk->is_pool) {
            polykv_pool_snapshot(srv.ctx, s.id, s.pk->stats);
        }
    }
}

void polykv_pool_states(const polykv_server & srv, json & slots_data, bool snapshot) {
    for (const auto & pool : srv.slots) {
        if (!pool.pk->is_pool) {
            continue;
        }
        const int n_sharers = (int) std::count_if(srv.slots.begin(), srv.slots.end(), [&](const polykv_slot_view & s) {
            return s.pk->shared_from == pool.id && s.pk->n_shared > 0;
        });
        if (snapshot) {
            polykv_pool_snapshot(srv.ctx, pool.id, pool.pk->stats);
        }
        slots_data[pool.id]["polykv_pool_state"] = polykv_pool_state_json(pool.prompt->tokens, pool.prompt->polykv, pool.pk->stats, n_sharers);
    }
}

std::unique_ptr<server_task_result_slot_save_load> polykv_pool_file_action(const polykv_server & srv, const server_task & task, bool is_save) {
    const int64_t      t_start = ggml_time_us();
    const polykv_slot_view & slot    = srv.slots.at(task.slot_action.id_slot);

    auto res = std::make_unique<server_task_result_slot_save_load>();
    res->id       = task.id;
    res->id_slot  = slot.id;
    res->filename = task.slot_action.filename;
    res->is_save  = is_save;
    try {
        if (is_save) {
            const llama_tokens tokens = polykv_resident_tokens(srv.ctx, slot.id, slot.prompt->tokens);
            res->polykv   = srv.files.save(srv.ctx, slot.id, tokens, slot.prompt->polykv, task.slot_action.polykv, task.slot_action.filepath);
            res->n_tokens = tokens.size();
            res->n_bytes  = res->polykv.value("file_bytes", (size_t) 0);
        } else {
            const polykv_pool_file file = srv.files.read(task.slot_action.filepath, task.slot_action.polykv, (uint32_t) slot.n_ctx);
            slot.mem->seq_rm(slot.id, -1, -1); // server_slot::prompt_clear
            slot.prompt->clear();
            slot.pk->on_clear();
            res->polykv = srv.files.load(srv.ctx, slot.id, file);
            slot.prompt->tokens = server_tokens(file.tokens, false);
            slot.prompt->polykv = polykv_restored_prov(task.slot_action.polykv, srv.params.lora_adapters);
            slot.pk->stats.restored_from = task.slot_action.filename;
            slot.pk->stats.promoted      = task.slot_action.polykv.value("promoted", false); // 0077: restored by polykv serve
            slot.pk->stats.t_last_use_us = ggml_time_us();
            res->n_tokens = file.tokens.size();
            res->n_bytes  = file.n_bytes;
        }
    } catch (const std::exception & err) {
        POLYKV_SLOT_LOG(LOG_WRN, slot, "polykv: %s %s refused: %s\n", is_save ? "save to" : "restore from", task.slot_action.filename.c_str(), err.what());
        throw std::runtime_error(string_format("Unable to %s pool slot %d: %s", is_save ? "save" : "restore", slot.id, err.what()));
    }
    res->t_ms = (ggml_time_us() - t_start) / 1000.0;
    POLYKV_SLOT_LOG(LOG_INF, slot, "polykv: %s %s: %zu tokens, %zu bytes, %.1f ms\n", is_save ? "saved to" : "restored from",
                    task.slot_action.filename.c_str(), res->n_tokens, res->n_bytes, res->t_ms);
    return res;
}
