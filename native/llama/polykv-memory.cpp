#include "polykv-memory.h"

#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

namespace {

const llama_memory_recurrent * recurrent_part(const llama_memory_i * mem) {
    if (const auto * r = dynamic_cast<const llama_memory_recurrent *>(mem)) {
        return r;
    }
    if (const auto * h = dynamic_cast<const llama_memory_hybrid *>(mem)) { // also llama_memory_hybrid_idx
        return h->get_mem_recr();
    }
    if (const auto * h = dynamic_cast<const llama_memory_hybrid_iswa *>(mem)) {
        return h->get_mem_recr();
    }
    return nullptr;
}

} // namespace

bool polykv_memory_swa_seq_rm(llama_memory_t mem, llama_seq_id seq, llama_pos p1) {
    auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem);
    if (auto * h = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        iswa = h->get_mem_attn();
    }
    if (iswa == nullptr || p1 <= 0) {
        return false;
    }
    return iswa->get_swa()->seq_rm(seq, -1, p1);
}

llama_pos polykv_memory_rs_pos(llama_memory_t mem, llama_seq_id seq) {
    const auto * r = recurrent_part(mem);
    return r != nullptr ? r->seq_pos_max(seq) : POLYKV_MEMORY_NO_PART;
}

llama_pos polykv_memory_attn_pos_min(llama_memory_t mem, llama_seq_id seq) {
    if (mem == nullptr) {
        return POLYKV_MEMORY_NO_PART;
    }
    if (const auto * r = dynamic_cast<const llama_memory_recurrent *>(mem)) {
        return r->seq_pos_max(seq) >= 0 ? 0 : -1;
    }
    if (const auto * h = dynamic_cast<const llama_memory_hybrid *>(mem)) {
        return h->get_mem_attn()->seq_pos_min(seq);
    }
    if (const auto * h = dynamic_cast<const llama_memory_hybrid_iswa *>(mem)) {
        return h->get_mem_attn()->seq_pos_min(seq);
    }
    return mem->seq_pos_min(seq);
}
