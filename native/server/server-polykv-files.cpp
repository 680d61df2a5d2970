// polykv pool files: see server-polykv-files.h

#include "server-polykv-files.h"

#include "server-polykv.h" // polykv_cells_origin, polykv_json_salt

#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

#ifdef _WIN32
#include <process.h>
#define polykv_getpid _getpid
#else
#include <unistd.h>
#define polykv_getpid getpid
#endif

namespace {

constexpr char     POLYKV_MAGIC[8]       = { 'P', 'K', 'V', 'P', 'F', 'X', '\0', '\1' };
constexpr int      POLYKV_FORMAT         = 2;
constexpr uint32_t POLYKV_MAX_HEADER     = 256u << 20; // a header holds the token list as JSON: 256 MiB is ~20M tokens

// ---- sha256 (FIPS 180-4), small and portable: used for the model file, token lists and states ----------------

struct sha256_ctx {
    std::array<uint32_t, 8> h = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    uint8_t  buf[64] = {};
    size_t   n_buf   = 0;
    uint64_t n_total = 0;

    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    void block(const uint8_t * p) {
        static const uint32_t k[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
        };
        uint32_t w[64];
        for (int i = 0; i < 16; ++i) {
            w[i] = (uint32_t) p[4*i] << 24 | (uint32_t) p[4*i + 1] << 16 | (uint32_t) p[4*i + 2] << 8 | p[4*i + 3];
        }
        for (int i = 16; i < 64; ++i) {
            const uint32_t s0 = rotr(w[i-15], 7) ^ rotr(w[i-15], 18) ^ (w[i-15] >> 3);
            const uint32_t s1 = rotr(w[i-2], 17) ^ rotr(w[i-2], 19) ^ (w[i-2] >> 10);
            w[i] = w[i-16] + s0 + w[i-7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; ++i) {
            const uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
            const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
    }

    void update(const void * data, size_t n) {
        const auto * p = static_cast<const uint8_t *>(data);
        n_total += n;
        if (n_buf > 0) {
            const size_t take = std::min(n, sizeof(buf) - n_buf);
            memcpy(buf + n_buf, p, take);
            n_buf += take; p += take; n -= take;
            if (n_buf < sizeof(buf)) {
                return;
            }
            block(buf);
            n_buf = 0;
        }
        for (; n >= 64; p += 64, n -= 64) {
            block(p);
        }
        memcpy(buf, p, n);
        n_buf = n;
    }

    std::string hex() {
        const uint64_t bits = n_total * 8;
        const uint8_t  pad  = 0x80;
        const uint8_t  zero = 0;
        update(&pad, 1);
        while (n_buf != 56) {
            update(&zero, 1);
        }
        uint8_t len[8];
        for (int i = 0; i < 8; ++i) {
            len[i] = (uint8_t) (bits >> (56 - 8*i));
        }
        update(len, 8);
        static const char * digits = "0123456789abcdef";
        std::string out;
        for (uint32_t v : h) {
            for (int s = 28; s >= 0; s -= 4) {
                out += digits[(v >> s) & 0xf];
            }
        }
        return out;
    }
};

// CRC-32 (the zlib / IEEE polynomial, as Python's zlib.crc32), slice-by-8: the state's checksum. A state is tens of
// MB, and sha256 in portable C++ would take longer than the restore itself; a CRC catches truncation and damage
// (nothing here is keyed, so no hash would stop a forger who can write the save directory anyway).
struct crc32_tables {
    uint32_t t[8][256];
    crc32_tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) {
                c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i) {
            for (int k = 1; k < 8; ++k) {
                t[k][i] = (t[k-1][i] >> 8) ^ t[0][t[k-1][i] & 0xff];
            }
        }
    }
};

uint32_t crc32(const void * data, size_t n) {
    static const crc32_tables tab;
    const auto * p = static_cast<const uint8_t *>(data);
    uint32_t     c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) {
        const uint32_t lo = c ^ ((uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24);
        const uint32_t hi = (uint32_t) p[4] | (uint32_t) p[5] << 8 | (uint32_t) p[6] << 16 | (uint32_t) p[7] << 24;
        c = tab.t[7][lo & 0xff] ^ tab.t[6][(lo >> 8) & 0xff] ^ tab.t[5][(lo >> 16) & 0xff] ^ tab.t[4][lo >> 24] ^
            tab.t[3][hi & 0xff] ^ tab.t[2][(hi >> 8) & 0xff] ^ tab.t[1][(hi >> 16) & 0xff] ^ tab.t[0][hi >> 24];
    }
    for (; n > 0; ++p, --n) {
        c = tab.t[0][(c ^ *p) & 0xff] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

std::string sha256_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return "";
    }
    sha256_ctx        h;
    std::vector<char> buf(1 << 22);
    while (f) {
        f.read(buf.data(), (std::streamsize) buf.size());
        h.update(buf.data(), (size_t) f.gcount());
    }
    return f.bad() ? "" : h.hex();
}

std::string tokens_sha256(const llama_tokens & tokens) {
    // little-endian int32, as polykv_py.llama.state.tokens_sha256 packs them ("<i")
    std::vector<uint8_t> raw(tokens.size() * 4);
    for (size_t i = 0; i < tokens.size(); ++i) {
        const uint32_t v = (uint32_t) tokens[i];
        raw[4*i] = (uint8_t) v; raw[4*i + 1] = (uint8_t) (v >> 8); raw[4*i + 2] = (uint8_t) (v >> 16); raw[4*i + 3] = (uint8_t) (v >> 24);
    }
    return polykv_sha256_hex(raw.data(), raw.size());
}

std::string salt_sha256(const std::string & salt) {
    return salt.empty() ? "" : polykv_sha256_hex(salt.data(), salt.size());
}

json opt_hex(const std::string & s) {
    return s.empty() ? json(nullptr) : json(s);
}

std::string json_str(const json & j, const char * key) {
    return j.contains(key) && j.at(key).is_string() ? j.at(key).get<std::string>() : std::string();
}

// the same keys with the same values, in any order (this json keeps the order of its keys, and compares it)
bool same_fields(const json & a, const json & b) {
    if (!a.is_object() || !b.is_object() || a.size() != b.size()) {
        return false;
    }
    for (const auto & [k, v] : a.items()) {
        if (!b.contains(k) || b.at(k) != v) {
            return false;
        }
    }
    return true;
}

// "a, b" for the keys whose values differ
std::string differing_keys(const json & mine, const json & theirs) {
    std::string out;
    for (const auto & [k, v] : mine.items()) {
        if (!theirs.is_object() || !theirs.contains(k) || theirs.at(k) != v) {
            out += (out.empty() ? "" : ", ") + k;
        }
    }
    if (out.empty() && theirs.is_object()) {
        for (const auto & [k, v] : theirs.items()) {
            out += mine.contains(k) ? "" : (out.empty() ? "" : ", ") + k + " (unknown here)";
        }
    }
    return out.empty() ? "its fields" : out;
}

} // namespace

std::string polykv_sha256_hex(const void * data, size_t n) {
    sha256_ctx h;
    h.update(data, n);
    return h.hex();
}

void polykv_pool_files::init(const common_params & params, const llama_model * model, llama_context * ctx) {
    if (params.pool_slots.empty() || model == nullptr || ctx == nullptr) {
        return;
    }
    model_ = model;

    char desc[256] = {};
    llama_model_desc(model, desc, sizeof(desc));
    n_vocab_ = llama_vocab_n_tokens(llama_model_get_vocab(model));

    // the same keys, in the same types, as polykv_py.llama.model.Model.fingerprint()
    model_json_ = {
        { "description", desc },
        { "n_params",    llama_model_n_params(model) },
        { "n_vocab",     n_vocab_ },
        { "n_layer",     llama_model_n_layer(model) },
        { "n_embd",      llama_model_n_embd(model) },
    };
    kv_json_ = {
        { "n_stream", params.kv_unified ? 1 : (int) llama_n_seq_max(ctx) },
        { "type_k",   ggml_type_name(params.cache_type_k) },
        { "type_v",   ggml_type_name(params.cache_type_v) },
    };

    const std::string path = params.model.path;
    model_sha256_ = std::async(std::launch::async, [path]() {
        const int64_t     t0  = ggml_time_us();
        const std::string sha = sha256_file(path);
        if (sha.empty()) {
            SRV_WRN("poly-kv-pool: cannot read %s to fingerprint the model: pool files will be refused\n", path.c_str());
        } else {
            SRV_INF("poly-kv-pool: model sha256 %s (%.0f ms)\n", sha.c_str(), (ggml_time_us() - t0) / 1000.0);
        }
        return sha;
    }).share();
}

json polykv_pool_files::identity() const {
    if (!enabled()) {
        return nullptr;
    }
    json model = model_json_;
    model["sha256"] = opt_hex(model_sha256_.get());
    return {
        { "format", POLYKV_FORMAT },
        { "model",  model },
        { "kv",     kv_json_ },
    };
}

json polykv_pool_files::save(llama_context * ctx, llama_seq_id seq_id, const llama_tokens & tokens,
                             const polykv_cells_origin & origin, const std::string & path) const {
    if (!enabled()) {
        throw std::runtime_error("pool files need --pool-slots");
    }
    if (tokens.empty()) {
        throw std::runtime_error("the pool holds no tokens (prime it first)");
    }
    if (!origin.salt_ok || !origin.lora_ok) {
        throw std::runtime_error("the pool's cells were computed under mixed cache_salt values or LoRA sets");
    }
    for (const auto & la : origin.lora) {
        if (la.scale != 0.0f) {
            throw std::runtime_error("the pool was computed with a LoRA adapter applied (" + la.path + "); pool files hold KV computed without LoRA");
        }
    }
    const json identity = this->identity();
    if (identity["model"]["sha256"].is_null()) {
        throw std::runtime_error("the model file could not be read to fingerprint it");
    }

    auto *          mem = llama_get_memory(ctx);
    const llama_pos p0  = llama_memory_seq_pos_min(mem, seq_id);
    const llama_pos p1  = llama_memory_seq_pos_max(mem, seq_id);
    if (p0 != 0 || p1 != (llama_pos) tokens.size() - 1) {
        throw std::runtime_error(string_format("the pool's KV holds positions [%d, %d], not its %zu tokens", p0, p1, tokens.size()));
    }

    std::vector<char> state(llama_state_seq_get_size(ctx, seq_id));
    const size_t n_state = state.empty() ? 0 : llama_state_seq_get_data(ctx, (uint8_t *) state.data(), state.size(), seq_id);
    if (n_state == 0) {
        throw std::runtime_error("llama_state_seq_get_data returned nothing");
    }
    state.resize(n_state);

    json header = identity;
    header["n_tokens"]      = tokens.size();
    header["tokens_sha256"] = tokens_sha256(tokens);
    header["tokens"]        = tokens;
    header["salt_sha256"]   = opt_hex(salt_sha256(origin.salt));
    header["state_bytes"]   = state.size();
    header["state_crc32"]   = crc32(state.data(), state.size());
    header["created_by"]    = "llama-server (polykv)";
    const std::string head  = header.dump();

    // write "<path>.part.<pid>", flush it to disk, rename it over path: a reader sees the old file or the whole new one
    const std::string tmp = path + ".part." + std::to_string((long long) polykv_getpid());
    {
        FILE * f = fopen(tmp.c_str(), "wb");
        if (f == nullptr) {
            throw std::runtime_error("cannot write " + tmp + ": " + strerror(errno));
        }
        const uint32_t n_head = (uint32_t) head.size();
        const uint8_t  len[4] = { (uint8_t) n_head, (uint8_t) (n_head >> 8), (uint8_t) (n_head >> 16), (uint8_t) (n_head >> 24) };
        bool ok = fwrite(POLYKV_MAGIC, 1, sizeof(POLYKV_MAGIC), f) == sizeof(POLYKV_MAGIC)
               && fwrite(len, 1, 4, f) == 4
               && fwrite(head.data(), 1, head.size(), f) == head.size()
               && fwrite(state.data(), 1, state.size(), f) == state.size()
               && fflush(f) == 0;
#ifndef _WIN32
        ok = ok && fsync(fileno(f)) == 0;
#endif
        ok = (fclose(f) == 0) && ok;
        if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
            const std::string err = strerror(errno);
            std::remove(tmp.c_str());
            throw std::runtime_error("cannot write " + path + ": " + err);
        }
    }

    return {
        { "format",        POLYKV_FORMAT },
        { "n_tokens",      tokens.size() },
        { "tokens_sha256", header["tokens_sha256"] },
        { "salt_sha256",   header["salt_sha256"] },
        { "state_bytes",   state.size() },
        { "file_bytes",    sizeof(POLYKV_MAGIC) + 4 + head.size() + state.size() },
    };
}

polykv_pool_file polykv_pool_files::read(const std::string & path, const json & expect, uint32_t n_ctx_slot) const {
    if (!enabled()) {
        throw std::runtime_error("pool files need --pool-slots");
    }
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) {
        throw std::runtime_error("no such file");
    }
    polykv_pool_file out;
    out.n_bytes = (size_t) f.tellg();
    f.seekg(0);

    char    magic[sizeof(POLYKV_MAGIC)] = {};
    uint8_t len[4]                      = {};
    if (!f.read(magic, sizeof(magic)) || memcmp(magic, POLYKV_MAGIC, sizeof(magic)) != 0 || !f.read((char *) len, 4)) {
        throw std::runtime_error("not a polykv pool file (bad magic)");
    }
    const uint32_t n_head = (uint32_t) len[0] | (uint32_t) len[1] << 8 | (uint32_t) len[2] << 16 | (uint32_t) len[3] << 24;
    if (n_head > POLYKV_MAX_HEADER || n_head > out.n_bytes - sizeof(magic) - 4) {
        throw std::runtime_error("damaged file (header length beyond the file)");
    }
    std::string head(n_head, '\0');
    f.read(head.data(), n_head);
    json header;
    try {
        header = json::parse(head);
    } catch (const std::exception &) {
        throw std::runtime_error("damaged file (the header is not JSON)");
    }
    if (!header.is_object() || !header.contains("format") || header["format"] != POLYKV_FORMAT) {
        throw std::runtime_error(string_format("unsupported file format %s (this server reads format %d)",
            header.is_object() && header.contains("format") ? header["format"].dump().c_str() : "?", POLYKV_FORMAT));
    }

    // the model, then the KV layout
    const json mine = identity();
    if (mine["model"]["sha256"].is_null()) {
        throw std::runtime_error("the model file could not be read to fingerprint it");
    }
    if (!header.contains("model") || !same_fields(header["model"], mine["model"])) {
        throw std::runtime_error("saved from another model (differs in " + differing_keys(mine["model"], header.value("model", json())) + ")");
    }
    if (!header.contains("kv") || !same_fields(header["kv"], mine["kv"])) {
        throw std::runtime_error("saved with another KV layout (differs in " + differing_keys(mine["kv"], header.value("kv", json())) +
                                 "; here: " + mine["kv"].dump() + ", in the file: " + header.value("kv", json()).dump() + ")");
    }

    // the tokens: well-formed, in the vocabulary, what the caller expects
    const json & jt = header.value("tokens", json());
    if (!jt.is_array() || !header.contains("n_tokens") || header["n_tokens"] != jt.size()) {
        throw std::runtime_error("damaged file (token list)");
    }
    out.tokens.reserve(jt.size());
    for (const auto & t : jt) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= n_vocab_) {
            throw std::runtime_error(string_format("token %s is not in this model's vocabulary (%d tokens)", t.dump().c_str(), n_vocab_));
        }
        out.tokens.push_back(t.get<llama_token>());
    }
    out.tokens_sha256 = tokens_sha256(out.tokens);
    if (out.tokens.empty() || json_str(header, "tokens_sha256") != out.tokens_sha256) {
        throw std::runtime_error("damaged file (token list does not match its sha256)");
    }
    if (expect.contains("tokens")) {
        const auto exp = expect["tokens"].get<llama_tokens>();
        if (exp != out.tokens) {
            size_t i = 0;
            while (i < exp.size() && i < out.tokens.size() && exp[i] == out.tokens[i]) {
                ++i;
            }
            throw std::runtime_error(string_format("the file holds other tokens than expected (%zu tokens, expected %zu; first difference at %zu)",
                                                   out.tokens.size(), exp.size(), i));
        }
    }
    if (expect.contains("tokens_sha256") && expect["tokens_sha256"].get<std::string>() != out.tokens_sha256) {
        throw std::runtime_error("the file holds other tokens than expected (tokens_sha256 " + out.tokens_sha256 + ")");
    }
    if (out.tokens.size() > n_ctx_slot) {
        throw std::runtime_error(string_format("the file holds %zu tokens, the slot's context is %u", out.tokens.size(), n_ctx_slot));
    }

    // the salt: a salted pool is restored only by a caller who knows its salt
    out.salt_sha256 = json_str(header, "salt_sha256");
    const std::string want = salt_sha256(expect.value("cache_salt", std::string()));
    if (out.salt_sha256 != want) {
        throw std::runtime_error(out.salt_sha256.empty() ? "the file holds an unsalted pool, the request gives a cache_salt"
                                 : want.empty()          ? "the file holds a salted pool: give its cache_salt"
                                                         : "the file was saved under another cache_salt");
    }

    // the state: its size and hash (a truncated or damaged file stops here)
    const size_t n_state = out.n_bytes - sizeof(magic) - 4 - n_head;
    if (!header.contains("state_bytes") || header["state_bytes"] != n_state) {
        throw std::runtime_error(string_format("damaged file (%zu state bytes, the header says %s)", n_state, header.value("state_bytes", json()).dump().c_str()));
    }
    out.state.resize(n_state);
    if (!f.read(out.state.data(), (std::streamsize) n_state) || !header.contains("state_crc32") ||
        header["state_crc32"] != crc32(out.state.data(), n_state)) {
        throw std::runtime_error("damaged file (state does not match its crc32)");
    }
    return out;
}

json polykv_pool_files::load(llama_context * ctx, llama_seq_id seq_id, const polykv_pool_file & file) const {
    auto * mem = llama_get_memory(ctx);
    if (llama_memory_seq_pos_max(mem, seq_id) >= 0) {
        throw std::runtime_error("the pool slot's sequence is not empty");
    }
    const size_t n = llama_state_seq_set_data(ctx, (const uint8_t *) file.state.data(), file.state.size(), seq_id);
    const llama_pos p0 = llama_memory_seq_pos_min(mem, seq_id);
    const llama_pos p1 = llama_memory_seq_pos_max(mem, seq_id);
    if (n == 0 || p0 != 0 || p1 != (llama_pos) file.tokens.size() - 1) {
        llama_memory_seq_rm(mem, seq_id, -1, -1);
        throw std::runtime_error(n == 0
            ? string_format("the KV cache has no room for its %zu cells (free cells are held by other slots) or refused its layout", file.tokens.size())
            : string_format("the loaded state holds positions [%d, %d], not [0, %zu)", p0, p1, file.tokens.size()));
    }
    return {
        { "format",        POLYKV_FORMAT },
        { "n_tokens",      file.tokens.size() },
        { "tokens_sha256", file.tokens_sha256 },
        { "salt_sha256",   opt_hex(file.salt_sha256) },
        { "state_bytes",   file.state.size() },
        { "resident",      true },
    };
}

json polykv_slot_action_fields(const json & body) {
    json out = json::object();
    if (!body.is_object()) {
        return out;
    }
    if (body.contains("tokens")) {
        const json & t = body["tokens"];
        if (!t.is_array() || t.empty()) {
            throw std::invalid_argument("\"tokens\" must be a non-empty array of token ids");
        }
        for (const auto & v : t) {
            polykv_json_int32(v, 0, INT32_MAX);
        }
        out["tokens"] = t;
    }
    if (body.contains("tokens_sha256")) {
        const json & s = body["tokens_sha256"];
        if (!s.is_string() || s.get<std::string>().size() != 64 || s.get<std::string>().find_first_not_of("0123456789abcdef") != std::string::npos) {
            throw std::invalid_argument("\"tokens_sha256\" must be 64 lowercase hex digits");
        }
        out["tokens_sha256"] = s;
    }
    if (body.contains("cache_salt") && !body["cache_salt"].is_null()) {
        try {
            out["cache_salt"] = polykv_json_salt(body["cache_salt"]);
        } catch (const std::invalid_argument & e) {
            throw std::invalid_argument(std::string("\"cache_salt\": ") + e.what());
        }
    }
    return out;
}

polykv_cells_origin polykv_restored_origin(const json & expect, const std::vector<common_adapter_lora_info> & adapters) {
    polykv_cells_origin origin;
    origin.salt = expect.value("cache_salt", std::string());
    origin.lora = adapters;
    for (auto & la : origin.lora) {
        la.scale = 0.0f;
    }
    return origin;
}

llama_tokens polykv_resident_tokens(llama_context * ctx, llama_seq_id seq_id, const server_tokens & tokens) {
    auto *          mem = llama_get_memory(ctx);
    const llama_pos p0  = llama_memory_seq_pos_min(mem, seq_id);
    const llama_pos p1  = llama_memory_seq_pos_max(mem, seq_id);
    if (p0 != 0 || p1 < 0 || tokens.has_mtmd || (size_t) p1 >= tokens.size()) {
        return {};
    }
    llama_tokens out = tokens.get_text_tokens();
    out.resize((size_t) p1 + 1);
    return out;
}

json polykv_pool_state_json(llama_context * ctx, llama_seq_id seq_id, const server_tokens & prompt,
                            const polykv_cells_origin & origin, const polykv_pool_stats & stats, int n_sharers) {
    const llama_tokens tokens   = polykv_resident_tokens(ctx, seq_id, prompt);
    const bool         resident = !tokens.empty();
    const int64_t      now      = ggml_time_us();
    return {
        { "n_tokens",        resident ? tokens.size() : 0 },
        { "resident",        resident },
        { "tokens_sha256",   resident ? json(tokens_sha256(tokens)) : json(nullptr) },
        { "salt_sha256",     origin.salt_ok ? opt_hex(salt_sha256(origin.salt)) : json("mixed") },
        { "hits",            stats.hits },
        { "sharers",         n_sharers },
        { "last_use_s_ago",  stats.t_last_use_us > 0 ? json((now - stats.t_last_use_us) / 1e6) : json(nullptr) },
        { "restored_from",   stats.restored_from.empty() ? json(nullptr) : json(stats.restored_from) },
    };
}
