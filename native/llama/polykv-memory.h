// polykv's additions to libllama's memory (native/polykv.cmake adds them to the llama target): what the public
// llama_memory_* API cannot do. Called by native/server/server-polykv.cpp.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Removes sequence seq's cells at positions [0, p1) from the sliding-window (SWA) cache of an iSWA memory (Gemma
// 2/3, gpt-oss, ...); its full-attention cache keeps them. A share seq_cp's a pool's cells [0, n) into a sequence that
// continues at n: the SWA cells below n's window are masked for every token it will compute, yet, held by two
// sequences, they could never be reused (llama_kv_cache::find_slot reuses a masked cell only if one sequence holds
// it), and a few shares would fill the small SWA cache (about n_swa cells per slot). Returns false, changing
// nothing, for a memory without an SWA cache.
LLAMA_API bool polykv_memory_swa_seq_rm(llama_memory_t mem, llama_seq_id seq, llama_pos p1);

#ifdef __cplusplus
}
#endif
