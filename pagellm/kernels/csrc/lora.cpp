// LoRA adapters' low-rank products added to a linear's output rows (model/lora.py, and the
// one-call decoder stack): out[i] += B (A x[i]) for the rows i of one adapter, B's product
// rounded to the activations' dtype and added as torch's `out.add_(delta)`.
//
// Why not the GEMMs: A has few rows (parts x rank, 16-48) and B few columns, so on the AVX2
// GEMM a one-row shrink ran one or two FMA chains over all of k (latency-bound), B held each
// part's block on the diagonal of a fused q/k/v or gate/up (2/3 and 1/2 of it zeros, read and
// multiplied), and each of a step's 240 products at batch 1 paid a call, a parallel region and
// its work split (4-8 us each with the weights in L2; benchmarks/NOTES.md, 66).
//
// Layouts (written by kernels/packing.py's pack_lora_b; the slot's buffers):
//   A: [width, k] row-major in the model's dtype; part p's rank rows are rows p * rank.. .
//   B: part after part, each part's output columns in chunks of 64: [chunks][rank][64], zero
//      past the part's last column: a chunk's 64 outputs read rank x 64 contiguous values.
// Sums: each shrunk value is two chains of 8 lanes over k (then the lanes in a fixed order),
// rounded to the dtype; each output one chain over the part's rank. Neither order depends on
// the number of rows or threads: a row's result is the same in any batch.

#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "avx2_simd.h"
#include "cpu_common.h"
#include "exports.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kChunk = 64;                   // B's output columns per chunk (8 accumulators)
constexpr int64_t kMinParallelMacs = 1 << 13;    // below this (rows x width x k) one thread does it

// 8 weights from p (float32 or bf16) as float lanes.
template <bool kBf16>
inline __m256 load_w(const void* p) {
    if constexpr (kBf16) {
        const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        return _mm256_loadu_ps(static_cast<const float*>(p));
    }
}

inline float sum_lanes(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// s[r] = x . A[r] (k values) for R rows of A (elem-sized rows k apart), each rounded to the dtype.
template <int R, bool kBf16>
void shrink_rows(const float* x, const char* a, int64_t k, float* s) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (int r = 0; r < R; ++r) {
            const char* row = a + (r * k + i) * kElem;
            acc[r][0] = _mm256_fmadd_ps(x0, load_w<kBf16>(row), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x1, load_w<kBf16>(row + 8 * kElem), acc[r][1]);
        }
    }
    for (int half = 0; i < k; i += 8, half ^= 1) {  // the tail: zero-filled lanes past k
        const __m256 xv = load8<false>(x + i, k - i);
        for (int r = 0; r < R; ++r) acc[r][half] = _mm256_fmadd_ps(xv, load8<kBf16>(a + (r * k + i) * kElem, k - i), acc[r][half]);
    }
    for (int r = 0; r < R; ++r) {
        const float v = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1]));
        s[r] = kBf16 ? bf16_to_float(float_to_bf16(v)) : v;
    }
}

// out[0, cols) += round(sum over rank of s[j] * chunk[j][0, 64)) (cols <= 64), as torch's add_.
template <bool kBf16>
void expand_chunk(const float* s, const char* chunk, int64_t rank, char* out, int64_t cols) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    __m256 acc[8];
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
        const __m256 sj = _mm256_set1_ps(s[j]);
        const char* row = chunk + j * kChunk * kElem;
        for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(sj, load_w<kBf16>(row + v * 8 * kElem), acc[v]);
    }
    for (int v = 0; v < 8 && v * 8 < cols; ++v) {
        __m256 d = acc[v];
        if constexpr (kBf16) d = round_bf16x8(d);
        char* at = out + v * 8 * kElem;
        store8<kBf16>(at, _mm256_add_ps(load8<kBf16>(at, cols - v * 8), d), cols - v * 8);
    }
}

// Row x (k values of the activations' dtype) through A and B into out (n values), s: width floats
// of scratch, xf: k.
template <bool kBf16>
void lora_row(const PagellmLoRALinear& L, const char* a, const char* b, const void* x, int64_t k, char* out,
              float* xf, float* s) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    const int64_t width = L.width, rank = L.rank;
    for (int64_t c = 0; c < k; ++c)
        xf[c] = kBf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[c]) : static_cast<const float*>(x)[c];
    for (int64_t r0 = 0; r0 < width; r0 += 4) {
        const char* rows = a + r0 * k * kElem;
        switch (std::min<int64_t>(4, width - r0)) {
            case 4: shrink_rows<4, kBf16>(xf, rows, k, s + r0); break;
            case 3: shrink_rows<3, kBf16>(xf, rows, k, s + r0); break;
            case 2: shrink_rows<2, kBf16>(xf, rows, k, s + r0); break;
            default: shrink_rows<1, kBf16>(xf, rows, k, s + r0); break;
        }
    }
    const char* chunk = b;
    for (int64_t p = 0; p < L.parts; ++p)
        for (int64_t col = L.part_cols[p]; col < L.part_cols[p + 1]; col += kChunk, chunk += rank * kChunk * kElem)
            expand_chunk<kBf16>(s + p * rank, chunk, rank, out + col * kElem, std::min(kChunk, L.part_cols[p + 1] - col));
}

// Each row by one thread, whole (rows split among threads: no value crosses cores; a one-row
// product stays on the calling thread, where waking a second one cost more than it saved).
template <bool kBf16>
void lora_add(const PagellmLoRALinear& L, const void* a, const void* b, const void* x, int64_t ldx, int64_t m,
              int64_t k, void* out, int64_t ldo, int num_threads) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    const bool parallel = num_threads > 1 && m > 1 && m * L.width * k >= kMinParallelMacs;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        std::vector<float> xf(static_cast<size_t>(k)), s(static_cast<size_t>(L.width));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i)
            lora_row<kBf16>(L, static_cast<const char*>(a), static_cast<const char*>(b),
                            static_cast<const char*>(x) + i * ldx * kElem, k, static_cast<char*>(out) + i * ldo * kElem,
                            xf.data(), s.data());
    }
}

}  // namespace
#endif

extern "C" {

// out[i, :n] += B(A x[i, :k]) for i < m (rows ldx / ldo apart) with slot `slot`'s A and B of
// `lora` (layouts above; dtype: the activations', A's and B's: 0 float32, 1 bf16); nothing where
// the slot does not add to this linear. Returns 0, -1 on a bad argument, -2 without AVX2/FMA.
int pagellm_lora_add(const PagellmLoRALinear* lora, int64_t slot, const void* x, int64_t ldx, int64_t m, int64_t k,
                     void* out, int64_t ldo, int64_t n, int dtype, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (lora == nullptr || slot < 0 || m < 0 || k <= 0 || ldx < k || ldo < n || (dtype != 0 && dtype != 1)) return -1;
    if (lora->parts < 1 || lora->parts > 4 || lora->rank < 1 || lora->width != lora->parts * lora->rank ||
        lora->part_cols[0] != 0 || lora->part_cols[lora->parts] != n || lora->dtype != dtype)
        return -1;
    for (int64_t p = 0; p < lora->parts; ++p)
        if (lora->part_cols[p + 1] <= lora->part_cols[p]) return -1;
    if (m == 0 || !lora->active[slot]) return 0;
    if (num_threads < 1) num_threads = 1;
    const void* a = lora->a[slot];
    const void* b = lora->b[slot];
    if (dtype == 1)
        lora_add<true>(*lora, a, b, x, ldx, m, k, out, ldo, num_threads);
    else
        lora_add<false>(*lora, a, b, x, ldx, m, k, out, ldo, num_threads);
    return 0;
#else
    (void)lora, (void)slot, (void)x, (void)ldx, (void)m, (void)k, (void)out, (void)ldo, (void)n, (void)dtype,
        (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
