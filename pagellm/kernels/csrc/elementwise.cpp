// Elementwise kernels of the model step: the K/V cache write (copied, rounded to fp8, or int8 rows),
// RMSNorm with its residual add, rotary embedding, the greedy argmax over logits rows and the
// structured-outputs token mask applied to logits rows.

#include <limits>

#include "cpu_common.h"
#include "exports.h"

namespace {

#ifdef PAGELLM_AVX512_BF16
// 16 floats -> 16 e4m3 bytes, as float_to_e4m3.
inline __m128i float16_to_e4m3(__m512 x) {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_abs_ps(x);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    const __m512 c = _mm512_min_ps(a, _mm512_set1_ps(448.0f));
    __m512i u = _mm512_castps_si512(c);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1))));
    __m512i r = _mm512_sub_epi32(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(120 << 3));
    const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(512.0f)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(c, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), sub);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(r, sign));
}
#endif

// One row of n K or V values into the cache: copied, or (bf16 into an fp8 cache) rounded to
// e4m3 (float_to_e4m3 of each).
template <typename T>
inline void store_row(const T* src, T* dst, int64_t n) {
    std::memcpy(dst, src, sizeof(T) * static_cast<size_t>(n));
}
inline void store_row(const uint16_t* src, uint8_t* dst, int64_t n) {
    int64_t i = 0;
#ifdef PAGELLM_AVX512_BF16
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), float16_to_e4m3(bf16x16_to_float(src + i)));
#endif
    for (; i < n; ++i) dst[i] = float_to_e4m3(bf16_to_float(src[i]));
}

// One token's heads (each head_dim values) into its cache row: stored whole, or an int8 row
// (codes and scale, quantize_kv_row) per head.
template <typename T, typename KV>
inline void store_token(const T* src, KV* dst, int64_t heads, int64_t head_dim) {
    if constexpr (std::is_same_v<KV, int8_t>) {
        for (int64_t h = 0; h < heads; ++h) quantize_kv_row(src + h * head_dim, dst + h * kv_row<KV>(head_dim), head_dim);
    } else {
        store_row(src, dst, heads * head_dim);
    }
}

template <typename T, typename KV = T>
void write_kv(const T* key, int64_t key_row_stride, const T* value, int64_t value_row_stride,
              KV* key_cache, KV* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
              int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t slot_elems = heads * kv_row<KV>(head_dim);
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= kMinParallelRows)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;  // padding token: nothing to store
        store_token(key + t * key_row_stride, key_cache + slot * slot_elems, heads, head_dim);
        store_token(value + t * value_row_stride, value_cache + slot * slot_elems, heads, head_dim);
    }
}

// One row: residual += x (rounded to T, as a separate add would be; no residual: none), then
// out = weight * T(h / sqrt(mean(h^2) + eps)) with the statistics in float32 (HF's LlamaRMSNorm);
// with a float32 weight W (a scale: Gemma's and Qwen3.5's 1 + weight, taken once in float32),
// out = T(h / sqrt(mean(h^2) + eps) * scale), the normed value not rounded before the product.
// x is read whole into h before out is written, so out may be x (in place).
template <typename T, typename W = T>
inline void norm_row(const T* xr, T* rr, const W* weight, T* o, int64_t n, float eps, float* h) {
    float sumsq = 0.f;
    int64_t i0 = 0;  // elements done by the vector loops (elementwise: same results)
#ifdef PAGELLM_AVX512_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
        for (; i0 + 16 <= n; i0 += 16) {
            __m512 v = bf16x16_to_float(xr + i0);
            if (rr != nullptr) {
                v = round_bf16x16(_mm512_add_ps(v, bf16x16_to_float(rr + i0)));
                store_bf16x16(rr + i0, v);
            }
            _mm512_storeu_ps(h + i0, v);
        }
    }
#endif
    for (int64_t i = i0; i < n; ++i) {
        float v = Elem<T>::load(xr, i);
        if (rr != nullptr) {
            Elem<T>::store(rr, i, v + Elem<T>::load(rr, i));
            v = Elem<T>::load(rr, i);
        }
        h[i] = v;
    }
    // The sum of squares keeps this one loop (and its order): the model's greedy
    // outputs in bf16 are sensitive to it (benchmarks/NOTES.md, 18).
#pragma omp simd reduction(+ : sumsq)
    for (int64_t i = 0; i < n; ++i) sumsq += h[i] * h[i];
    const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(n) + eps);
    i0 = 0;
    if constexpr (!std::is_same_v<T, W>) {  // (T bf16, W float32: the scale)
#ifdef PAGELLM_AVX512_BF16
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i0 + 16 <= n; i0 += 16)
            store_bf16x16(o + i0, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(h + i0), vinv), _mm512_loadu_ps(weight + i0)));
#endif
        for (int64_t i = i0; i < n; ++i) Elem<T>::store(o, i, h[i] * inv * weight[i]);
        return;
    } else {
#ifdef PAGELLM_AVX512_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i0 + 16 <= n; i0 += 16) {
            const __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(h + i0), vinv));
            store_bf16x16(o + i0, _mm512_mul_ps(bf16x16_to_float(weight + i0), normed));
        }
    }
#endif
    for (int64_t i = i0; i < n; ++i) {
        T normed;
        Elem<T>::store(&normed, 0, h[i] * inv);
        Elem<T>::store(o, i, Elem<T>::load(weight, i) * Elem<T>::load(&normed, 0));
    }
    }
}

// Per row of n elements (rows n apart): norm_row.
template <typename T, typename W = T>
void add_rms_norm(const T* x, T* residual, const W* weight, T* out, int64_t rows, int64_t n, float eps,
                  int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows >= kMinParallelRows)
    {
        std::vector<float> h(static_cast<size_t>(n));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            norm_row<T, W>(x + r * n, residual != nullptr ? residual + r * n : nullptr, weight, out + r * n, n, eps,
                           h.data());
    }
}

// In place on each of `heads` heads (head_dim apart) of each of `tokens` rows (row_stride
// apart): norm_row with one weight for every head (Qwen3's per-head q and k norms).
template <typename T, typename W = T>
void head_rms_norm(T* x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t head_dim, const W* weight,
                   float eps, int num_threads) {
    const int64_t rows = tokens * heads;
#pragma omp parallel num_threads(num_threads) if (rows >= kMinParallelRows)
    {
        std::vector<float> h(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* row = x + (r / heads) * row_stride + (r % heads) * head_dim;
            norm_row<T, W>(row, nullptr, weight, row, head_dim, eps, h.data());
        }
    }
}

// In place on the first `num_heads` heads of each row: x * cos + rotate_half(x) * sin over each
// head's first `rotary_dim` dims (all of them, or fewer: partial rotary; the rest pass), each
// product and the sum rounded to T like the separate tensor ops (HF's apply_rotary_pos_emb).
template <typename T>
void rotary(T* x, int64_t row_stride, int64_t rows, int64_t num_heads, int64_t head_dim, int64_t rotary_dim,
            const T* cos, const T* sin, int num_threads) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kMinParallelRows)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + r * rotary_dim;
        const T* s = sin + r * rotary_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            T* v = x + r * row_stride + h * head_dim;
            int64_t i = 0;
#ifdef PAGELLM_AVX512_BF16
            if constexpr (std::is_same_v<T, uint16_t>) {
                for (; i + 16 <= half; i += 16) {
                    const __m512 x1 = bf16x16_to_float(v + i);
                    const __m512 x2 = bf16x16_to_float(v + i + half);
                    const __m512 a1 = round_bf16x16(_mm512_mul_ps(x1, bf16x16_to_float(c + i)));
                    const __m512 minus_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
                    const __m512 b1 = round_bf16x16(_mm512_mul_ps(minus_x2, bf16x16_to_float(s + i)));
                    const __m512 a2 = round_bf16x16(_mm512_mul_ps(x2, bf16x16_to_float(c + i + half)));
                    const __m512 b2 = round_bf16x16(_mm512_mul_ps(x1, bf16x16_to_float(s + i + half)));
                    store_bf16x16(v + i, _mm512_add_ps(a1, b1));
                    store_bf16x16(v + i + half, _mm512_add_ps(a2, b2));
                }
            }
#endif
            for (; i < half; ++i) {
                const float x1 = Elem<T>::load(v, i);
                const float x2 = Elem<T>::load(v, i + half);
                T a1, b1, a2, b2;
                Elem<T>::store(&a1, 0, x1 * Elem<T>::load(c, i));
                Elem<T>::store(&b1, 0, -x2 * Elem<T>::load(s, i));
                Elem<T>::store(&a2, 0, x2 * Elem<T>::load(c, i + half));
                Elem<T>::store(&b2, 0, x1 * Elem<T>::load(s, i + half));
                Elem<T>::store(v, i, Elem<T>::load(&a1, 0) + Elem<T>::load(&b1, 0));
                Elem<T>::store(v, i + half, Elem<T>::load(&a2, 0) + Elem<T>::load(&b2, 0));
            }
        }
    }
}

// Row-wise index of the maximum, the first one among ties; a row holding NaN gives its first
// NaN (torch.max(dim) semantics, which greedy sampling relies on).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
    int64_t i = 0;
    float best = -INFINITY;
    int64_t best_i = 0;
#ifdef PAGELLM_AVX512_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
        // Per lane: the running maximum and its first index; a strict > keeps the first.
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512();
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16) {
            const __m512 v = bf16x16_to_float(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_blend_ps(gt, vmax, v);
            vidx = _mm512_mask_blend_epi32(gt, vidx, idx);
            idx = _mm512_add_epi32(idx, step);
        }
        if (nan) {
            for (int64_t j = 0; j < i; ++j)
                if (std::isnan(bf16_to_float(x[j]))) return j;
        }
        alignas(64) float m[16];
        alignas(64) int32_t mi[16];
        _mm512_store_ps(m, vmax);
        _mm512_store_si512(mi, vidx);
        best = m[0];
        best_i = mi[0];
        for (int l = 1; l < 16; ++l)
            if (m[l] > best || (m[l] == best && mi[l] < best_i)) {
                best = m[l];
                best_i = mi[l];
            }
    }
#endif
    for (; i < n; ++i) {
        const float v = Elem<T>::load(x, i);
        if (std::isnan(v)) return i;  // the first NaN: the vector part above had none
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
    return best_i;
}

template <typename T>
void argmax_rows(const T* x, int64_t row_stride, int64_t rows, int64_t n, int64_t* out, int num_threads) {
    // Rows are long (a vocabulary): split them over threads once the work is worth a wake-up.
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= (int64_t{1} << 18))
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, n);
}

// Logits row r (n values) keeps token t where bit t % 32 of word t / 32 of bitmask row
// mask_rows[r] is set (words_per_row words; tokens past them are forbidden); every other value
// becomes -inf (float32 or bf16 bits: neg_inf). Rows with mask_rows[r] < 0 are left alone.
template <typename T>
void apply_token_bitmask(T* logits, int64_t row_stride, int64_t rows, int64_t n, const int32_t* bitmask,
                         int64_t words_per_row, const int64_t* mask_rows, T neg_inf, int num_threads) {
    const int64_t words = (n + 31) / 32;
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static) if (rows * n >= (int64_t{1} << 18))
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t w = 0; w < words; ++w) {
            if (mask_rows[r] < 0) continue;
            const uint32_t word = w < words_per_row ? static_cast<uint32_t>(bitmask[mask_rows[r] * words_per_row + w]) : 0u;
            if (word == 0xFFFFFFFFu) continue;  // all 32 allowed
            T* row = logits + r * row_stride + w * 32;
            const int64_t count = std::min<int64_t>(32, n - w * 32);
            if (word == 0u) {
                std::fill(row, row + count, neg_inf);  // most words of a grammar's mask
                continue;
            }
            for (int64_t b = 0; b < count; ++b) row[b] = ((word >> b) & 1u) ? row[b] : neg_inf;  // branch-free
        }
    }
}

}  // namespace

extern "C" {

int pagellm_abi_version() { return 27; }

// key_cache[slot_mapping[t]] = key[t] (num_kv_heads rows of head_dim values), same for V.
// dtype: 0 float32, 1 bfloat16, 2 bfloat16 K/V stored into an fp8 (e4m3) cache, 3 bfloat16 and
// 4 float32 K/V stored into an int8 cache (rows of head_dim codes and a float32 scale).
int pagellm_write_kv(const void* key, int64_t key_row_stride, const void* value, int64_t value_row_stride,
                     void* key_cache, void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                     int64_t num_kv_heads, int64_t head_dim, int dtype, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_kv_heads <= 0 || head_dim <= 0) return -1;
    const auto run = [&](auto tag, auto cache_tag) {
        using T = decltype(tag);
        using KV = decltype(cache_tag);
        write_kv<T, KV>(static_cast<const T*>(key), key_row_stride, static_cast<const T*>(value), value_row_stride,
                        static_cast<KV*>(key_cache), static_cast<KV*>(value_cache), slot_mapping, num_tokens,
                        num_kv_heads, head_dim, num_threads);
    };
    return with_cache_types(dtype, run) ? 0 : -1;
}

// residual (if not null) += x; out = rms_norm(residual or x) * weight, per row of n elements
// (weight_f32: a bf16 row's weight is a float32 scale, norm_row's second form).
int pagellm_add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t n,
                         float eps, int dtype, int num_threads, int weight_f32) {
    if (num_threads < 1) num_threads = 1;
    if (dtype == 1 && weight_f32) {
        add_rms_norm<uint16_t, float>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                                      static_cast<const float*>(weight), static_cast<uint16_t*>(out), rows, n, eps,
                                      num_threads);
    } else if (dtype == 0) {
        add_rms_norm<float>(static_cast<const float*>(x), static_cast<float*>(residual),
                            static_cast<const float*>(weight), static_cast<float*>(out), rows, n, eps, num_threads);
    } else if (dtype == 1) {
        add_rms_norm<uint16_t>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                               static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, n, eps,
                               num_threads);
    } else {
        return -1;
    }
    return 0;
}

// In place: RMSNorm over each of the first `heads` heads of each of `tokens` rows (row_stride
// elements apart), one weight [head_dim] for all (weight_f32: as pagellm_add_rms_norm's).
int pagellm_head_rms_norm(void* x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                          const void* weight, float eps, int dtype, int num_threads, int weight_f32) {
    if (num_threads < 1) num_threads = 1;
    if (head_dim <= 0 || heads < 0 || tokens < 0 || row_stride < heads * head_dim) return -1;
    if (dtype == 1 && weight_f32) {
        head_rms_norm<uint16_t, float>(static_cast<uint16_t*>(x), row_stride, tokens, heads, head_dim,
                                       static_cast<const float*>(weight), eps, num_threads);
    } else if (dtype == 0) {
        head_rms_norm<float>(static_cast<float*>(x), row_stride, tokens, heads, head_dim,
                             static_cast<const float*>(weight), eps, num_threads);
    } else if (dtype == 1) {
        head_rms_norm<uint16_t>(static_cast<uint16_t*>(x), row_stride, tokens, heads, head_dim,
                                static_cast<const uint16_t*>(weight), eps, num_threads);
    } else {
        return -1;
    }
    return 0;
}

// Rotary embedding in place on the first num_heads heads of each row (HF rotate-half layout).
int pagellm_rotary(void* x, int64_t row_stride, int64_t rows, int64_t num_heads, int64_t head_dim, int64_t rotary_dim,
                   const void* cos, const void* sin, int dtype, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (rotary_dim % 2 != 0 || rotary_dim <= 0 || rotary_dim > head_dim) return -1;
    if (dtype == 0) {
        rotary<float>(static_cast<float*>(x), row_stride, rows, num_heads, head_dim, rotary_dim,
                      static_cast<const float*>(cos), static_cast<const float*>(sin), num_threads);
    } else if (dtype == 1) {
        rotary<uint16_t>(static_cast<uint16_t*>(x), row_stride, rows, num_heads, head_dim, rotary_dim,
                         static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), num_threads);
    } else {
        return -1;
    }
    return 0;
}

// out[r] = index of the first maximum of row r (n elements, rows row_stride apart); a row
// with NaN gives the index of its first NaN.
int pagellm_argmax_rows(const void* x, int64_t row_stride, int64_t rows, int64_t n, int64_t* out, int dtype,
                        int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (n <= 0) return -1;
    if (dtype == 0) {
        argmax_rows<float>(static_cast<const float*>(x), row_stride, rows, n, out, num_threads);
    } else if (dtype == 1) {
        argmax_rows<uint16_t>(static_cast<const uint16_t*>(x), row_stride, rows, n, out, num_threads);
    } else {
        return -1;
    }
    return 0;
}

// Structured outputs: forbid (set to -inf) the tokens each masked row's grammar does not allow.
int pagellm_apply_token_bitmask(void* logits, int64_t row_stride, int64_t rows, int64_t n, const int32_t* bitmask,
                                int64_t words_per_row, const int64_t* mask_rows, int dtype, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (n <= 0 || words_per_row < 0) return -1;
    if (dtype == 0) {
        apply_token_bitmask<float>(static_cast<float*>(logits), row_stride, rows, n, bitmask, words_per_row, mask_rows,
                                   -std::numeric_limits<float>::infinity(), num_threads);
    } else if (dtype == 1) {
        apply_token_bitmask<uint16_t>(static_cast<uint16_t*>(logits), row_stride, rows, n, bitmask, words_per_row,
                                      mask_rows, uint16_t{0xFF80}, num_threads);
    } else {
        return -1;
    }
    return 0;
}

}  // extern "C"
