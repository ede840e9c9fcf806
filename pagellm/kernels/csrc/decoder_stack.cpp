// A whole stack of decoder layers (Llama family) in one call: the same kernels the Python
// layers call (norm, pagellm's GEMMs, rotary, K/V write, paged attention), in the same order on
// the same buffers, so the result is bit for bit the Python path's.
//
// Why: at batch 1 a step's quantized weights take ~4-5 ms to read, and the Python between ~300
// kernel calls (module calls, wrapper checks, ctypes) took ~3 ms more (benchmarks/NOTES.md, 37).
// Every index the kernels follow (slots, block tables, rows) is checked once per step by the
// caller; the weights' shapes when the stack is built.
//
// Per layer, T tokens, hidden H, qkv width W = q + 2 kv:
//   h = rms_norm(x + residual) (residual updated; layer 0: residual = x)
//   qkv = h @ Wqkv^T (+ bias); each q and k head RMS-normed where the layer has q/k norms;
//   rotary on q and k; k, v into the cache; a = attention(q) (the layer's scale, soft cap and
//   sliding window)
//   x = a @ Wo^T; h = rms_norm(x + residual); x = down(silu(gate(h)) * up(h))
// With LoRA adapters (a step's rows grouped by adapter slot, each group a run of rows), each
// linear's output rows of a group get the slot's low-rank product added (model/lora.py), gate
// and up before the activation, o and down before the tensor-parallel sum.
// The final norm stays with the caller. Under tensor parallelism (tp_size > 1) each rank holds
// its share of the heads and of the MLP width, and x is summed over the ranks after the o and
// the down projections (shm_all_reduce.cpp, in float32 as the Python layers do it).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "exports.h"

extern "C" {

// One packed linear and the GEMM that multiplies it.
struct PagellmLinear {
    const void* weight;
    int32_t kind;      // 0 integer GEMM, 1 bf16 GEMM (dot products), 2 bf16 GEMM on AMX tiles, 3 AVX2 GEMM,
                       // 4 integer GEMM on AMX-INT8 tiles, 5 quantized weight dequantized on AMX-BF16 tiles
    int32_t format;    // integer GEMM: its w_format; AVX2 GEMM: w_dtype (0 float32, 1 bf16)
    int32_t epilogue;  // that GEMM's epilogue code (gate_up: its silu_mul)
    int32_t reserved;
    int64_t cols;                // with next: the output columns this part computes (the first ones)
    const PagellmLinear* next;   // the part computing the following columns (a q/k/v of another
                                 // format), or null: this part computes them all
};

// One layer's linears, norm weights (model dtype), caches and attention variant (the fields of
// pagellm.model.layer_spec.LayerSpec the call runs).
struct PagellmLayer {
    const void* input_norm;
    const void* post_norm;
    const void* qkv_bias;  // [W] in the model dtype, or null
    const void* q_norm;    // [head_dim]: each q head RMS-normed before the rotary (Qwen3), or null
    const void* k_norm;    // [head_dim]: each k head likewise, or null
    void* key_cache;
    void* value_cache;
    float scale;           // attention scores' scale
    float softcap;         // scores capped by softcap * tanh(score / softcap); 0: none
    int32_t window;        // positions each row attends to, its own included; 0: all
    int32_t mlp_apart;     // 1: gate/up's GEMM writes gate and up (into gate_up), SiLU-and-mul after it
    int32_t rotary_dim;    // each head's leading dims the rotary turns (the stack's cos / sin width); 0: none (NoPE)
    float residual_multiplier;  // each block's output scaled by it before it joins the residual (Granite); 1: none
    PagellmLinear qkv, o, gate_up, down;
};

// One step's call: shapes, the step's indices and the buffers (all [T, ...] row-major).
struct PagellmStack {
    const PagellmLayer* layers;
    int64_t num_layers, tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, reserved_f;
    int32_t dtype;       // 0 float32, 1 bf16: activations, norms, rotary tables
    int32_t cache_code;  // the K/V write and attention code (0 f32, 1 bf16, 2 fp8 / 3 int8 under bf16, 4 int8 under f32)
    int32_t num_threads, reserved;
    void* x;             // [T, H] in: embeddings; out: the last layer's MLP output
    void* residual;      // [T, H] out: the residual stream
    const void* cos;     // [T, rotary_dim] (the layers' rotary_dim where not 0)
    const void* sin;
    const int64_t* slot_mapping;
    const int64_t* block_tables;
    int64_t block_table_stride;
    const int32_t* row_token;
    const int32_t* row_req;
    int32_t* row_start;  // scratch [num_rows]: each row's first position under a layer's window
    const int32_t* row_ctx;
    int64_t num_rows;
    void* h;             // scratch [T, H]
    void* qkv;           // scratch [T, W]
    void* attn;          // scratch [T, num_heads * head_dim]
    void* act;           // scratch [T, intermediate]
    // Tensor parallelism (tp_size 1: none): the ranks' shared region, this rank, the calls so far
    // (shared with the Python all-reduce: every rank counts the same calls), a float32 [T, H]
    // scratch for bf16 activations.
    void* tp_region;
    uint64_t* tp_calls;
    void* tp_scratch;
    int64_t tp_slot_elems;
    double tp_timeout_s;
    int32_t tp_rank, tp_size;
    void* gate_up;       // scratch [T, 2 * intermediate] where a layer's MLP runs apart, else null
    // LoRA (null / 0: no adapter this step): each layer's 4 linears (qkv, o, gate_up, down) and
    // the groups of rows [num_lora_groups][3] (slot, first row, rows).
    const PagellmLoRALinear* lora;
    const int64_t* lora_groups;
    int64_t num_lora_groups;
};

namespace {

// c[m, n] (rows ldc apart) = a[m, k] (rows k apart) @ W^T on one part's GEMM.
int linear_part(const PagellmLinear& w, const void* a, int64_t m, int64_t k, void* c, int64_t n, int64_t ldc,
                int dtype, int threads) {
    switch (w.kind) {
        case 0:
        case 4:
        case 5:
            return pagellm_gemm_q(a, k, m, k, w.weight, n, c, ldc, dtype, w.format, w.epilogue, threads,
                                  w.kind == 4 ? 1 : w.kind == 5 ? 2 : 0);
        case 1:
        case 2:
            if (dtype != 1) return -1;
            return pagellm_gemm_bf16(a, k, m, k, w.weight, n, c, ldc, w.epilogue, threads, w.kind == 2);
        case 3:
            return pagellm_gemm_avx2(a, k, m, k, w.weight, n, c, ldc, dtype, w.format, w.epilogue, threads);
        default:
            return -1;
    }
}

// c[m, n] = a[m, k] (rows k apart) @ W^T: each part of the linear into its columns.
int linear(const PagellmLinear& w, const void* a, int64_t m, int64_t k, void* c, int64_t n, int dtype, int threads) {
    const int64_t elem = dtype == 1 ? 2 : 4;
    int64_t done = 0;
    for (const PagellmLinear* part = &w; part != nullptr; part = part->next) {
        const int64_t cols = part->next != nullptr ? part->cols : n - done;
        if (cols <= 0 || done + cols > n) return -1;
        const int rc = linear_part(*part, a, m, k, static_cast<char*>(c) + done * elem, cols, n, dtype, threads);
        if (rc != 0) return rc;
        done += cols;
    }
    return 0;
}

// out [T, n] rows of each group += B(A(in [T, k] rows)) where the group's adapter adds to this
// linear (lora.cpp: the bits of LoRAStep.add_ in model/lora.py).
int add_lora(const PagellmStack& s, const PagellmLoRALinear* lora, const void* in, int64_t k, void* out, int64_t n) {
    if (lora == nullptr || lora->width == 0) return 0;
    const int64_t elem = s.dtype == 1 ? 2 : 4;
    for (int64_t g = 0; g < s.num_lora_groups; ++g) {
        const int64_t slot = s.lora_groups[3 * g], first = s.lora_groups[3 * g + 1], rows = s.lora_groups[3 * g + 2];
        const int rc = pagellm_lora_add(lora, slot, static_cast<const char*>(in) + first * k * elem, k, rows, k,
                                        static_cast<char*>(out) + first * n * elem, n, n, s.dtype, s.num_threads);
        if (rc != 0) return rc;
    }
    return 0;
}

// qkv rows += bias, rounded to the dtype as torch's add_.
void add_bias(void* qkv, const void* bias, int64_t rows, int64_t width, bool bf16) {
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            auto* row = static_cast<uint16_t*>(qkv) + r * width;
            const auto* b = static_cast<const uint16_t*>(bias);
            for (int64_t i = 0; i < width; ++i) row[i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(b[i]));
        } else {
            auto* row = static_cast<float*>(qkv) + r * width;
            const auto* b = static_cast<const float*>(bias);
            for (int64_t i = 0; i < width; ++i) row[i] += b[i];
        }
    }
}

// x[0 .. n) *= multiplier, rounded to the dtype as torch's `x * multiplier` (float32 arithmetic).
void scale(void* x, int64_t n, float multiplier, bool bf16) {
    if (bf16) {
        auto* v = static_cast<uint16_t*>(x);
        for (int64_t i = 0; i < n; ++i) v[i] = float_to_bf16(bf16_to_float(v[i]) * multiplier);
    } else {
        auto* v = static_cast<float*>(x);
        for (int64_t i = 0; i < n; ++i) v[i] *= multiplier;
    }
}

// x [T, H] summed over the ranks, in float32 (bf16 activations widened and rounded back once).
int all_reduce(const PagellmStack& s) {
    const int64_t n = s.tokens * s.hidden;
    auto* sum = static_cast<float*>(s.dtype == 1 ? s.tp_scratch : s.x);
    if (s.dtype == 1) {
        const auto* x = static_cast<const uint16_t*>(s.x);
        for (int64_t i = 0; i < n; ++i) sum[i] = bf16_to_float(x[i]);
    }
    for (int64_t start = 0; start < n; start += s.tp_slot_elems) {
        const uint64_t seq = ++*s.tp_calls;
        const int rc = pagellm_shm_all_reduce(s.tp_region, s.tp_rank, s.tp_size, sum + start,
                                              std::min(s.tp_slot_elems, n - start), s.tp_slot_elems, seq, s.tp_timeout_s);
        if (rc != 0) return rc;
    }
    if (s.dtype == 1) {
        auto* x = static_cast<uint16_t*>(s.x);
        for (int64_t i = 0; i < n; ++i) x[i] = float_to_bf16(sum[i]);
    }
    return 0;
}

// Each row's first position under `window` (its last `window` positions: in [0, row_ctx)), into
// s.row_start where the previous layer's window differs (`*current`); null without a window.
const int32_t* row_starts(const PagellmStack& s, int32_t window, int32_t* current) {
    if (window <= 0) return nullptr;
    if (*current != window) {
        for (int64_t r = 0; r < s.num_rows; ++r) s.row_start[r] = std::max(s.row_ctx[r] - window, 0);
        *current = window;
    }
    return s.row_start;
}

// x = down(silu(gate(h)) * up(h)), the adapters added to gate/up and to down.
int mlp(const PagellmStack& s, const PagellmLayer& L, const PagellmLoRALinear* lora) {
    const int64_t T = s.tokens, H = s.hidden, I = s.intermediate;
    const int dt = s.dtype, th = s.num_threads;
    int rc = 0;
    if (L.mlp_apart) {
        rc = linear(L.gate_up, s.h, T, H, s.gate_up, 2 * I, dt, th);
        if (rc == 0 && lora != nullptr) rc = add_lora(s, lora + 2, s.h, H, s.gate_up, 2 * I);
        if (rc == 0) rc = pagellm_silu_mul(s.gate_up, T, I, s.act, dt, th);
    } else {
        if (lora != nullptr && lora[2].width != 0) return -1;  // (the activation is in the GEMM: nothing to add to)
        rc = linear(L.gate_up, s.h, T, H, s.act, I, dt, th);
    }
    if (rc == 0) rc = linear(L.down, s.act, T, I, s.x, H, dt, th);
    if (rc == 0 && lora != nullptr) rc = add_lora(s, lora + 3, s.act, I, s.x, H);
    return rc;
}

int layer(const PagellmStack& s, const PagellmLayer& L, const PagellmLoRALinear* lora, bool first, int32_t* window) {
    const int64_t T = s.tokens, H = s.hidden, dh = s.head_dim;
    const int64_t q = s.num_heads * dh, kv = s.num_kv_heads * dh, W = q + 2 * kv;
    const int dt = s.dtype, th = s.num_threads;
    const int64_t elem = dt == 1 ? 2 : 4;
    auto* qkv = static_cast<char*>(s.qkv);
    int rc = pagellm_add_rms_norm(s.x, first ? nullptr : s.residual, L.input_norm, s.h, T, H, s.eps, dt, th, 0);
    if (rc == 0) rc = linear(L.qkv, s.h, T, H, s.qkv, W, dt, th);
    if (rc != 0) return rc;
    if (L.qkv_bias != nullptr) add_bias(s.qkv, L.qkv_bias, T, W, dt == 1);
    if (lora != nullptr) rc = add_lora(s, lora, s.h, H, s.qkv, W);
    if (rc == 0 && L.q_norm != nullptr) rc = pagellm_head_rms_norm(s.qkv, W, T, s.num_heads, dh, L.q_norm, s.eps, dt, th, 0);
    if (rc == 0 && L.k_norm != nullptr)
        rc = pagellm_head_rms_norm(qkv + q * elem, W, T, s.num_kv_heads, dh, L.k_norm, s.eps, dt, th, 0);
    if (rc == 0 && L.rotary_dim > 0)  // (0: a NoPE layer)
        rc = pagellm_rotary(s.qkv, W, T, s.num_heads + s.num_kv_heads, dh, L.rotary_dim, s.cos, s.sin, dt, th);
    if (rc == 0)
        rc = pagellm_write_kv(qkv + q * elem, W, qkv + (q + kv) * elem, W, L.key_cache, L.value_cache, s.slot_mapping,
                              T, s.num_kv_heads, dh, s.cache_code, th);
    if (rc == 0 && s.num_rows > 0)
        rc = pagellm_paged_attention(s.qkv, W, s.attn, q, L.key_cache, L.value_cache, s.block_tables,
                                     s.block_table_stride, s.row_token, s.row_req, row_starts(s, L.window, window),
                                     s.row_ctx, s.num_rows, s.num_heads, s.num_kv_heads, dh, s.block_size, L.scale,
                                     L.softcap, nullptr, s.cache_code, th);
    if (rc == 0) rc = linear(L.o, s.attn, T, q, s.x, H, dt, th);
    if (rc == 0 && lora != nullptr) rc = add_lora(s, lora + 1, s.attn, q, s.x, H);
    if (rc == 0 && s.tp_size > 1) rc = all_reduce(s);
    const bool scaled = L.residual_multiplier != 1.0f;
    if (rc == 0 && scaled) scale(s.x, T * H, L.residual_multiplier, dt == 1);
    if (rc == 0) rc = pagellm_add_rms_norm(s.x, s.residual, L.post_norm, s.h, T, H, s.eps, dt, th, 0);
    if (rc == 0) rc = mlp(s, L, lora);
    if (rc == 0 && s.tp_size > 1) rc = all_reduce(s);
    if (rc == 0 && scaled) scale(s.x, T * H, L.residual_multiplier, dt == 1);
    return rc;
}

}  // namespace

// Runs s->num_layers layers over s->tokens tokens. Returns 0, -1 on a bad argument or the
// first failing kernel's code.
int pagellm_decoder_stack(const PagellmStack* s) {
    if (s == nullptr || s->layers == nullptr || s->num_layers <= 0 || s->tokens <= 0 || (s->dtype != 0 && s->dtype != 1))
        return -1;
    if (s->tp_size > 1 && (s->tp_region == nullptr || s->tp_calls == nullptr || s->tp_slot_elems <= 0 ||
                           (s->dtype == 1 && s->tp_scratch == nullptr)))
        return -1;
    if (s->num_rows > 0 && s->row_start == nullptr) return -1;
    if (s->lora != nullptr && s->lora_groups == nullptr) return -1;
    for (int64_t l = 0; l < s->num_layers; ++l)
        if (s->layers[l].mlp_apart && s->gate_up == nullptr) return -1;
    std::memcpy(s->residual, s->x, static_cast<size_t>(s->tokens * s->hidden * (s->dtype == 1 ? 2 : 4)));
    int32_t window = 0;  // the window s->row_start holds the starts of (0: none yet)
    for (int64_t l = 0; l < s->num_layers; ++l) {
        const int rc = layer(*s, s->layers[l], s->lora != nullptr ? s->lora + 4 * l : nullptr, l == 0, &window);
        if (rc != 0) return rc;
    }
    return 0;
}

}  // extern "C"
