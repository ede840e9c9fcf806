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

// exp(x) on 16 lanes (Cephes' expf: Cody-Waite reduction, degree-5 polynomial, about 1 ulp);
// the final scaling by 2^n gives inf above ~88.7 and 0 below ~-103.9, as expf does. The clamp
// only keeps the reduction exact for huge |x|.
static inline __m512 exp_x16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1u);
}

#endif

// AMX tiles (Sapphire Rapids and later), where the compiler targets them.
#if defined(PAGELLM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGELLM_AMX 1

struct alignas(64) AmxTileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// GCC's tile-load intrinsics are asm without a memory operand: a barrier makes sure a buffer
// just written in C++ (queries, a padded tail of A) is in memory before a tile load reads it.
static inline void amx_memory_barrier() { asm volatile("" ::: "memory"); }

// ldtilecfg from `cfg`, after the stores that filled it (the intrinsic is an asm that GCC does not
// know reads memory: without the barrier they were once scheduled after it, and it faulted).
static inline void amx_load_config(const AmxTileConfig& cfg) {
    amx_memory_barrier();
    _tile_loadconfig(&cfg);
}

// Linux hands out AMX state only to processes that ask for it (asked once per source file).
// A build without AMX (isa "avx512", -mno-amx-tile) is how a process runs the other paths.
static inline bool amx_permitted() {
    static const bool ok = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}
#endif
