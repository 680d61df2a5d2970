/* The subset of llama.h that polykv binds, in cffi cdef syntax.
 * Structs are partial (`...;`): the compiler takes their layout from llama.h.
 * Enums end in `...`: the compiler fills in their values. Macros use `#define X ...`.
 * Opaque handles are declared as incomplete structs. Keep in llama.h's order. */

#define LLAMA_DEFAULT_SEED ...
#define LLAMA_TOKEN_NULL ...
#define LLAMA_STATE_SEQ_MAGIC ...
#define LLAMA_STATE_SEQ_VERSION ...

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_memory_i;
typedef struct llama_memory_i * llama_memory_t;

/* from ggml.h: log levels and the log callback type */
enum ggml_log_level {
    GGML_LOG_LEVEL_NONE,
    GGML_LOG_LEVEL_DEBUG,
    GGML_LOG_LEVEL_INFO,
    GGML_LOG_LEVEL_WARN,
    GGML_LOG_LEVEL_ERROR,
    GGML_LOG_LEVEL_CONT,
    ...
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

/* from ggml.h: tensor types (the KV cache's K and V types) and their names */
enum ggml_type {
    GGML_TYPE_F32,
    GGML_TYPE_F16,
    GGML_TYPE_Q8_0,
    ...
};
const char * ggml_type_name(enum ggml_type type);

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO,
    LLAMA_FLASH_ATTN_TYPE_DISABLED,
    LLAMA_FLASH_ATTN_TYPE_ENABLED,
    ...
};

enum llama_load_mode {
    LLAMA_LOAD_MODE_NONE,
    LLAMA_LOAD_MODE_MMAP,
    ...
};

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
    ...;
} llama_batch;

struct llama_model_params {
    int32_t n_gpu_layers;
    enum llama_load_mode load_mode;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool swa_full;
    bool kv_unified;
    ...;
};

typedef struct llama_sampler_chain_params {
    bool no_perf;
    ...;
} llama_sampler_chain_params;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
    ...;
} llama_chat_message;

struct llama_model_params          llama_model_default_params(void);
struct llama_context_params        llama_context_default_params(void);
struct llama_sampler_chain_params  llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_backend_free(void);

/* ggml's backend registry: the CPU backend's polykv entry points (patch 0076) are found by name */
typedef struct ggml_backend_reg * ggml_backend_reg_t;
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);

struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

int64_t llama_time_us(void);
size_t llama_max_parallel_sequences(void);
bool llama_supports_mmap(void);
bool llama_supports_gpu_offload(void);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);

const struct llama_model * llama_get_model(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
uint64_t llama_model_n_params(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);

/* Memory */
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);

/* State */
size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
size_t llama_state_seq_save_file(struct llama_context * ctx, const char * filepath, llama_seq_id seq_id,
                                 const llama_token * tokens, size_t n_token_count);
size_t llama_state_seq_load_file(struct llama_context * ctx, const char * filepath, llama_seq_id dest_seq_id,
                                 llama_token * tokens_out, size_t n_token_capacity, size_t * n_token_count_out);

/* Decoding */
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_n_threads(struct llama_context * ctx);
int32_t llama_n_threads_batch(struct llama_context * ctx);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

/* Vocab */
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_nl(const struct llama_vocab * vocab);
llama_token llama_vocab_pad(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                             int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

/* Sampling */
const char * llama_sampler_name(const struct llama_sampler * smpl);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
uint32_t llama_sampler_get_seed(const struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);

const char * llama_print_system_info(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
    ...;
};
struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void llama_perf_context_reset(struct llama_context * ctx);

/* Python-side log sink (polykv_py.llama.backend); passed to llama_log_set. */
extern "Python" void _polykv_log_callback(enum ggml_log_level level, const char * text, void * user_data);
