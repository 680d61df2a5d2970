#pragma once

// polykv shared KV prefix: a request that sets shared_pool_slot takes the KV of its first
// shared_prefix_n_tokens prompt tokens from that slot (the pool) instead of computing them.
// The code lives here; upstream's server files only call it (server_slot and server_context
// stay private to server-context.cpp, so what they know is passed in explicitly).
//
// Entry points, in the order a request meets them, and their callers in upstream's files (native/README.md
// has the whole map with the patches; the hooks on the slots are in server-polykv-slots.h):
//   polykv_check_pool_slot, polykv_json_salt           server-schema.cpp (request fields)
//   polykv_check_schedulable                           handle_completions_impl
//   polykv_share_run                                   polykv_share_prefix (server-polykv-slots.cpp)
//   polykv_share_final, polykv_add_shared_prefix       send_final_response, server-task.cpp
//   polykv_shared_prefix_per_choice                    handle_completions_impl (n > 1)
//   polykv_add_props, polykv_write_metrics             get_res_props, server-task.cpp (/metrics)
//   polykv_shared_decode_init, polykv_share_any_init   polykv_server_init (server-polykv-slots.cpp)

#include "server-common.h" // json, server_tokens, server_metrics
#include "polykv-memory.h"  // POLYKV_MEMORY_NO_PART
#include "server-polykv-provenance.h"

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

struct server_prompt;
struct server_task_result_cmpl_final;
struct task_params;

// what happened to a request's shared_pool_slot / shared_prefix_n_tokens
// reported as "shared_prefix" in the final response of requests that set shared_pool_slot >= 0
struct server_shared_prefix_outcome {
    int32_t     pool_slot = -1; // -1: the request did not opt in, nothing is reported
    int32_t     requested = 0;  // shared_prefix_n_tokens as sent
    bool        requested_given = true; // false: P was not given (reported as null), the server computed it
    std::string auto_kind;      // "prefix" (P computed), "pool" (pool and P chosen by --pool-auto), "any" (a slot and P
                                // chosen by --share-any), "" (both given)
    int32_t     shared    = 0;  // prompt tokens whose KV came from the pool slot and were not computed
    int32_t     common    = -1; // on "mismatch": number of leading tokens the pool slot does have in common
    int32_t     exact     = -1; // on "inexact": the pool's cells [0, exact) are exact, later ones were shifted (0078)
    int32_t     window    = -1; // on "swa_window": the first position the pool's sliding-window layers still hold
    int32_t     state     = -1; // on "recurrent_state": the one prefix length the pool's recurrent state is exact for
                                // (its position + 1; 0: it holds none)
    std::string status;         // see docs: hit, copied, own_cache, not_resident, mismatch, salt_mismatch, inexact,
                                // swa_window, recurrent_state, pool_busy, self, unsupported, no_prefix, skipped
    std::string reason;         // on "unsupported": why
    bool        waited    = false; // --share-any: the prompt waited for another slot to compute the common prefix
    int64_t     t_wait_us = -1;    // when that wait began (ggml_time_us): a wait ends after --share-any-max-wait

    bool opted_in() const { return pool_slot >= 0; }
    bool is_share() const { return status == "hit" || status == "copied"; }

    json to_json() const;
};

// what the decision needs to know about the task, its slot, the pool slot and the server
struct polykv_share_input {
    int id_slot = -1; // the slot running the task (also for the log lines)
    int id_task = -1; // for the log lines

    int32_t pool_slot = -1; // task.params.shared_pool_slot
    int32_t requested = 0;  // task.params.shared_prefix_n_tokens
    bool    auto_n    = false; // P not given: share the longest common prefix of the pool's tokens and the prompt
    bool    auto_pool = false; // the pool was chosen by --pool-auto (implies auto_n)
    bool    auto_any  = false; // the source slot and P were chosen by --share-any (P verified as if given)
    int32_t auto_min  = 0;     // auto_n on a named pool: a common prefix shorter than this (and than the pool's
                               // tokens) is a "mismatch", not a share of a few tokens (--pool-auto-min-tokens)
    bool    salt_differs = false; // the pool's cells were computed under another cache_salt (or salts are mixed)
    int32_t pool_exact   = polykv_provenance::ALL; // the pool's cells [0, pool_exact) are exact (0078: not shifted)

    const server_tokens * tokens      = nullptr; // the task's prompt
    const server_tokens * pool_tokens = nullptr; // the pool slot's cached tokens; nullptr: no such slot

    // configurations where the pool's cells [0, P) are not exactly what this slot would compute, or where
    // they cannot be taken over safely (reported as "unsupported" with a reason, checked in this order)
    bool not_completion    = false; // not a completion or infill task
    bool multimodal        = false; // a multimodal context, or a prompt with media
    bool no_partial_seq_rm = false; // memory without partial sequence removal: recurrent/hybrid (shared under the
                                    // recurrent rule, see pool_rs_pos) or none at all (refused)
    bool speculative       = false; // speculative decoding (or a draft context)
    bool ctx_shift         = false; // --context-shift
    bool lora_differs      = false; // LoRA adapters differ from the pool slot's (or aLoRA)

    bool      pool_busy    = false; // the pool slot is processing a task: its cells can change
    llama_pos pool_pos_min = -1;    // the pool sequence's positions (polykv_share_run() reads them): the first of its
    llama_pos pool_pos_max = -1;    // attention cells (with SWA: of the sliding-window layers, see polykv_window_start;
                                    // polykv_memory_attn_pos_min) and the last it holds
    llama_pos pool_rs_pos  = POLYKV_MEMORY_NO_PART; // the position of the pool's recurrent state (polykv_memory_rs_pos)
    int32_t   n_swa        = 0;     // the model's sliding window, 0: none (polykv_share_run() reads it)
};

// Sliding-window attention (SWA: Gemma 2/3, gpt-oss, ...): the KV cache of the SWA layers drops a sequence's cells
// once they leave its window (llama_kv_cache::find_slot reuses a cell held by that sequence alone and masked for its
// next position; apply_ubatch then removes the sequence's cells up to it), so what a sequence holds there is a
// contiguous range [pos_min, pos_max] with pos_min >= 0, and llama_memory_seq_pos_min() reports that pos_min; the
// full-attention layers keep [0, pos_max]. A token at position p attends to (p - n_swa, p] in a standard window
// (a chunked one needs less), so cells [0, n) serve a continuation at position p exactly iff the sequence holds
// [polykv_window_start(n_swa, p), n): a share, a promotion and a pool file are exact under that test and refused
// ("swa_window") otherwise. Cells a share added to another sequence are held by two and never dropped.
//
// Recurrent layers (Mamba, RWKV; hybrid models' recurrent layers: LFM2, Jamba, Qwen3.5) keep one state per sequence,
// the state after its last token, and seq_cp shares that state (copy-on-write: llama_memory_recurrent::find_slot
// copies a state held by two sequences before one of them goes on). It is exact for a continuation at exactly one
// position, its own + 1: a share takes n = that length, and the task must evaluate from n on (n < its prompt);
// anything else is refused ("recurrent_state"), never served from a state computed for other tokens.
// The first position a token at position p needs (0 without SWA: n_swa 0).
llama_pos polykv_window_start(int32_t n_swa, llama_pos p);

// The n - 1 rule, stated once: a share covers at most the prompt's first n - 1 tokens, because its last token is
// always evaluated, for its logits (upstream's [TAG_PROMPT_LOGITS] re-evaluates it when the whole prompt is cached).
// The same bound is the position of the first token a task evaluates after a full-length share.
inline int32_t polykv_share_max(const server_tokens & prompt) {
    return (int32_t) prompt.size() - 1;
}

// The model's sliding window (llama_model_n_swa), 0 without SWA.
int32_t polykv_n_swa(llama_context * ctx);

// n such that sequence seq holds every cell a continuation at position n needs (pos_max + 1), or 0 if it holds
// nothing, its SWA layers dropped part of the window (see polykv_window_start) or its recurrent state is not at
// pos_max. With recurrent memory n is the only continuation the sequence serves.
int32_t polykv_seq_resident(llama_context * ctx, llama_seq_id seq);

struct polykv_share_decision {
    server_shared_prefix_outcome outcome; // pool_slot and requested set; status set if refused
    int32_t n_share = 0;                  // > 0: share the pool's cells [0, n_share); status is set by the share
};

// --share-any at start: false (logged) without unified KV (a share adds a sequence id to computed cells); where no
// share is ever possible (the reason, as polykv_share_decide() would report it), a warning and the option off.
bool polykv_share_any_init(common_params & params_base, const char * unsupported);

// Request checks made when the tasks are created (HTTP 400 with the message, nothing queued): a request the
// scheduler could never place (n_cmpl larger than the unreserved slots; an unpinned sharer whose only
// eligible slots are reserved or its own pool) would otherwise wait forever.
void polykv_check_schedulable(const task_params & params, int id_slot, const common_params & params_base);

// shared_pool_slot's value check beyond its range: with --pool-slots only reserved slots are sources.
void polykv_check_pool_slot(int32_t id, const common_params & params_base);

// cache_salt: a string of 1..256 characters, else std::invalid_argument.
std::string polykv_json_salt(const json & v);

// /props: "polykv": {"pool_slots": [...], "pool_auto": bool, "pool_auto_min_tokens": N, "share_any": bool,
// "pool_files": {...}} when --pool-slots or --share-any is given ("pool_files": what a pool file must match, polykv_pool_files::identity(), patch 0075).
class polykv_pool_files;
void polykv_add_props(json & props, const common_params & params_base, const polykv_pool_files * files);

// shared-prefix decode attention (0076): turns the CPU backend's path on or off as --shared-decode
// says (found by name in the backend registry); false if it was asked for and is not there
bool polykv_shared_decode_init(const common_params & params_base);

// /props "polykv_shared_decode": whether it is on and the CPU backend's counters
json polykv_shared_decode_state();

// A multi-result OAI response (prompt array, n > 1) merges the results' choices into one object: each choice
// then carries its own result's "shared_prefix" (moved from the result's top level).
void polykv_shared_prefix_per_choice(json & results);

// Decides whether the task may take cells [0, P) from the pool, given n_past after the normal cache
// matching. Exact or refused: only if the pool slot is idle, holds cells [0, P) (with SWA: the window the task's
// first evaluated token needs, else "swa_window") and its cached tokens [0, P) are the task's first P tokens.
// Changes nothing; logs a refusal ("polykv: ...").
polykv_share_decision polykv_share_decide(const polykv_share_input & in, int n_past);

// Puts the pool's cells [0, n) into the slot's sequence (with unified KV by adding the sequence id to
// them, no data copied: "hit"; with one stream per slot by copying the whole pool stream, since a partial
// cross-stream copy aborts, and trimming it: "copied") and checks the sequence now holds exactly [0, n).
// Returns the status, or nullptr if the check failed (logged; the slot's sequence is then removed).
const char * polykv_share_kv(const polykv_share_input & in, int32_t n, const common_memory & mem, bool kv_unified);

// Counts one outcome in the polykv counters of server_metrics.
void polykv_share_record(server_metrics & metrics, const server_shared_prefix_outcome & out);

// The three above, for one task when its prompt starts: reads the pool's positions, decides, shares,
// mirrors the token bookkeeping in the slot's prompt, records. On a share n_past becomes P and n_shared
// (polykv_slot::n_shared, cells that must not be shifted) is P with unified KV, else 0;
// *pool_n_shared is raised to P on a hit. On a refusal only the metrics change.
server_shared_prefix_outcome polykv_share_run(polykv_share_input in, bool kv_unified, const common_memory & mem,
                                              server_prompt & prompt, int32_t & n_shared, int32_t * pool_n_shared,
                                              int & n_past, server_metrics & metrics);

// The outcome to report when an opted-in task sends its final response: the slot's outcome, or
// "skipped" (and recorded) if the task ended before its prompt was processed (e.g. empty prompt).
server_shared_prefix_outcome polykv_share_final(const server_shared_prefix_outcome & slot_outcome, const task_params & params,
                                                server_metrics & metrics);

// res (the final response's JSON) with "shared_prefix" at its top level (in a stream: in its last chunk)
// if the request opted in and the response format has a free schema; otherwise res unchanged.
json polykv_add_shared_prefix(json res, const server_task_result_cmpl_final & result);

// A request field that must be an integer in [min, max]: anything else (a float, a string, a boolean, a value
// out of range) throws std::invalid_argument, which the schema reports as a 400 naming the field.
// (field_num's own conversion would truncate 1.5 and wrap values beyond INT32.)
int32_t polykv_json_int32(const json & v, int64_t min, int64_t max);

// The polykv counters in Prometheus text format, as server_task_result_metrics::to_metrics() writes its own.
void polykv_write_metrics(const server_metrics & metrics, std::ostream & prometheus);
