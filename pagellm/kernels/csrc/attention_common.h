// What the paged attention paths share: walking a request's context through its block table
// (with prefetching), and the generic attend_one every CPU can run. Header-only, included by
// attention.cpp and its ISA paths (attention_avx512.h, attention_avx2.h).
#pragma once

#include "avx2_simd.h"
#include "cpu_common.h"

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = Elem<T>::load(src, d);
}

// Context rows are prefetched this many positions ahead, into L2: blocks are scattered, so the
// hardware prefetchers lose the stream at every block edge. Measured on a 2-core Zen 4 VM,
// decode attention over 64 x 192 positions, 30 layers' caches in turn, 2 threads, per step:
// 16 ahead into L1 18.6 ms; 16 / 32 / 48 / 64 ahead into L2 16.6 / 15.4 / 15.7 / 16.5 ms.
constexpr int64_t kPrefetchDistance = 32;

constexpr int64_t kFetchValuesMaxBytes = 64 << 10;  // see attend_one_avx512

constexpr int64_t kAmxTileRows = 16;  // query rows per AMX prefill tile (the score tile's columns)

template <typename T>
inline void prefetch_row(const T* cache, const int64_t* block_table, int64_t pos, int64_t block_size,
                         int64_t row_stride, int64_t offset, int64_t bytes) {
    const char* p = reinterpret_cast<const char*>(
        cache + (block_table[pos / block_size] * block_size + pos % block_size) * row_stride + offset);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// visit(position, row) for positions [start, ctx) of one KV head's context, walking the block
// table and (kPrefetch) prefetching the row kPrefetchDistance positions ahead. A sliding window
// starts the walk past 0: positions before it are never read (their blocks may be released).
template <bool kPrefetch = true, typename T, typename F>
inline void for_each_context_row(const T* cache, const int64_t* block_table, int64_t start, int64_t ctx,
                                 int64_t block_size, int64_t row_stride, int64_t offset, int64_t row_bytes,
                                 F&& visit) {
    for (int64_t p0 = start; p0 < ctx;) {
        const int64_t i0 = p0 % block_size;
        const T* base = cache + block_table[p0 / block_size] * block_size * row_stride + offset;
        const int64_t n = ctx - p0 < block_size - i0 ? ctx - p0 : block_size - i0;
        for (int64_t i = 0; i < n; ++i) {
            if (kPrefetch && p0 + i + kPrefetchDistance < ctx)
                prefetch_row(cache, block_table, p0 + i + kPrefetchDistance, block_size, row_stride, offset, row_bytes);
            visit(p0 + i, base + (i0 + i) * row_stride);
        }
        p0 += n;
    }
}

// The factor a cache row's values carry: an int8 row's scale (kv_row_scale), 1 for the others,
// whose elements are the values themselves (multiplying by it is exact, and compiled away).
template <typename KV>
inline float row_scale(const KV* row, int64_t D) {
    if constexpr (std::is_same_v<KV, int8_t>) {
        return kv_row_scale(row, D);
    } else {
        (void)row, (void)D;
        return 1.f;
    }
}

// Scores capped as Gemma 2 caps them, cap * tanh(s / cap), between the scale and the softmax;
// cap <= 0: none. 8 at a time where the build has AVX2 (a scalar tanh per score cost Gemma 2's
// prefill attention more than its dot products).
inline void cap_scores(float* s, int64_t n, float cap) {
    if (!(cap > 0.f)) return;
    int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vcap = _mm256_set1_ps(cap);
    for (; p + 8 <= n; p += 8)
        _mm256_storeu_ps(s + p, _mm256_mul_ps(tanh_x8(_mm256_div_ps(_mm256_loadu_ps(s + p), vcap)), vcap));
#endif
    for (; p < n; ++p) s[p] = std::tanh(s[p] / cap) * cap;
}

// A head's sink logit (gpt-oss: one more logit in its softmax, over no value); -inf: none.
inline float sink_of(const float* sinks, int64_t head) { return sinks != nullptr ? sinks[head] : -INFINITY; }

// What a sink adds to a softmax's sum of exp(score - m): exp(sink - m), 0 for none.
inline float sink_term(float sink, float m) { return sink == -INFINITY ? 0.f : std::exp(sink - m); }

// One (query row, KV head) pair: the G query heads sharing KV head `kvh` attend over positions
// [start, ctx) of the request's context (start > 0 under a sliding window), read in place
// through its block table, scores capped by `softcap` where it is > 0.
// Three passes over the context (scores, softmax, weighted values) keep K and V reads
// sequential within each block and need no online-softmax rescaling. KV: the cache's element
// type (T, uint8_t for an fp8 cache, int8_t for an int8 one: each score times its key row's
// scale, each weight times its value row's).
template <typename T, typename KV = T>
void attend_one(const T* q_row, T* out_row, const KV* key_cache, const KV* value_cache,
                const int64_t* block_table, int64_t start, int64_t ctx, int64_t kvh, int64_t group,
                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                const float* sinks, std::vector<float>& scores, std::vector<float>& work) {
    const int64_t D = head_dim;
    const int64_t len = ctx - start;
    const int64_t G = group;
    work.resize(static_cast<size_t>(G * D * 2 + D));
    float* qf = work.data();       // [G, D] scaled queries
    float* acc = qf + G * D;       // [G, D] weighted value sums
    float* row = acc + G * D;      // [D] one key or value row in float32
    scores.resize(static_cast<size_t>(G * len));
    float* s = scores.data();      // [G, len]

    for (int64_t g = 0; g < G; ++g) {
        const T* qh = q_row + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = Elem<T>::load(qh, d) * scale;
    }
    const int64_t head_row = kv_row<KV>(D);
    const int64_t row_stride = num_kv_heads * head_row;  // elements between positions of one block
    const int64_t row_bytes = head_row * int64_t{sizeof(KV)};

    for_each_context_row(key_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, row_bytes,
                         [&](int64_t p, const KV* kp) {
                             load_row(kp, row, D);
                             const float ks = row_scale(kp, D);
                             for (int64_t g = 0; g < G; ++g) {
                                 const float* qg = qf + g * D;
                                 float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                                 for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
                                 s[g * len + p - start] = dot * ks;
                             }
                         });

    float inv_sum[64];
    std::vector<float> inv_sum_big;
    float* inv = inv_sum;
    if (G > 64) {
        inv_sum_big.resize(static_cast<size_t>(G));
        inv = inv_sum_big.data();
    }
    for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * len;
        cap_scores(sg, len, softcap);
        float m = -INFINITY;
        for (int64_t p = 0; p < len; ++p) m = sg[p] > m ? sg[p] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; ++p) {
            const float e = std::is_same_v<T, float> ? exp_nonpositive_precise(sg[p] - m) : exp_nonpositive(sg[p] - m);
            sg[p] = e;
            sum += e;
        }
        inv[g] = 1.f / (sum + sink_term(sink_of(sinks, kvh * G + g), m));
    }

    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(G * D));
    for_each_context_row(value_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, row_bytes,
                         [&](int64_t p, const KV* vp) {
                             load_row(vp, row, D);
                             const float vs = row_scale(vp, D);
                             for (int64_t g = 0; g < G; ++g) {
                                 const float w = s[g * len + p - start] * vs;
                                 float* ag = acc + g * D;
#pragma omp simd
                                 for (int64_t d = 0; d < D; ++d) ag[d] += w * row[d];
                             }
                         });
    for (int64_t g = 0; g < G; ++g) {
        T* oh = out_row + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) Elem<T>::store(oh, d, acc[g * D + d] * inv[g]);
    }
}

}  // namespace
