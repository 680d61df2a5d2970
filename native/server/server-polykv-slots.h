#pragma once

// polykv on the server's slots: the bodies of the hooks patches 0072-0078 call from server_context (slot pick,
// prefix wait, share, promotion, pool files, pool state), and how a source slot is chosen.
//
// server_slot and server_context are private to server-context.cpp, so a slot carries one polykv member
// (polykv_slot), and each hook gets a polykv_server: what server_context::polykv_srv() passes of the server and a
// view of every slot. Entry points, in the order a request meets them, and their callers in server-context.cpp:
//   polykv_server_init      load_model: --pool-slots, --pool-auto, pool files, --shared-decode, --share-any
//   polykv_pick_slot        get_available_slot: the idle slot a --share-any task loses least cache on
//   polykv_prefix_wait      update_slots, a task's prompt about to start: another slot computes a longer prefix
//   polykv_share_prefix     update_slots, after the cache matching has set n_past: choose a source, share, promote
//   polykv_pool_snapshots   update_slots, each pass: the pools' KV positions for /slots
//   polykv_pool_states      process_single_task, /slots: each pool's "polykv_pool_state"
//   polykv_pool_file_action process_single_task, /slots/N?action=save|restore of a reserved pool

#include "server-polykv.h"
#include "server-polykv-files.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct server_prompt;
struct server_task;
struct server_task_result_slot_save_load;

// A server slot's polykv state: server_slot's one polykv member (0072).
struct polykv_slot {
    server_shared_prefix_outcome shared_prefix;     // the running task's share outcome ("shared_prefix")
    int32_t                      n_shared    = 0;     // cells [0, n_shared) of the slot's sequence may also belong to
                                                      // another sequence (a unified KV share): never shifted (seq_add)
    int32_t                      shared_from = -1;    // the slot a sharer's cells came from (-1: none)
    bool                         is_pool     = false; // reserved (--pool-slots): runs only tasks pinned to it; its KV
                                                      // is never purged for room nor saved-and-cleared when idle
    polykv_pool_stats            stats;               // a pool's hits, last use and restore (/slots)

    void on_clear() { n_shared = 0; shared_from = -1; } // server_slot::prompt_clear: the sequence holds nothing
    void on_reset() { shared_prefix = {}; }              // server_slot::reset: the task has ended
};

// What a hook knows about one slot.
struct polykv_slot_view {
    int                                           id          = -1;
    server_prompt *                               prompt      = nullptr; // the cached tokens and their provenance
    polykv_slot *                                 pk          = nullptr;
    const common_memory *                         mem         = nullptr;
    const server_task *                           task        = nullptr; // the running task, nullptr when idle
    const std::vector<common_adapter_lora_info> * lora        = nullptr; // the LoRA set the slot runs with
    int32_t                                       n_ctx       = 0;
    bool                                          busy        = false; // is_processing()
    bool                                          prefilling  = false; // PROCESSING_PROMPT or DONE_PROMPT: the cells
                                                                       // of its last batch are not decoded yet
    bool                                          speculative = false; // can_speculate(), or a draft context
    int64_t                                       t_last_used = -1;
};

// What a hook knows about the server: built by server_context::polykv_srv() for each call and passed as const (a hook
// changes slots through the views' pointers, the server through the reference members).
struct polykv_server {
    common_params &               params;            // params_base (polykv_server_init turns --share-any off where
                                                     // no share is possible)
    llama_context *               ctx;               // ctx_tgt
    server_metrics &              metrics;
    polykv_pool_files &           files;
    bool                          multimodal;        // a multimodal context
    bool                          no_partial_seq_rm; // memory without partial sequence removal (recurrent, hybrid)
    std::vector<polykv_slot_view> slots;             // every slot, slots[i].id == i
};

// What identifies a prompt's cells: its tokens, and the cache_salt and LoRA set it runs under (cells computed under
// another salt or LoRA set are never taken, as SGLang keeps salt and LoRA inside its RadixKey).
struct polykv_prompt_key {
    const server_tokens &                         tokens;
    const std::string &                           salt;
    const std::vector<common_adapter_lora_info> & lora;

    int32_t n_max() const { return polykv_share_max(tokens); } // the n - 1 rule
};

// Start-up (load_model): reserves the --pool-slots, checks --pool-auto, starts the pool files' model hash and
// turns --shared-decode and --share-any on (off with a warning where no share is possible). False (logged) on a
// configuration the server must not start with.
bool polykv_server_init(const polykv_server & srv, const llama_model * model);

// --share-any: the idle, unreserved slot a new unpinned task should run on, or -1 (upstream's choice then).
// The task keeps what it takes from the slot (common prefix) and destroys the rest of its cache, which other
// tasks may still want (an agent's own history): so the slot that loses the fewest cached tokens wins (an empty
// slot or one the prompt extends loses none), then the longest common prefix, then the least recently used. A slot
// that holds fewer than --pool-auto-min-tokens of the prompt's exact cells, or cells of another salt or LoRA set
// (never reused, see polykv_prov_start), loses all it holds: such slots come last and rank by last use (upstream's
// LRU). lora is the set the task will run with (the server's own adapters when the request names none).
int polykv_pick_slot(const polykv_server & srv, const server_task & task, const std::vector<common_adapter_lora_info> & lora);

// --share-any coalescing, for the task of slot id whose prompt is about to start: true while another slot computes
// (prefills) a common prefix of its prompt at least --pool-auto-min-tokens longer than what the task can get now
// (its own cache, or the best computed source; polykv_share_any_wait). The slot then stays in SLOT_STATE_STARTED and
// shares those cells on a later pass. A waiting slot is never a leader (it is not prefilling), so waits cannot form
// a cycle; a wait ends after --share-any-max-wait ms (0078).
bool polykv_prefix_wait(const polykv_server & srv, int id);

// The share, once per task when its prompt starts, after the normal cache matching has set n_past: records what
// computes the slot's cells from n_past on (polykv_prov_start), chooses the source (the task's shared_pool_slot,
// else --pool-auto's reserved pool, else --share-any's longest computed prefix), shares (polykv_share_run: on a share
// n_past becomes P) and promotes a prefix shared from an unreserved slot into a free reserved pool.
void polykv_share_prefix(const polykv_server & srv, int id, int & n_past);

// Each pass of update_slots: records how much of each reserved pool is resident (polykv_pool_snapshot), which /slots
// reports while a decode runs.
void polykv_pool_snapshots(const polykv_server & srv);

// /slots: adds "polykv_pool_state" to each reserved pool's entry of slots_data (indexed by slot id), with the sharers
// that still hold its cells; snapshot: read the KV positions now (false while a decode runs: the last pass's).
void polykv_pool_states(const polykv_server & srv, json & slots_data, bool snapshot);

// /slots/N?action=save|restore of the reserved pool task.slot_action.id_slot: a verified pool file written from its
// resident cells, or read, verified against this server and the request, and loaded (server-polykv-files.cpp). A
// restore changes nothing until the file is verified and leaves the pool empty if loading fails. Throws
// std::runtime_error ("Unable to save|restore pool slot N: reason") on a refusal.
std::unique_ptr<server_task_result_slot_save_load> polykv_pool_file_action(const polykv_server & srv, const server_task & task, bool is_save);

// How a source is chosen (used by the hooks above; exposed for their documentation and for checks).

// --pool-auto: among the reserved pools other than slot self whose cells were computed under the key's salt and LoRA
// set, the one with the longest exact common prefix with the prompt (ties: an idle pool, then the lowest id), if that
// prefix (capped at key.n_max()) is at least min_tokens; else -1.
int polykv_auto_pool(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens);

// --share-any: a computed prefix another slot holds
struct polykv_any_source {
    int     id = -1; // the slot, -1: none
    int32_t n  = 0;  // its cells [0, n) are computed and hold the prompt's first n tokens
};

// --share-any: among the slots other than self whose cells were computed under the key's salt and LoRA set (busy or
// idle, reserved or not), the one holding the longest computed, exact prefix of the prompt (capped at key.n_max()
// and at the slot's exact length, checked against the sequence's positions, so cells a prefilling slot has not
// computed yet are never counted), if >= min_tokens. With SWA only a slot that still holds the window of the
// prompt's first own token counts; if none does, the longest such prefix is returned, for the share to refuse it
// ("swa_window").
polykv_any_source polykv_share_any_source(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens);

// --share-any coalescing: does a slot other than self that is prefilling hold a prompt of the key's salt and LoRA set
// (another tenant's prefill is never waited for) sharing at least min_tokens and more than n_now exact tokens with
// this one?
bool polykv_share_any_wait(const polykv_server & srv, int self, const polykv_prompt_key & key, int32_t min_tokens, int32_t n_now);

// --share-any promotion: the reserved pool a prefix of n tokens just shared from an unreserved slot should be copied
// into, so that it outlives that slot (never purged, cleared or picked for a task): an idle pool that holds nothing,
// else the least recently used idle pool holding an earlier promoted prefix (pools a client primed or restored are
// never taken); -1 if a reserved pool of this provenance already holds the n tokens, or none is free.
int polykv_promote_target(const polykv_server & srv, const server_tokens & tokens, int32_t n, const polykv_provenance & prov);

// SWA cells below its window a promoted pool keeps, for shares a few tokens shorter than the pool (polykv_copy_prefix)
constexpr llama_pos POLYKV_SWA_POOL_MARGIN = 64;

// Replaces sequence dst's cells by src's cells [0, n) (seq_cp: with unified KV no data is copied) and checks dst then
// holds positions [0, n) (with SWA: from polykv_window_start(n) on); false (logged, dst left empty) otherwise.
bool polykv_copy_prefix(const common_memory & mem, int src, int dst, int32_t n);
