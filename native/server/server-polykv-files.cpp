// polykv pool files: see server-polykv-files.h

#include "server-polykv-files.h"

#include "server-polykv.h" // polykv_json_salt

#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include <random>

#ifdef _WIN32
#include <process.h>
#define polykv_getpid _getpid
#else
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define polykv_getpid getpid
#endif

namespace {

constexpr char     POLYKV_MAGIC[8]       = { 'P', 'K', 'V', 'P', 'F', 'X', '\0', '\1' };
constexpr int      POLYKV_FORMAT         = 3;
constexpr uint32_t POLYKV_MAX_HEADER     = 256u << 20; // a header holds the token list as JSON: 256 MiB is ~20M tokens
constexpr size_t   POLYKV_MAC_BYTES      = 32;         // HMAC-SHA256 trailer
constexpr size_t   POLYKV_KEY_BYTES      = 32;
constexpr char     POLYKV_KEY_FILE[]     = ".polykv-pool.key";
// the one refusal a request gets when its cache_salt is not the pool's: nothing about the file or the pool
constexpr char     POLYKV_SALT_REFUSAL[] = "the pool file does not match this request";

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

    std::array<uint8_t, 32> digest() {
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
        std::array<uint8_t, 32> out;
        for (int i = 0; i < 8; ++i) {
            for (int b = 0; b < 4; ++b) {
                out[4*i + b] = (uint8_t) (h[i] >> (24 - 8*b));
            }
        }
        return out;
    }

    std::string hex() {
        static const char * digits = "0123456789abcdef";
        std::string out;
        for (uint8_t v : digest()) {
            out += digits[v >> 4];
            out += digits[v & 0xf];
        }
        return out;
    }
};

// HMAC-SHA256 (RFC 2104) over several pieces: the pool file's authentication with the cache's secret key
struct hmac_sha256 {
    sha256_ctx inner;
    uint8_t    okey[64];

    explicit hmac_sha256(const std::vector<uint8_t> & key) {
        uint8_t k[64] = {};
        if (key.size() > 64) {
            sha256_ctx h;
            h.update(key.data(), key.size());
            const auto d = h.digest();
            memcpy(k, d.data(), d.size());
        } else if (!key.empty()) {
            memcpy(k, key.data(), key.size());
        }
        uint8_t ikey[64];
        for (int i = 0; i < 64; ++i) {
            ikey[i] = k[i] ^ 0x36;
            okey[i] = k[i] ^ 0x5c;
        }
        inner.update(ikey, sizeof(ikey));
    }

    void update(const void * data, size_t n) { inner.update(data, n); }

    std::array<uint8_t, 32> digest() {
        const auto d = inner.digest();
        sha256_ctx outer;
        outer.update(okey, sizeof(okey));
        outer.update(d.data(), d.size());
        return outer.digest();
    }
};

std::string to_hex(const uint8_t * p, size_t n) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (size_t i = 0; i < n; ++i) {
        out += digits[p[i] >> 4];
        out += digits[p[i] & 0xf];
    }
    return out;
}

// compares in time that does not depend on where the bytes differ
bool same_bytes(const uint8_t * a, const uint8_t * b, size_t n) {
    uint8_t d = 0;
    for (size_t i = 0; i < n; ++i) {
        d |= a[i] ^ b[i];
    }
    return d == 0;
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

// little-endian int32, as polykv_py.prefix_file.tokens_sha256 packs them ("<i")
std::vector<uint8_t> tokens_le32(const llama_tokens & tokens) {
    std::vector<uint8_t> raw(tokens.size() * 4);
    for (size_t i = 0; i < tokens.size(); ++i) {
        const uint32_t v = (uint32_t) tokens[i];
        raw[4*i] = (uint8_t) v; raw[4*i + 1] = (uint8_t) (v >> 8); raw[4*i + 2] = (uint8_t) (v >> 16); raw[4*i + 3] = (uint8_t) (v >> 24);
    }
    return raw;
}

std::string tokens_sha256(const llama_tokens & tokens) {
    const auto raw = tokens_le32(tokens);
    return polykv_sha256_hex(raw.data(), raw.size());
}

// what /slots shows of a salted pool's tokens: HMAC-SHA256 keyed with the salt (only a holder of the salt can
// check a guess; polykv_py.pools.tokens_mac computes the same)
std::string tokens_mac(const llama_tokens & tokens, const std::string & salt) {
    hmac_sha256 h(std::vector<uint8_t>(salt.begin(), salt.end()));
    const auto  raw = tokens_le32(tokens);
    h.update(raw.data(), raw.size());
    const auto d = h.digest();
    return to_hex(d.data(), d.size());
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

namespace {

#ifndef _WIN32
// a regular file opened without following a symbolic link, or -1 with errno set (ELOOP: it is a link)
int open_regular(const std::string & path, struct stat & st) {
    const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        errno = EINVAL;
        return -1;
    }
    return fd;
}

bool read_all(int fd, void * buf, size_t n) {
    auto * p = static_cast<char *>(buf);
    while (n > 0) {
        const ssize_t r = ::read(fd, p, n);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) {
                continue;
            }
            return false;
        }
        p += r;
        n -= (size_t) r;
    }
    return true;
}

bool write_all(int fd, const void * buf, size_t n) {
    const auto * p = static_cast<const char *>(buf);
    while (n > 0) {
        const ssize_t w = ::write(fd, p, n);
        if (w <= 0) {
            if (w < 0 && errno == EINTR) {
                continue;
            }
            return false;
        }
        p += w;
        n -= (size_t) w;
    }
    return true;
}
#endif

// The cache directory must be this user's and writable by no one else: anyone who can write it can replace files
std::string check_dir(const std::string & dir) {
#ifdef _WIN32
    GGML_UNUSED(dir);
    return "";
#else
    // without its trailing slashes: lstat("link/") follows the link
    std::string path = dir;
    while (path.size() > 1 && path.back() == '/') {
        path.pop_back();
    }
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) {
        return "cannot stat the pool directory " + dir + ": " + strerror(errno);
    }
    if (!S_ISDIR(st.st_mode)) {
        return "the pool directory " + dir + " is not a directory (a symbolic link is refused)";
    }
    if (st.st_uid != geteuid()) {
        return string_format("the pool directory %s belongs to uid %u, not to this server's user (uid %u)", dir.c_str(),
                             (unsigned) st.st_uid, (unsigned) geteuid());
    }
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
        return string_format("the pool directory %s is writable by its group or by others (mode %03o): chmod go-w it",
                             dir.c_str(), (unsigned) (st.st_mode & 0777));
    }
    return "";
#endif
}

// The cache's secret (POLYKV_KEY_FILE in the directory): read it, or create it (0600) if there is none and create.
// polykv_py.prefix_file reads and creates the same file, so the engine and the server authenticate each other's files.
std::vector<uint8_t> load_or_create_key(const std::string & dir, std::string & error, bool create = true) {
    std::vector<uint8_t> key(POLYKV_KEY_BYTES);
#ifdef _WIN32
    GGML_UNUSED(dir);
    error = "pool files need a POSIX system (the key file's owner and mode are checked)";
    return {};
#else
    const std::string path = dir + POLYKV_KEY_FILE;
    for (int attempt = 0; attempt < 2; ++attempt) {
        struct stat st;
        const int   fd = open_regular(path, st);
        if (fd >= 0) {
            const bool ok = st.st_uid == geteuid() && (st.st_mode & 077) == 0 && (size_t) st.st_size == POLYKV_KEY_BYTES &&
                            read_all(fd, key.data(), key.size());
            close(fd);
            if (!ok) {
                error = "the pool key " + path + " must be a " + std::to_string(POLYKV_KEY_BYTES) +
                        "-byte file of this server's user with mode 0600";
                return {};
            }
            return key;
        }
        if (errno != ENOENT || !create) {
            error = "cannot read the pool key " + path + ": " + strerror(errno);
            return {};
        }
        std::random_device rd;
        for (auto & b : key) {
            b = (uint8_t) rd();
        }
        // written whole to a file of its own, then linked into place: link() fails if the key exists, so a reader
        // never sees a key half written, and two processes creating it at once agree on one
        const std::string tmp = path + ".new." + std::to_string((long long) polykv_getpid()) + "." + std::to_string(rd());
        const int wfd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (wfd < 0) {
            error = "cannot create the pool key " + tmp + ": " + strerror(errno);
            return {};
        }
        const bool ok = write_all(wfd, key.data(), key.size()) && fsync(wfd) == 0;
        close(wfd);
        const int linked = ok ? link(tmp.c_str(), path.c_str()) : -1;
        const int link_errno = errno;
        unlink(tmp.c_str());
        if (!ok) {
            error = "cannot write the pool key " + tmp;
            return {};
        }
        if (linked != 0) {
            if (link_errno == EEXIST) {
                continue; // another process created it first: read theirs
            }
            error = "cannot create the pool key " + path + ": " + strerror(link_errno);
            return {};
        }
        SRV_INF("polykv: created the pool key %s\n", path.c_str());
        return key;
    }
    error = "cannot create the pool key " + path;
    return {};
#endif
}

// Settings that change what the KV of the same tokens holds, beyond the model file and the KV types: a file saved
// under others is another pool. Only values set on the command line appear (the defaults give {}), so the engine,
// which has none of them, writes {} too.
json kv_settings(const common_params & params) {
    json s = json::object();
    if (params.rope_freq_base != 0.0f)  { s["rope_freq_base"]  = params.rope_freq_base; }
    if (params.rope_freq_scale != 0.0f) { s["rope_freq_scale"] = params.rope_freq_scale; }
    if (params.rope_scaling_type != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED) { s["rope_scaling_type"] = (int) params.rope_scaling_type; }
    if (params.yarn_ext_factor != -1.0f)  { s["yarn_ext_factor"]  = params.yarn_ext_factor; }
    if (params.yarn_attn_factor != -1.0f) { s["yarn_attn_factor"] = params.yarn_attn_factor; }
    if (params.yarn_beta_fast != -1.0f)   { s["yarn_beta_fast"]   = params.yarn_beta_fast; }
    if (params.yarn_beta_slow != -1.0f)   { s["yarn_beta_slow"]   = params.yarn_beta_slow; }
    if (params.yarn_orig_ctx != 0)        { s["yarn_orig_ctx"]    = params.yarn_orig_ctx; }
    json overrides = json::array();
    for (const auto & o : params.kv_overrides) {
        if (o.key[0] == '\0') {
            continue; // the list's terminator
        }
        json v;
        switch (o.tag) {
            case LLAMA_KV_OVERRIDE_TYPE_INT:   v = o.val_i64; break;
            case LLAMA_KV_OVERRIDE_TYPE_FLOAT: v = o.val_f64; break;
            case LLAMA_KV_OVERRIDE_TYPE_BOOL:  v = o.val_bool; break;
            case LLAMA_KV_OVERRIDE_TYPE_STR:   v = std::string(o.val_str, strnlen(o.val_str, sizeof(o.val_str))); break;
        }
        overrides.push_back(json::array({ json(std::string(o.key, strnlen(o.key, sizeof(o.key)))), v }));
    }
    if (!overrides.empty()) {
        s["override_kv"] = overrides;
    }
    json cvecs = json::array();
    for (const auto & cv : params.control_vectors) {
        cvecs.push_back({ { "file", cv.fname }, { "sha256", sha256_file(cv.fname) }, { "strength", cv.strength } });
    }
    if (!cvecs.empty()) {
        s["control_vectors"] = { { "vectors", cvecs }, { "layer_start", params.control_vector_layer_start },
                                 { "layer_end", params.control_vector_layer_end } };
    }
    return s;
}

// The state's cells, before anything is loaded: one stream of this layout holds exactly one cell per position
// 0..n-1, in order, each of one sequence (llama_context::state_seq_get_data: u32 magic, i32 seq_id, then
// llama_kv_cache::state_write for a single sequence: u32 n_stream, then per stream u32 cell_count and per cell
// i32 pos, u32 n_seq_id, [12-byte ext], i32 seq_id, then the stream's data).
// Only the first non-empty stream can be walked (its data's size is not in the stream), so a state with cells in
// two streams is refused. A purely recurrent memory (llama_memory_recurrent::state_write: u32 cell_count, then per
// cell i32 pos, u32 n_seq_id) holds one state, after position n-1; a hybrid one writes its attention cells first
// (walked here) and its state after their data (checked once loaded: polykv_seq_resident).
std::string check_state_cells(const std::vector<char> & state, size_t n_tokens, int n_stream_here, bool recurrent) {
    const auto * p   = reinterpret_cast<const uint8_t *>(state.data());
    const size_t n   = state.size();
    auto         u32 = [&](size_t off) {
        return (uint32_t) p[off] | (uint32_t) p[off + 1] << 8 | (uint32_t) p[off + 2] << 16 | (uint32_t) p[off + 3] << 24;
    };
    if (n < 12) {
        return "the state is too short";
    }
    if (u32(0) != 0xAF143CD8u) { // llama_context's io_magic
        return "the state does not start with llama's state magic";
    }
    if (recurrent) {
        if (n < 20 || u32(8) != 1 || u32(16) != 0) {
            return "the state is not one recurrent state of one sequence";
        }
        if ((int32_t) u32(12) != (int32_t) n_tokens - 1) {
            return string_format("the recurrent state follows position %d, not %zu", (int32_t) u32(12), n_tokens - 1);
        }
        return "";
    }
    const uint32_t n_stream = u32(8);
    if ((int) n_stream != n_stream_here) {
        return string_format("the state has %u KV streams, this server %d", n_stream, n_stream_here);
    }
    size_t off = 12;
    for (uint32_t s = 0; s < n_stream; ++s) {
        if (off + 4 > n) {
            return "the state is too short";
        }
        const uint32_t cell_count = u32(off);
        off += 4;
        if (cell_count == 0) {
            continue;
        }
        if (cell_count != n_tokens) {
            return string_format("the state holds %u cells for %zu tokens", cell_count, n_tokens);
        }
        for (size_t stride : { (size_t) 12, (size_t) 24 }) { // without and with the cell ext (M-RoPE, PLE)
            if (off + stride * cell_count > n) {
                continue;
            }
            bool ok = true;
            for (uint32_t i = 0; i < cell_count && ok; ++i) {
                const size_t c = off + stride * i;
                ok = u32(c) == i && u32(c + 4) == 1;
            }
            if (ok) {
                return "";
            }
        }
        return "the state's cells are not one cell per position 0..n-1 of one sequence";
    }
    return "the state holds no cells";
}

} // namespace

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
    settings_json_ = kv_settings(params);

    if (!params.slot_save_path.empty()) {
        dir_ = params.slot_save_path;
        dir_error_ = check_dir(params.slot_save_path);
        if (dir_error_.empty()) {
            key_ = load_or_create_key(params.slot_save_path, dir_error_);
        }
        if (!dir_error_.empty()) {
            SRV_WRN("polykv: pool files are refused: %s\n", dir_error_.c_str());
        }
    }

    const std::string path = params.model.path;
    model_sha256_ = std::async(std::launch::async, [path]() {
        const int64_t     t0  = ggml_time_us();
        const std::string sha = sha256_file(path);
        if (sha.empty()) {
            SRV_WRN("polykv: cannot read %s to fingerprint the model: pool files will be refused\n", path.c_str());
        } else {
            SRV_INF("polykv: model sha256 %s (%.0f ms)\n", sha.c_str(), (ggml_time_us() - t0) / 1000.0);
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
        { "format",   POLYKV_FORMAT },
        { "model",    model },
        { "kv",       kv_json_ },
        { "settings", settings_json_ },
    };
}

void polykv_pool_files::require_usable() const {
    if (!enabled()) {
        throw std::runtime_error("pool files need --pool-slots");
    }
    if (!dir_error_.empty()) {
        throw std::runtime_error(dir_error_);
    }
    if (key_.size() != POLYKV_KEY_BYTES) {
        throw std::runtime_error("pool files need --slot-save-path");
    }
    // again at every save and restore: the directory or its key may have changed since the server started
    const std::string dir_now = check_dir(dir_);
    if (!dir_now.empty()) {
        throw std::runtime_error(dir_now);
    }
    std::string key_error;
    if (load_or_create_key(dir_, key_error, /* create */ false) != key_) {
        throw std::runtime_error(key_error.empty() ? "the pool key " + dir_ + POLYKV_KEY_FILE + " changed since the server started"
                                                   : key_error);
    }
}

std::string polykv_pool_files::salt_mac(const std::string & salt) const {
    if (salt.empty()) {
        return "";
    }
    hmac_sha256 h(key_);
    h.update("polykv-salt", 12); // with its NUL: a domain of its own
    h.update(salt.data(), salt.size());
    const auto d = h.digest();
    return to_hex(d.data(), d.size());
}

std::string polykv_pool_files::file_salt_mac(const std::string & path) const {
#ifdef _WIN32
    GGML_UNUSED(path);
    return "";
#else
    try {
        const polykv_pool_file f = read_verified(path);
        return f.salt_mac;
    } catch (const std::exception &) {
        return "";
    }
#endif
}

json polykv_pool_files::save(llama_context * ctx, llama_seq_id seq_id, const llama_tokens & tokens, const polykv_provenance & prov,
                             const json & expect, const std::string & path) const {
    require_usable();
    // the salt first, and with no detail: a caller without the pool's salt learns nothing and overwrites nothing
    if (!prov.salt_known || prov.salt != expect.value("cache_salt", std::string())) {
        throw std::runtime_error(POLYKV_SALT_REFUSAL);
    }
    const std::string my_salt_mac = salt_mac(prov.salt);
    {
        // an existing pool file of another salt is not ours to replace
        const std::string theirs = file_salt_mac(path);
        if (!theirs.empty() && theirs != my_salt_mac) {
            throw std::runtime_error(POLYKV_SALT_REFUSAL);
        }
    }
    if (tokens.empty()) {
        throw std::runtime_error("the pool holds no tokens (prime it first)");
    }
    if (expect.contains("tokens_sha256") && expect["tokens_sha256"].get<std::string>() != tokens_sha256(tokens)) {
        throw std::runtime_error("the pool holds other tokens than expected (it changed since it was listed)");
    }
    if (!prov.lora_known) {
        throw std::runtime_error("the pool's cells were computed under mixed LoRA sets");
    }
    if (prov.n_exact < (int32_t) tokens.size()) {
        throw std::runtime_error(string_format("the pool's cells from position %d on were moved by a shift (n_cache_reuse or "
                                               "context shift): not exact, so not saved", prov.n_exact));
    }
    for (const auto & la : prov.lora) {
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
    if (polykv_seq_resident(ctx, seq_id) != (int32_t) tokens.size()) {
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
    header["salt_mac"]      = opt_hex(my_salt_mac);
    header["state_bytes"]   = state.size();
    header["mac"]           = "hmac-sha256";
    header["created_by"]    = "llama-server (polykv)";
    const std::string head  = header.dump();

    const uint32_t n_head = (uint32_t) head.size();
    const uint8_t  len[4] = { (uint8_t) n_head, (uint8_t) (n_head >> 8), (uint8_t) (n_head >> 16), (uint8_t) (n_head >> 24) };
    hmac_sha256    mac(key_);
    mac.update(POLYKV_MAGIC, sizeof(POLYKV_MAGIC));
    mac.update(len, 4);
    mac.update(head.data(), head.size());
    mac.update(state.data(), state.size());
    const auto tag = mac.digest();

#ifdef _WIN32
    throw std::runtime_error("pool files need a POSIX system");
#else
    // write "<path>.part.<pid>" (created here, never through a link), flush it to disk, rename it over path:
    // a reader sees the old file or the whole new one
    const std::string tmp = path + ".part." + std::to_string((long long) polykv_getpid());
    unlink(tmp.c_str()); // a leftover of this pid (unlink removes a link itself, never its target)
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        throw std::runtime_error("cannot write " + tmp + ": " + strerror(errno));
    }
    bool ok = write_all(fd, POLYKV_MAGIC, sizeof(POLYKV_MAGIC)) && write_all(fd, len, 4) &&
              write_all(fd, head.data(), head.size()) && write_all(fd, state.data(), state.size()) &&
              write_all(fd, tag.data(), tag.size()) && fsync(fd) == 0;
    const int err_write = errno;
    ok = (close(fd) == 0) && ok;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
        const std::string err = strerror(ok ? errno : err_write);
        unlink(tmp.c_str());
        throw std::runtime_error("cannot write " + path + ": " + err);
    }
#endif

    return {
        { "format",        POLYKV_FORMAT },
        { "n_tokens",      tokens.size() },
        { "tokens_sha256", header["tokens_sha256"] },
        { "salted",        !prov.salt.empty() },
        { "state_bytes",   state.size() },
        { "file_bytes",    sizeof(POLYKV_MAGIC) + 4 + head.size() + state.size() + POLYKV_MAC_BYTES },
    };
}

polykv_pool_file polykv_pool_files::read_verified(const std::string & path) const {
    require_usable();
    polykv_pool_file out;
#ifdef _WIN32
    GGML_UNUSED(path);
    throw std::runtime_error("pool files need a POSIX system");
#else
    struct stat st;
    const int   fd = open_regular(path, st);
    if (fd < 0) {
        if (errno == ENOENT) {
            throw std::runtime_error("no such file");
        }
        throw std::runtime_error(errno == ELOOP ? "not a regular file (a symbolic link is refused)"
                                 : errno == EINVAL ? "not a regular file"
                                                   : std::string("cannot read the file: ") + strerror(errno));
    }
    out.n_bytes = (size_t) st.st_size;
    std::vector<char> raw(out.n_bytes);
    const bool ok = read_all(fd, raw.data(), raw.size());
    close(fd);
    if (!ok) {
        throw std::runtime_error("cannot read the file");
    }
#endif
    const size_t n_fixed = sizeof(POLYKV_MAGIC) + 4;
    if (out.n_bytes < n_fixed || memcmp(raw.data(), POLYKV_MAGIC, sizeof(POLYKV_MAGIC)) != 0) {
        throw std::runtime_error("not a polykv pool file (bad magic)");
    }
    if (out.n_bytes < n_fixed + POLYKV_MAC_BYTES) {
        throw std::runtime_error("authentication failed: the file is too short to hold its MAC");
    }
    // authenticate everything before reading any of it: only a holder of this cache's key wrote this file
    hmac_sha256 mac(key_);
    mac.update(raw.data(), out.n_bytes - POLYKV_MAC_BYTES);
    const auto tag = mac.digest();
    if (!same_bytes(tag.data(), reinterpret_cast<const uint8_t *>(raw.data()) + out.n_bytes - POLYKV_MAC_BYTES, tag.size())) {
        throw std::runtime_error("authentication failed: the file was not written with this pool cache's key, or was changed since");
    }
    const auto *   b      = reinterpret_cast<const uint8_t *>(raw.data()) + sizeof(POLYKV_MAGIC);
    const uint32_t n_head = (uint32_t) b[0] | (uint32_t) b[1] << 8 | (uint32_t) b[2] << 16 | (uint32_t) b[3] << 24;
    if (n_head > POLYKV_MAX_HEADER || n_head > out.n_bytes - n_fixed - POLYKV_MAC_BYTES) {
        throw std::runtime_error("damaged file (header length beyond the file)");
    }
    try {
        out.header = json::parse(std::string(raw.begin() + n_fixed, raw.begin() + n_fixed + n_head));
    } catch (const std::exception &) {
        throw std::runtime_error("damaged file (the header is not JSON)");
    }
    if (!out.header.is_object() || !out.header.contains("format") || out.header["format"] != POLYKV_FORMAT) {
        throw std::runtime_error(string_format("unsupported file format %s (this server reads format %d)",
            out.header.is_object() && out.header.contains("format") ? out.header["format"].dump().c_str() : "?", POLYKV_FORMAT));
    }
    out.salt_mac = json_str(out.header, "salt_mac");
    const size_t n_state = out.n_bytes - n_fixed - n_head - POLYKV_MAC_BYTES;
    if (!out.header.contains("state_bytes") || out.header["state_bytes"] != n_state) {
        throw std::runtime_error(string_format("damaged file (%zu state bytes, the header says %s)", n_state,
                                               out.header.value("state_bytes", json()).dump().c_str()));
    }
    out.state.assign(raw.begin() + n_fixed + n_head, raw.begin() + n_fixed + n_head + n_state);
    return out;
}

polykv_pool_file polykv_pool_files::read(const std::string & path, const json & expect, uint32_t n_ctx_slot) const {
    polykv_pool_file out = read_verified(path);
    const json & header = out.header;

    // the salt first, and with no detail: a caller without the pool's salt learns nothing of the file
    if (out.salt_mac != salt_mac(expect.value("cache_salt", std::string()))) {
        throw std::runtime_error(POLYKV_SALT_REFUSAL);
    }
    out.salted = !out.salt_mac.empty();

    // the model, then the KV layout and the settings that change KV
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
    if (!header.contains("settings") || header["settings"] != mine["settings"]) {
        throw std::runtime_error("saved under other KV settings (RoPE/YaRN, --override-kv or control vectors; here: " +
                                 mine["settings"].dump() + ", in the file: " + header.value("settings", json()).dump() + ")");
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

    // the state's cells: one per position 0..n-1, one sequence (checked before anything is loaded)
    const std::string cells = check_state_cells(out.state, out.tokens.size(), kv_json_.value("n_stream", 1),
                                                  llama_model_is_recurrent(model_));
    if (!cells.empty()) {
        throw std::runtime_error("damaged file (" + cells + ")");
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
    if (n == 0 || polykv_seq_resident(ctx, seq_id) != (int32_t) file.tokens.size()) {
        llama_memory_seq_rm(mem, seq_id, -1, -1);
        throw std::runtime_error(n == 0
            ? string_format("the KV cache has no room for its %zu cells (free cells are held by other slots) or refused its layout", file.tokens.size())
            : string_format("the loaded state holds positions [%d, %d], not [0, %zu)", p0, p1, file.tokens.size()));
    }
    return {
        { "format",        POLYKV_FORMAT },
        { "n_tokens",      file.tokens.size() },
        { "tokens_sha256", file.tokens_sha256 },
        { "salted",        file.salted },
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
    if (body.contains("promoted")) { // restore: the file holds a prefix --share-any promoted (polykv serve keeps them)
        if (!body["promoted"].is_boolean()) {
            throw std::invalid_argument("\"promoted\" must be true or false");
        }
        out["promoted"] = body["promoted"];
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

polykv_provenance polykv_restored_prov(const json & expect, const std::vector<common_adapter_lora_info> & adapters) {
    polykv_provenance prov;
    prov.salt = expect.value("cache_salt", std::string());
    prov.lora = adapters;
    for (auto & la : prov.lora) {
        la.scale = 0.0f;
    }
    return prov;
}

void polykv_pool_snapshot(llama_context * ctx, llama_seq_id seq_id, polykv_pool_stats & stats) {
    stats.n_resident = polykv_seq_resident(ctx, seq_id);
}

static llama_tokens resident_tokens(int32_t n_resident, const server_tokens & tokens) {
    if (n_resident <= 0 || tokens.has_mtmd || (size_t) n_resident > tokens.size()) {
        return {};
    }
    llama_tokens out = tokens.get_text_tokens();
    out.resize((size_t) n_resident);
    return out;
}

llama_tokens polykv_resident_tokens(llama_context * ctx, llama_seq_id seq_id, const server_tokens & tokens) {
    return resident_tokens(polykv_seq_resident(ctx, seq_id), tokens);
}

json polykv_pool_state_json(const server_tokens & prompt, const polykv_provenance & prov, const polykv_pool_stats & stats,
                            int n_sharers) {
    const llama_tokens tokens   = resident_tokens(stats.n_resident, prompt);
    const bool         resident = !tokens.empty();
    const bool         salted   = !prov.salt_known || !prov.salt.empty();
    const int64_t      now      = ggml_time_us();
    // a salted pool shows nothing of its tokens but a MAC keyed with its salt (docs/security.md)
    json tokens_sha = resident && !salted ? json(tokens_sha256(tokens)) : json(nullptr);
    json tokens_hm  = resident && salted && prov.salt_known ? json(tokens_mac(tokens, prov.salt)) : json(nullptr);
    return {
        { "n_tokens",        salted ? json(nullptr) : json(resident ? tokens.size() : 0) },
        { "resident",        resident },
        { "salted",          prov.salt_known ? json(salted) : json("mixed") },
        { "exact",           prov.n_exact == polykv_provenance::ALL || (resident && prov.n_exact >= (int32_t) tokens.size()) },
        { "tokens_sha256",   tokens_sha },
        { "tokens_mac",      tokens_hm },
        { "hits",            stats.hits },
        { "sharers",         n_sharers },
        { "last_use_s_ago",  stats.t_last_use_us > 0 ? json((now - stats.t_last_use_us) / 1e6) : json(nullptr) },
        { "restored_from",   stats.restored_from.empty() || salted ? json(nullptr) : json(stats.restored_from) },
        { "promoted",        stats.promoted },
    };
}
