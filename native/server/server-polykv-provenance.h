#pragma once

// polykv provenance (patch 0078): what computed the KV cells a sequence holds. It lives with the cells'
// description, upstream's server_prompt (server_prompt::polykv), so every path that moves a server_prompt moves
// it too; the paths that put cells into a sequence without one set it here or mark it unknown.
//
// A share hands a sequence's cells [0, n) to another request. It is exact only if each of those cells was computed
// from the sequence's own tokens 0..i at positions 0..i (never moved by a shift, never computed over a moved cell),
// under the requester's cache_salt and LoRA set. Every path upstream (and polykv) puts cells into a sequence by:
//
//   path                                          call site                                  provenance afterwards
//   ---------------------------------------------------------------------------------------------------------------
//   prompt start, own cache [0, n_past) kept      polykv_share_prefix: polykv_prov_start      the task's salt and LoRA set; kept
//                                                                                            cells of another salt/LoRA set:
//                                                                                            recomputed (pools, --share-any) or
//                                                                                            unknown (upstream's reuse); exact
//                                                                                            again once cells >= n_past are gone
//   share from a pool or --share-any source       polykv_share_prefix: polykv_prov_shared     the source's, exact: a share takes
//                                                                                            at most polykv_prov_shareable()
//   --share-any promotion into a reserved pool    promote: polykv_prov_shared                 the source's: a salted prefix stays
//                                                                                            salted in /slots and in saves
//   n_cmpl > 1 children                           copy_state_to: server_prompt::clone         the parent's
//   host prompt cache save / load (--cache-ram)   server_prompt_cache::alloc / load           travels with the cached prompt
//   pool file restore (reserved pool)             polykv_pool_file_action: polykv_restored_prov the file's salt (checked), exact:
//                                                                                            a save refuses inexact cells
//   slot file restore (upstream, other slots)     SLOT_RESTORE: polykv_prov_unknown           unknown: never shared, not reused
//                                                                                            by --share-any's prompt start
//   slot erase, purge, LoRA change clears         server_prompt::clear                        left as is: without cells it says
//                                                                                            nothing, the next path sets it
//   chunk reuse (n_cache_reuse, --cache-reuse)    polykv_prov_shifted(head_p)                 not exact from the first cell moved
//   context shift (--context-shift)               polykv_prov_shifted(n_keep)                 not exact from n_keep
//   context checkpoints (SWA, recurrent)          the sequence's own earlier state            unchanged (shares refused there)
//   speculative decoding                          rejected drafts removed with seq_rm         unchanged (shares refused there)
//   LoRA set per task, /lora-adapters             prompt start records the task's set         as prompt start
//   in-process engine (polykv_py.llama.memory)    Memory.seq_add / seq_cp / seq_rm / load     its own record (Memory.exact_len)
//
// Cells of an unknown or mixed salt or LoRA set, and cells from the first shifted position on, are never shared,
// promoted or saved as a pool.

#include "common.h" // common_adapter_lora_info

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

struct polykv_provenance {
    static constexpr int32_t ALL = std::numeric_limits<int32_t>::max();

    std::string salt;               // the cache_salt that computed the cells ("" = unsalted)
    bool        salt_known = true;  // false: unknown (a slot file) or mixed (upstream reused cells across salts)
    std::vector<common_adapter_lora_info> lora; // the LoRA set (adapters and scales) that computed them
    bool        lora_known = true;  // false: unknown or mixed
    int32_t     n_exact    = ALL;   // cells at positions >= n_exact were moved by a shift or computed over moved cells
};

// Could a task of this salt and LoRA set use cells of this provenance (exactness aside)?
bool polykv_prov_matches(const polykv_provenance & prov, const std::string & salt,
                         const std::vector<common_adapter_lora_info> & lora);

// How many leading cells of a sequence with this provenance a task of this salt and LoRA set may take:
// 0 if it does not match, else the exact length (polykv_provenance::ALL: no limit).
int32_t polykv_prov_shareable(const polykv_provenance & prov, const std::string & salt,
                              const std::vector<common_adapter_lora_info> & lora);

// A task's prompt starts on a slot whose cache matched n_past tokens; the slot keeps cells [0, n_past) and drops the
// rest. With isolate (a reserved pool, or any slot with --share-any: isolation as in vLLM) kept cells of another salt
// or LoRA set are recomputed (n_past = 0), and so are shifted ones unless the task itself asked for chunk reuse
// (n_past capped at n_exact); without it upstream's own reuse is left alone and the cells' origin becomes unknown.
// Then the provenance is the task's.
void polykv_prov_start(polykv_provenance & prov, bool isolate, bool task_reuses_chunks, const std::string & salt,
                       const std::vector<common_adapter_lora_info> & lora, int id_slot, int & n_past);

// dst's sequence now holds cells [0, n) taken from a sequence of provenance src, n <= its shareable length.
void polykv_prov_shared(polykv_provenance & dst, const polykv_provenance & src);

// The cells from position pos on were moved by a shift (seq_add): not exact from there.
void polykv_prov_shifted(polykv_provenance & prov, int32_t pos);

// Cells whose origin nobody recorded (an upstream slot file): never shared.
void polykv_prov_unknown(polykv_provenance & prov);
