#pragma once

// polykv pool files (patch 0075): a reserved pool's KV saved to a verified file and restored from it.
//
// The container is the one polykv's in-process engine writes (polykv_py/prefix_file.py), so a prefix saved by
// either can be restored into the other (format 3):
//
//   "PKVPFX\0\1" (8 bytes) | u32 LE header length | UTF-8 JSON header | llama sequence state | HMAC-SHA256 (32 bytes)
//
// The MAC covers everything before it and is keyed with the cache's secret, ".polykv-pool.key" in the pool
// directory (32 random bytes, mode 0600, created on first use by the server or the engine). The directory must
// belong to the server's user and be writable by no one else, the key file too (checked at start and again at every
// save and restore; a key that changed since start is refused); files and keys are opened without following links, a
// new key is written whole and linked into place, and a save creates its "<name>.part.<pid>" with O_EXCL, flushes it
// and renames it over the name.
// The header records the model (sha256 of the GGUF file and its shape), the KV layout (streams, K and V types),
// the settings that change KV (RoPE/YaRN, --override-kv, control vectors), the token list and its sha256, a MAC of
// the pool's cache_salt (keyed like the file: never the salt, nor a hash anyone could test guesses against), and
// the state's size. A restore authenticates the file, then checks the salt (a mismatch is refused with no detail),
// the model, the layout, the settings, the tokens, and that the state holds one cell per position 0..n-1 of one
// sequence, before the pool's KV is touched; only then is the pool cleared and the state loaded (a load that fails
// leaves the pool empty, never half-loaded).

#include "server-common.h" // json, common_params, llama_tokens

#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "server-polykv-provenance.h"

// What an operator sees of a reserved pool in /slots ("polykv_pool_state"), besides its tokens.
struct polykv_pool_stats {
    uint64_t    hits          = 0; // shares (hit or copied) taken from the pool
    int64_t     t_last_use_us = 0; // last share, restore or prompt on the pool (ggml_time_us); 0: never
    std::string restored_from;     // the file of the last restore ("" if primed here or never filled)
    bool        promoted = false;  // holds a prefix --share-any promoted (0077), or a file of one restored as such
    int32_t     n_resident = 0;    // polykv_seq_resident() as of the scheduler's last pass (polykv_pool_snapshot):
                                   // /slots answers from it while a decode runs (reading the KV cache then would race)
};

// A verified pool file, read into memory; nothing in the KV cache has changed yet.
struct polykv_pool_file {
    json              header;
    llama_tokens      tokens;
    std::string       tokens_sha256;
    std::string       salt_mac;       // "" = unsalted
    bool              salted = false;
    std::vector<char> state;
    size_t            n_bytes = 0; // size of the file
};

// The model and KV identity of this server (what a file must match), and the file operations.
class polykv_pool_files {
  public:
    // Starts hashing the model file in the background (when --pool-slots is given; a no-op otherwise).
    void init(const common_params & params, const llama_model * model, llama_context * ctx);

    bool enabled() const { return model_ != nullptr; }

    // {"format": 3, "model": {...}, "kv": {...}, "settings": {...}}: waits for the model hash; "model.sha256" is null
    // if the file could not be read (then every save and restore is refused).
    json identity() const;

    // Writes the sequence seq_id, which holds exactly tokens at positions [0, n), as a pool file (atomic), if the
    // request's cache_salt (in expect) is the pool's, its tokens_sha256 (if given) that of tokens, the cells are
    // exact (none shifted: a restore trusts them as computed from the tokens) and path holds no pool file of another
    // salt. Throws
    // std::runtime_error with the reason (nothing written then). Returns the "polykv" response object.
    json save(llama_context * ctx, llama_seq_id seq_id, const llama_tokens & tokens, const polykv_provenance & prov,
              const json & expect, const std::string & path) const;

    // Reads and verifies a pool file against this server, the request's expectations (the "polykv" object of
    // polykv_slot_action_fields) and the slot's context size. Throws std::runtime_error naming the reason.
    polykv_pool_file read(const std::string & path, const json & expect, uint32_t n_ctx_slot) const;

    // Loads a verified file into seq_id (which must be empty) and checks it holds [0, n). Throws on failure,
    // leaving seq_id empty. Returns the "polykv" response object.
    json load(llama_context * ctx, llama_seq_id seq_id, const polykv_pool_file & file) const;

  private:
    void             require_usable() const;
    polykv_pool_file read_verified(const std::string & path) const; // authenticated; nothing but the MAC checked
    std::string      salt_mac(const std::string & salt) const;      // "" for no salt
    std::string      file_salt_mac(const std::string & path) const; // "" if path holds no authentic pool file

    const llama_model *               model_ = nullptr;
    std::string                       dir_;          // --slot-save-path (checked again, with its key, at every save and restore)
    std::vector<uint8_t>              key_;          // the cache's secret (empty: no --slot-save-path, or refused)
    std::string                       dir_error_;    // why the pool directory or its key is refused ("" if not)
    json                              settings_json_;
    std::shared_future<std::string>   model_sha256_; // "" if the file could not be read
    json                              model_json_;   // the fingerprint without the hash
    json                              kv_json_;      // {"n_stream", "type_k", "type_v"}
    int32_t                           n_vocab_ = 0;
};

// The optional polykv fields of a /slots/N?action=save|restore body, checked when the request arrives
// (std::invalid_argument -> HTTP 400): "tokens" (the token list the file must hold), "tokens_sha256" (on a save:
// the tokens the pool must hold), "cache_salt" (the salt the pool was primed under), "promoted" (restore: the pool
// is marked as a --share-any promoted prefix, which promotion may replace). Returns them as a json object.
json polykv_slot_action_fields(const json & body);

// A restored pool's provenance: computed under the file's salt (the request's, checked against the file's MAC),
// without LoRA (every adapter of this server at scale 0), exact (a save refuses shifted cells).
polykv_provenance polykv_restored_prov(const json & expect, const std::vector<common_adapter_lora_info> & adapters);

// Records how much of the pool sequence is resident in stats (on the main loop, between decodes).
void polykv_pool_snapshot(llama_context * ctx, llama_seq_id seq_id, polykv_pool_stats & stats);

// The tokens whose cells the sequence holds: tokens [0, polykv_seq_resident()), none if it lost its start (or, with
// SWA, the window of its next token).
llama_tokens polykv_resident_tokens(llama_context * ctx, llama_seq_id seq_id, const server_tokens & tokens);

// The "polykv_pool_state" object of a reserved pool's /slots entry, from its last snapshot (safe
// while a decode runs).
json polykv_pool_state_json(const server_tokens & tokens, const polykv_provenance & prov, const polykv_pool_stats & stats,
                            int n_sharers);

// sha256 of a byte string, as 64 lowercase hex digits.
std::string polykv_sha256_hex(const void * data, size_t n);
