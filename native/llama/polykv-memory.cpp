#include "polykv-memory.h"

#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"

bool polykv_memory_swa_seq_rm(llama_memory_t mem, llama_seq_id seq, llama_pos p1) {
    auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem);
    if (iswa == nullptr || p1 <= 0) {
        return false;
    }
    return iswa->get_swa()->seq_rm(seq, -1, p1);
}
