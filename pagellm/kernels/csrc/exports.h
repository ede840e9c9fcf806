// The exported kernels one source calls from another (decoder_stack.cpp), declared once: each
// defining source includes this too, so a definition that drifts from its declaration is a
// compile error ("conflicting declaration of C function"), not a silent mismatch.
#pragma once

#include <cstdint>

extern "C" {

// One linear's LoRA slots (lora.cpp; its layouts there), read by lora.cpp and decoder_stack.cpp.
struct PagellmLoRALinear {
    int64_t width;             // A's rows: parts x rank (0: no adapter adds to this linear)
    int64_t rank;              // A's rows (and B's) per part
    int64_t parts;             // 1..4
    int64_t features_in;       // A's columns: the linear's input width
    int64_t part_cols[5];      // each part's first output column, then the linear's width
    const void* const* a;      // [max_loras] each slot's A
    const void* const* b;      // [max_loras] each slot's B
    const uint8_t* active;     // [max_loras]: 1 where the slot's adapter adds to this linear
    int32_t dtype;             // A's and B's dtype, the activations' (0 float32, 1 bf16)
    int32_t max_loras;         // the slots: a, b and active hold this many
};

int pagellm_add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t n,
                         float eps, int dtype, int num_threads, int weight_f32);
int pagellm_delta_net_decode(const void* proj, int64_t proj_stride, int64_t num_rows, const int64_t* rows,
                             const int64_t* slots, int64_t num_slots, const uint8_t* fresh, int64_t n,
                             void* conv_state, const void* conv_weight, int64_t conv_dim, int64_t taps, float* ssm,
                             const float* neg_a, const float* dt_bias,
                             const void* norm_weight, float eps, int64_t key_heads, int64_t value_heads,
                             int64_t key_dim, int64_t value_dim, int tiled, void* out, int64_t out_stride, int dtype,
                             int num_threads);
int pagellm_mamba2_decode(const void* proj, int64_t proj_stride, int64_t num_rows, const int64_t* rows,
                          const int64_t* slots, int64_t num_slots, const uint8_t* fresh, int64_t n, void* conv_state,
                          const void* conv_weight, const void* conv_bias, int64_t conv_dim, int64_t taps, float* ssm,
                          const float* neg_a, const float* dt_bias, const float* d, float dt_min, float dt_max,
                          const void* norm_weight, float eps, int64_t heads, int64_t head_dim, int64_t state_size,
                          int64_t groups, void* out, int64_t out_stride, int dtype, int num_threads);
int pagellm_head_rms_norm(void* x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                          const void* weight, float eps, int dtype, int num_threads, int weight_f32);
int pagellm_gemm_q(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                   int64_t ldc, int a_dtype, int w_format, int epilogue, int num_threads, int tiles);
int pagellm_dequant_q_bf16(const void* packed, int64_t tiles, int64_t k, int w_format, int silu_mul, void* w,
                           int num_threads);
int pagellm_pack_pairs(const void* first, const void* second, int64_t n, int64_t k, int64_t cols, void* dst,
                       int num_threads);
int pagellm_gemm_bf16(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                      int64_t ldc, int epilogue, int num_threads, int use_amx);
int pagellm_gemm_avx2(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                      int64_t ldc, int a_dtype, int w_dtype, int epilogue, int num_threads);
int pagellm_lora_add(const PagellmLoRALinear* lora, int64_t slot, const void* x, int64_t ldx, int64_t m, int64_t k,
                     void* out, int64_t ldo, int64_t n, int dtype, int num_threads);
int pagellm_silu_mul(const void* x, int64_t rows, int64_t n, void* out, int dtype, int num_threads);
int pagellm_bias_gelu_tanh(const void* x, int64_t rows, int64_t n, const void* bias, void* out, int dtype,
                           int num_threads);
int pagellm_rotary(void* x, int64_t row_stride, int64_t rows, int64_t num_heads, int64_t head_dim, int64_t rotary_dim,
                   const void* cos, const void* sin, int dtype, int num_threads);
int pagellm_write_kv(const void* key, int64_t key_row_stride, const void* value, int64_t value_row_stride,
                     void* key_cache, void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                     int64_t num_kv_heads, int64_t head_dim, int dtype, int num_threads);
int pagellm_paged_attention(const void* query, int64_t q_row_stride, void* out, int64_t out_row_stride,
                            const void* key_cache, const void* value_cache, const int64_t* block_tables,
                            int64_t block_table_stride, const int32_t* row_token, const int32_t* row_req,
                            const int32_t* row_start, const int32_t* row_ctx, int64_t num_rows, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                            const float* sinks, int dtype, int num_threads);
int pagellm_shm_all_reduce(void* region, int rank, int size, float* data, int64_t n, int64_t slot_elems, uint64_t seq,
                           double timeout_s);

}  // extern "C"
