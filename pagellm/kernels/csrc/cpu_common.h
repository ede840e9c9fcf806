// What the CPU kernel sources share: element conversions (bf16, fp8 e4m3, int8 rows), the exp used by
// every softmax, and typed element access. Header-only, internal linkage in each source.
//
// The kernels are built on first use by pagellm/kernels/build.py and called via ctypes: a plain
// C ABI (no torch headers, so the build takes about a second). Tensors arrive as raw pointers
// with their row strides; Python checks shapes, dtypes and strides before calling. dtype codes:
// 0 = float32, 1 = bfloat16. Parallel with OpenMP; the process shares torch's libgomp (same
// SONAME), and the thread count is passed in by the caller.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "bf16_simd.h"
namespace {


// The elementwise kernels (K/V write, norm, rotary) stay on the calling thread below this many
// rows: a few rows take less than waking a second thread, and a parallel region stalls whenever
// another process holds one of the cores (a loaded server). At a batch-64 decode step the work
// is worth splitting: with 256 here the step's 61 norms, 30 rotaries and 30 K/V writes took
// 6.2 ms, with 32 4.6-5.1 ms (the other thread is already awake between the step's GEMMs).
constexpr int64_t kMinParallelRows = 32;

inline float bf16_to_float(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even, as torch does when it casts float32 to bfloat16.
inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// 2^n for a whole n in [-126, 127] (a float holding an integer), built from its exponent bits.
inline float exp2_int(float n) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return scale;
}

// exp(x) for x <= 0 (softmax after subtracting the max), written as plain arithmetic so the
// compiler vectorizes the loop around it (a libm call would not be). Range reduction to
// 2^n * 2^f with f in [0, 1) and a degree-6 polynomial: relative error < 1e-5 on [-87, 0]
// (far below the bfloat16 rounding of the attention output).
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_floorf(t);
    const float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6188865e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022657e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return p * exp2_int(n);
}

// exp(x) for x <= 0 to about 1 ulp (Cephes' expf: Cody-Waite reduction by ln 2 with a rounded
// n, degree-5 polynomial), still plain arithmetic that vectorizes: the float32 attention's
// softmax, where exp_nonpositive's 1e-5 would be 100 times float32's rounding and could flip
// a greedy token against the reference.
inline float exp_nonpositive_precise(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * exp2_int(n);
}

// float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, NaN =
// 0x7f / 0xff; largest finite 448): the fp8 KV cache's format. Every e4m3 value is a bfloat16
// value, so decoding is exact. Bits of the bf16 equal to the subnormals m * 2^-9, m = 0..7:
constexpr uint16_t kE4m3Subnormals[8] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};

constexpr uint16_t e4m3_to_bf16_bits(uint8_t b) {
    const uint16_t mag = b & 0x7f;
    const uint16_t r = mag == 0x7f ? 0x7fc0 : mag >= 8 ? static_cast<uint16_t>((mag << 4) + (120 << 7)) : kE4m3Subnormals[mag];
    return static_cast<uint16_t>(r | ((b & 0x80) << 8));
}

// As torch casts to float8_e4m3fn: round to nearest even; finite values beyond 448 and
// infinities saturate to +-448; NaN stays NaN.
inline uint8_t float_to_e4m3(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
    const float a = std::fabs(f);
    if (a != a) return static_cast<uint8_t>(sign | 0x7f);
    const float c = a < 448.0f ? a : 448.0f;
    if (c < 0.015625f) return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(c * 512.0f)));  // m * 2^-9
    std::memcpy(&u, &c, sizeof u);
    u += 0x7ffffu + ((u >> 20) & 1u);  // drop 20 mantissa bits, to nearest even
    return static_cast<uint8_t>(sign | ((u >> 20) - (120u << 3)));  // exponent bias 127 -> 7
}

template <typename T> struct Elem;
template <> struct Elem<float> {
    static inline float load(const float* p, int64_t i) { return p[i]; }
    static inline void store(float* p, int64_t i, float v) { p[i] = v; }
};
template <> struct Elem<uint16_t> {
    static inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
    static inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
};
template <> struct Elem<uint8_t> {  // an fp8 (e4m3) cache element, read only (written by write_kv)
    static inline float load(const uint8_t* p, int64_t i) { return bf16_to_float(e4m3_to_bf16_bits(p[i])); }
};
template <> struct Elem<int8_t> {  // an int8 cache's code, read only: its row's scale applies after
    static inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
};

// An int8 KV cache row (--kv-cache-dtype int8) is a head's D codes, then its float32 scale in
// kKvScaleBytes bytes: value = code * scale, scale = amax / 127, code = round-half-even(x * (127 /
// amax)) (pagellm/attention/backend.py's quantize_int8_rows, bit for bit). Rows of other caches
// are their D values. Integers up to 256 are bf16 values, so codes widen to bf16 exactly, and a
// kernel multiplies each score by its key row's scale and each weight by its value row's.
constexpr int64_t kKvScaleBytes = 4;

template <typename KV>
constexpr int64_t kv_row(int64_t D) {  // elements between the rows of two heads
    return std::is_same_v<KV, int8_t> ? D + kKvScaleBytes : D;
}

inline float kv_row_scale(const int8_t* row, int64_t D) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
}

// The attention and K/V-write kernels' dtype codes (library.py's CACHE_CODES): run(T{}, KV{}) with
// the query / K/V element type T and the cache element type KV of `code`; false for an unknown code.
// 0 float32, 1 bf16, 2 bf16 over fp8 (e4m3), 3 bf16 and 4 float32 over int8 rows.
template <typename F>
inline bool with_cache_types(int code, F&& run) {
    switch (code) {
        case 0: run(float{}, float{}); return true;
        case 1: run(uint16_t{}, uint16_t{}); return true;
        case 2: run(uint16_t{}, uint8_t{}); return true;
        case 3: run(uint16_t{}, int8_t{}); return true;
        case 4: run(float{}, int8_t{}); return true;
        default: return false;
    }
}

// D values -> one int8 row (codes, then the scale). A row holding NaN gets codes 0 and a NaN
// scale, so every read of it is NaN (as a NaN key or value makes attention NaN); infinities give
// an infinite scale and NaN reads.
template <typename T>
inline void quantize_kv_row(const T* src, int8_t* dst, int64_t D) {
    float amax = 0.f;
    bool nan = false;
    for (int64_t d = 0; d < D; ++d) {
        const float a = std::fabs(Elem<T>::load(src, d));
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    if (nan) amax = NAN;  // then inv = 0 (all codes 0) and the scale NaN, as in torch
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        float c = std::nearbyint(Elem<T>::load(src, d) * inv);
        c = c > 127.f ? 127.f : c < -127.f ? -127.f : c;
        dst[d] = static_cast<int8_t>(c == c ? c : 0.f);
    }
    const float scale = amax / 127.f;
    std::memcpy(dst + D, &scale, sizeof scale);
}

}  // namespace
