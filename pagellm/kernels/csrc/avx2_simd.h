// AVX2 + FMA helpers shared by the AVX2 and integer GEMMs (gemm_avx2.cpp, gemm_int8.cpp) and
// attention (attention_avx2.h).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// exp(x) on 8 lanes to about 1 ulp (Cephes' expf, as gemm_bf16.cpp's exp_x16: Cody-Waite
// reduction by ln 2, degree-5 polynomial); 2^n is applied in two halves so that n in
// [-150, 128] needs no AVX-512 scalef: inf above ~88.7, 0 below ~-103.9, as expf. The clamps
// take NaN as their second operand, so NaN stays NaN (the softmax and silu rely on it).
inline __m256 exp_x8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

// tanh(x) on 8 lanes: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (exp_x8), and below
// |x| = 1/16, where 1 - e would cancel, its odd series to x^7: within a few float32 ulps of
// tanhf (attention scores' soft cap). NaN stays NaN.
inline __m256 tanh_x8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 e = exp_x8(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f)));
    const __m256 big = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(x, sign));
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(x2, _mm256_set1_ps(-17.0f / 315.0f), _mm256_set1_ps(2.0f / 15.0f));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(-1.0f / 3.0f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x2, p), x, x);
    return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.0625f), _CMP_LT_OQ));
}

// silu(x) = x / (1 + exp(-x)) on 8 lanes (the MLP activation of the GEMMs' silu_mul epilogues).
inline __m256 silu_x8(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_x8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// The bf16 nearest to each lane (ties to even, NaN stays NaN: float_to_bf16), in the lane's
// upper 16 bits.
inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), high);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }

// The first `count` (1..8) values of p (float32 or bf16) as 8 float lanes (the rest 0).
template <bool kBf16>
inline __m256 load8(const void* p, int64_t count) {
    if constexpr (kBf16) {
        __m128i h;
        if (count >= 8) {
            h = _mm_loadu_si128(static_cast<const __m128i*>(p));
        } else {
            alignas(16) uint16_t tmp[8] = {};
            std::memcpy(tmp, p, count * sizeof(uint16_t));
            h = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
        }
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if (count >= 8) {
        return _mm256_loadu_ps(static_cast<const float*>(p));
    } else {
        alignas(32) float tmp[8] = {};
        std::memcpy(tmp, p, count * sizeof(float));
        return _mm256_load_ps(tmp);
    }
}

// The first `count` (1..8) lanes of v to c[0..count) as float32 or bf16.
template <bool kBf16Out>
inline void store8(void* c, __m256 v, int64_t count) {
    if constexpr (kBf16Out) {
        const __m256i h = _mm256_srli_epi32(bf16_bits(v), 16);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        if (count >= 8) {
            _mm_storeu_si128(static_cast<__m128i*>(c), packed);
        } else {
            alignas(16) uint16_t tmp[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
            std::memcpy(c, tmp, count * sizeof(uint16_t));
        }
    } else if (count >= 8) {
        _mm256_storeu_ps(static_cast<float*>(c), v);
    } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, v);
        std::memcpy(c, tmp, count * sizeof(float));
    }
}

}  // namespace
#endif
