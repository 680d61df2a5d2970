// polykv's additions to libllama's memory (native/polykv.cmake adds them to the llama target): what the public
// llama_memory_* API cannot do or tell. Called by native/server/server-polykv.cpp.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// polykv_memory_rs_pos / polykv_memory_attn_pos_min: the memory has no such part
#define POLYKV_MEMORY_NO_PART (-2)

// Removes sequence seq's cells at positions [0, p1) from the sliding-window (SWA) cache of an iSWA memory (Gemma
// 2/3, gpt-oss, ...) or of a hybrid memory's iSWA attention; its full-attention cache keeps them. A share seq_cp's a
// pool's cells [0, n) into a sequence that continues at n: the SWA cells below n's window are masked for every token
// it will compute, yet, held by two sequences, they could never be reused (llama_kv_cache::find_slot reuses a masked
// cell only if one sequence holds it), and a few shares would fill the small SWA cache (about n_swa cells per slot).
// Returns false, changing nothing, for a memory without an SWA cache.
LLAMA_API bool polykv_memory_swa_seq_rm(llama_memory_t mem, llama_seq_id seq, llama_pos p1);

// The position of sequence seq's recurrent state (Mamba, RWKV; the recurrent layers of a hybrid memory: LFM2,
// Jamba, Qwen3.5, ...): the state after the token at that position, the only position it is exact for. -1 if the
// sequence holds no state, POLYKV_MEMORY_NO_PART if the memory has no recurrent part (or there is no memory).
LLAMA_API llama_pos polykv_memory_rs_pos(llama_memory_t mem, llama_seq_id seq);

// The first position of sequence seq's attention cells, as llama_memory_seq_pos_min() reports it for a memory of
// attention layers only (with SWA: that of the sliding-window cache). A hybrid memory's llama_memory_seq_pos_min()
// is the larger of its two parts' (its recurrent state's position); this is its attention part's. For a purely
// recurrent memory no attention cell is needed: 0 if the sequence holds a state, -1 if not.
// POLYKV_MEMORY_NO_PART if there is no memory.
LLAMA_API llama_pos polykv_memory_attn_pos_min(llama_memory_t mem, llama_seq_id seq);

#ifdef __cplusplus
}
#endif
