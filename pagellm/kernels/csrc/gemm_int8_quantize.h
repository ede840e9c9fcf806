// The integer GEMM's activation quantization (gemm_int8.cpp): each row of A cut into blocks of 32
// along k and quantized per block to int8 as llama.cpp's Q8_0, with each block's sum (and its first
// half's, for q6k). Included by gemm_int8.cpp inside its anonymous namespace, after kBlock.
#pragma once

// A's rows quantized: q [m][blocks * 32] int8, d [m][blocks], sum(q) [m][blocks] and the sum
// of each block's first 16 (q6k's halves). With a scale per super-block (`super_scale`: q4k's and
// q6k's, as llama.cpp's Q8_K), d holds each super-block's scale in all 8 of its blocks.
struct QuantizedA {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> sum;
    std::vector<int32_t> sum_lo;
    std::vector<int16_t> sum16;  // with a scale per super-block: sum(q) again as int16 (|sum| <= 32 * 127), for vpdpwssd
    int64_t blocks = 0;
    bool super_scale = false;
};

// The largest magnitude of 32 values, and whether one of them is NaN.
inline float block_amax(const float* x, bool& nan) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        nan |= x[i] != x[i];
    }
    return amax;
}

// A scale from its group's largest magnitude. A NaN in the group: scale NaN, so the row's outputs
// are NaN (as the dense GEMMs give), not finite garbage.
inline float block_scale(float amax, bool nan) { return nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f; }
inline float inverse_scale(float scale) { return scale == scale && scale != 0.0f ? 1.0f / scale : 0.0f; }

// One block of 32 values to int8 codes at 1 / scale `inv`: q, sum(q) (`total`) and the sum of its
// first 16 (`low`).
inline void block_codes(const float* x, float inv, int8_t* q, int32_t& total, int32_t& low) {
    total = 0;
    for (int i = 0; i < kBlock; ++i) {
        const float v = std::nearbyint(x[i] * inv);  // ties to even (the default rounding mode)
        const int32_t qi = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
        q[i] = static_cast<int8_t>(qi);
        total += qi;
        if (i == kBlock / 2 - 1) low = total;
    }
}

#ifdef __AVX2__
// The same, 8 lanes at a time, with the same operations (so the same bits): the scalar loop
// took ~1 ns a value, a tenth of a small batch's GEMM time.
inline float block_amax_avx2(const float* x, bool& nan) {
    __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.0f;
    for (float l : lanes) m = std::max(m, l);
    nan |= _mm256_movemask_ps(unordered) != 0;
    return m;
}

inline void block_codes_avx2(const float* x, float inv, int8_t* q, int32_t& total, int32_t& low) {
    __m256i c[4], sum = _mm256_setzero_si256(), sum_low = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), _mm256_set1_ps(inv)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // max(r, -127) gives -127 for a NaN r, as std::max(-127.0f, r) does.
        const __m256 clamped = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        c[j] = _mm256_cvttps_epi32(clamped);
        sum = _mm256_add_epi32(sum, c[j]);
        if (j == 1) sum_low = sum;
    }
    // int32 -> int8 packs interleave 4-value groups per 128-bit lane; the permute restores order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    alignas(32) int32_t parts[8], low_parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
    _mm256_store_si256(reinterpret_cast<__m256i*>(low_parts), sum_low);
    total = 0, low = 0;
    for (int j = 0; j < 8; ++j) total += parts[j], low += low_parts[j];
}
#define PAGELLM_BLOCK_AMAX block_amax_avx2
#define PAGELLM_BLOCK_CODES block_codes_avx2
#else
#define PAGELLM_BLOCK_AMAX block_amax
#define PAGELLM_BLOCK_CODES block_codes
#endif

// Block b of a row of A (float32 or bf16, k values) as float32 in x[32], a tail padded with zeros;
// returns where the block's values are (x, or the row itself).
template <bool kBf16>
const float* block_values(const void* a, int64_t k, int64_t b, float* x) {
    const int64_t k0 = b * kBlock, n = std::min<int64_t>(kBlock, k - k0);
#ifdef __AVX2__
    if (kBf16 && n == kBlock) {  // bf16 -> float32: the bits shifted up, 8 at a time
        const auto* src = static_cast<const uint16_t*>(a) + k0;
        for (int j = 0; j < kBlock; j += 8) {
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
            _mm256_storeu_ps(x + j, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
        return x;
    }
#endif
    if (!kBf16 && n == kBlock) return static_cast<const float*>(a) + k0;
    for (int64_t i = 0; i < kBlock; ++i) {
        if (i >= n) {
            x[i] = 0.0f;
        } else if constexpr (kBf16) {
            x[i] = bf16_to_float(static_cast<const uint16_t*>(a)[k0 + i]);
        } else {
            x[i] = static_cast<const float*>(a)[k0 + i];
        }
    }
    return x;
}

// One row of A (float32 or bf16, k values) to int8 blocks, one scale per `group` blocks (1, or a
// super-block's 8: its largest magnitude over 256 values, as llama.cpp's Q8_K).
template <bool kBf16>
void quantize_row(const void* a, int64_t k, int64_t blocks, int group, int8_t* q, float* d, int32_t* sum,
                  int32_t* sum_lo) {
    alignas(32) float x[8 * kBlock];
    const float* values[8];
    for (int64_t b0 = 0; b0 < blocks; b0 += group) {
        const int count = static_cast<int>(std::min<int64_t>(group, blocks - b0));
        float amax = 0.0f;
        bool nan = false;
        for (int j = 0; j < count; ++j) {
            values[j] = block_values<kBf16>(a, k, b0 + j, x + j * kBlock);
            amax = std::max(amax, PAGELLM_BLOCK_AMAX(values[j], nan));
        }
        const float scale = block_scale(amax, nan), inv = inverse_scale(scale);
        for (int j = 0; j < count; ++j) {
            d[b0 + j] = scale;
            PAGELLM_BLOCK_CODES(values[j], inv, q + (b0 + j) * kBlock, sum[b0 + j], sum_lo[b0 + j]);
        }
    }
}

// `out` holds m rows rounded up to `row_multiple`; the added rows are zeros (scale 0).
void quantize_rows(const void* a, int64_t lda, int64_t m, int64_t k, bool bf16, QuantizedA& out, int threads,
                   int64_t row_multiple = 1, bool super_scale = false) {
    const int64_t blocks = (k + kBlock - 1) / kBlock;
    const int64_t rows = (m + row_multiple - 1) / row_multiple * row_multiple;
    out.blocks = blocks;
    out.super_scale = super_scale;
    const int group = super_scale ? 8 : 1;
    out.q.assign(static_cast<size_t>(rows * blocks * kBlock), 0);
    out.d.assign(static_cast<size_t>(rows * blocks), 0.0f);
    out.sum.assign(static_cast<size_t>(rows * blocks), 0);
    out.sum_lo.assign(static_cast<size_t>(rows * blocks), 0);
    out.sum16.assign(super_scale ? static_cast<size_t>(rows * blocks) : 0, 0);
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; ++r) {
        const void* row = static_cast<const char*>(a) + r * lda * elem;
        int8_t* q = out.q.data() + r * blocks * kBlock;
        float* d = out.d.data() + r * blocks;
        int32_t *sum = out.sum.data() + r * blocks, *sum_lo = out.sum_lo.data() + r * blocks;
        if (bf16) {
            quantize_row<true>(row, k, blocks, group, q, d, sum, sum_lo);
        } else {
            quantize_row<false>(row, k, blocks, group, q, d, sum, sum_lo);
        }
        if (super_scale)
            for (int64_t b = 0; b < blocks; ++b) out.sum16[r * blocks + b] = static_cast<int16_t>(sum[b]);
    }
}
