// AVX-512 BF16 helpers shared by the kernel sources (header-only, internal linkage).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGELLM_AVX512_BF16 1

static inline __m512 bf16x16_to_float(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 rounded to bfloat16 (round to nearest even, as torch's casts), stored or widened
// back: what a bf16 tensor op does to its float32 result.
static inline void store_bf16x16(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
static inline __m512 round_bf16x16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

#endif
