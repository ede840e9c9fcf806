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
//   B: part after part, each part's output columns in chunks of 64, zero past the part's last
//      column: float32 [chunks][rank][64]; bf16 [chunks][rank / 2][64][2] (pairs of rank rows,
//      the rank rounded up to even): a chunk's 64 outputs read contiguous values.
// Sums: each shrunk value is two chains over k (then the lanes in a fixed order), rounded to the
// dtype; each output one chain over the part's rank. Neither order depends on the register
// tile, the number of rows or threads: a row's result is the same in any batch. bf16 on CPUs
// with AVX-512 BF16 multiplies pairs of bf16 with `vdpbf16ps` (no widening, 32 products an
// instruction: 3-4x the AVX2 rate at 16 rows); its sums are that instruction's, the same in
// every batch too.

#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "avx2_simd.h"
#include "bf16_simd.h"
#include "cpu_common.h"
#include "exports.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kChunk = 64;                   // B's output columns per chunk (8 accumulators)
constexpr int64_t kMinParallelMacs = 1 << 13;    // below this (rows x width x k) one thread does it
constexpr int64_t kFewRows = 32;                 // up to this many rows the threads split A and B

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

// s[i * si + r * sr] = x[i] . A[r] (k values) for RM rows of x (float32, k apart) and RA rows of
// A (elem-sized rows k apart), each rounded to the dtype. RM x RA x 2 accumulators: one row of
// x takes 4 rows of A (8 chains, enough to hide the FMA latency), two rows 2 (the widened A
// shared by both). `next`: the next tile's rows, prefetched as far as this one has come.
template <int RM, int RA, bool kBf16>
void shrink_tile(const float* x, const char* a, int64_t k, float* s, int64_t si, int64_t sr, const char* next) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    __m256 acc[RM][RA][2];
    for (int i = 0; i < RM; ++i)
        for (int r = 0; r < RA; ++r) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        if (next != nullptr)
            for (int r = 0; r < RA; ++r) _mm_prefetch(next + (r * k + c) * kElem, _MM_HINT_T0);
        for (int r = 0; r < RA; ++r) {
            const char* row = a + (r * k + c) * kElem;
            const __m256 w0 = load_w<kBf16>(row), w1 = load_w<kBf16>(row + 8 * kElem);
            for (int i = 0; i < RM; ++i) {
                acc[i][r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + c), w0, acc[i][r][0]);
                acc[i][r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + c + 8), w1, acc[i][r][1]);
            }
        }
    }
    for (int half = 0; c < k; c += 8, half ^= 1)  // the tail: zero-filled lanes past k
        for (int r = 0; r < RA; ++r) {
            const __m256 w = load8<kBf16>(a + (r * k + c) * kElem, k - c);
            for (int i = 0; i < RM; ++i)
                acc[i][r][half] = _mm256_fmadd_ps(load8<false>(x + i * k + c, k - c), w, acc[i][r][half]);
        }
    for (int i = 0; i < RM; ++i)
        for (int r = 0; r < RA; ++r) {
            const float v = sum_lanes(_mm256_add_ps(acc[i][r][0], acc[i][r][1]));
            s[i * si + r * sr] = kBf16 ? bf16_to_float(float_to_bf16(v)) : v;
        }
}

// out[i][0, cols) += round(sum over rank of s[i * si + j * sj] * chunk[j][first, first + 8V))
// for RM rows (out rows `ldo` bytes apart; cols <= 8V), as torch's add_: RM x V accumulators
// (V = 8: one row, a whole 64-column chunk; V = 4: two rows, half of one). `next`: the next
// chunk, prefetched a row of it for each row of this one.
template <int RM, int V, bool kBf16>
void expand_tile(const float* s, int64_t si, int64_t sj, const char* chunk, int64_t first, int64_t rank, char* out,
                 int64_t ldo, int64_t cols, const char* next) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    constexpr int64_t kStep = kBf16 ? 2 : 1;  // rank rows a packed row holds
    __m256 acc[RM][V];
    for (int i = 0; i < RM; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; j += kStep) {
        const char* row = chunk + (j * kChunk + first * kStep) * kElem;
        if (next != nullptr)
            for (int64_t line = 0; line < kChunk * kStep * kElem; line += 64) _mm_prefetch(next + j * kChunk * kElem + line, _MM_HINT_T0);
        if constexpr (kBf16) {  // 8 columns' (j, j + 1) pairs a load: `<< 16` widens j, `& ~0xffff` j + 1
            __m256 even[V], odd[V];
            for (int v = 0; v < V; ++v) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + v * 16 * kElem));
                even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                odd[v] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
            }
            for (int i = 0; i < RM; ++i) {
                const __m256 s0 = _mm256_set1_ps(s[i * si + j * sj]);
                const __m256 s1 = _mm256_set1_ps(j + 1 < rank ? s[i * si + (j + 1) * sj] : 0.0f);
                for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(s1, odd[v], _mm256_fmadd_ps(s0, even[v], acc[i][v]));
            }
        } else {
            __m256 w[V];
            for (int v = 0; v < V; ++v) w[v] = load_w<false>(row + v * 8 * kElem);
            for (int i = 0; i < RM; ++i) {
                const __m256 sv = _mm256_set1_ps(s[i * si + j * sj]);
                for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(sv, w[v], acc[i][v]);
            }
        }
    }
    for (int i = 0; i < RM; ++i)
        for (int v = 0; v < V && v * 8 < cols; ++v) {
            __m256 d = acc[i][v];
            if constexpr (kBf16) d = round_bf16x8(d);
            char* at = out + i * ldo + v * 8 * kElem;
            store8<kBf16>(at, _mm256_add_ps(load8<kBf16>(at, cols - v * 8), d), cols - v * 8);
        }
}

#if defined(PAGELLM_AVX512_BF16)
constexpr bool kDotBf16 = true;  // bf16 products on vdpbf16ps

// shrink_tile for bf16 rows x (k apart, as they are) on vdpbf16ps: two chains of 32 values of k.
template <int RM, int RA>
void shrink_tile_dp(const uint16_t* x, const char* a, int64_t k, float* s, int64_t si, int64_t sr, const char* next) {
    __m512 acc[RM][RA][2];
    for (int i = 0; i < RM; ++i)
        for (int r = 0; r < RA; ++r) acc[i][r][0] = acc[i][r][1] = _mm512_setzero_ps();
    const auto* w = reinterpret_cast<const uint16_t*>(a);
    int64_t c = 0;
    for (; c + 64 <= k; c += 64) {
        if (next != nullptr)
            for (int r = 0; r < RA; ++r) {
                _mm_prefetch(next + (r * k + c) * 2, _MM_HINT_T0);
                _mm_prefetch(next + (r * k + c) * 2 + 64, _MM_HINT_T0);
            }
        for (int r = 0; r < RA; ++r) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + r * k + c);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + r * k + c + 32);
            for (int i = 0; i < RM; ++i) {
                acc[i][r][0] = _mm512_dpbf16_ps(acc[i][r][0], (__m512bh)_mm512_loadu_si512(x + i * k + c), w0);
                acc[i][r][1] = _mm512_dpbf16_ps(acc[i][r][1], (__m512bh)_mm512_loadu_si512(x + i * k + c + 32), w1);
            }
        }
    }
    for (int half = 0; c < k; c += 32, half ^= 1) {  // the tail: zeros past k
        const __mmask32 mask = k - c >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k - c)) - 1;
        for (int r = 0; r < RA; ++r) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + c);
            for (int i = 0; i < RM; ++i)
                acc[i][r][half] = _mm512_dpbf16_ps(acc[i][r][half], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + c), wv);
        }
    }
    for (int i = 0; i < RM; ++i)
        for (int r = 0; r < RA; ++r)
            s[i * si + r * sr] = bf16_to_float(float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc[i][r][0], acc[i][r][1]))));
}

// The bf16 bits of s (a value already rounded to bf16).
inline uint32_t bf16_bits_of(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u >> 16;
}

// expand_tile for bf16 on vdpbf16ps: Z registers of 16 columns a row (4: a whole chunk; 2: half).
template <int RM, int Z>
void expand_tile_dp(const float* s, int64_t si, int64_t sj, const char* chunk, int64_t first, int64_t rank, char* out,
                    int64_t ldo, int64_t cols, const char* next) {
    __m512 acc[RM][Z];
    for (int i = 0; i < RM; ++i)
        for (int z = 0; z < Z; ++z) acc[i][z] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; j += 2) {
        const auto* row = reinterpret_cast<const uint16_t*>(chunk) + j * kChunk + first * 2;
        if (next != nullptr)
            for (int64_t line = 0; line < kChunk * 4; line += 64) _mm_prefetch(next + j * kChunk * 2 + line, _MM_HINT_T0);
        __m512bh w[Z];
        for (int z = 0; z < Z; ++z) w[z] = (__m512bh)_mm512_loadu_si512(row + z * 32);
        for (int i = 0; i < RM; ++i) {
            const uint32_t odd = j + 1 < rank ? bf16_bits_of(s[i * si + (j + 1) * sj]) : 0;
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_bits_of(s[i * si + j * sj]) | odd << 16));
            for (int z = 0; z < Z; ++z) acc[i][z] = _mm512_dpbf16_ps(acc[i][z], pair, w[z]);
        }
    }
    for (int i = 0; i < RM; ++i)
        for (int z = 0; z < Z && z * 16 < cols; ++z) {
            const __mmask16 mask = first_lanes(cols - z * 16);
            auto* at = reinterpret_cast<uint16_t*>(out + i * ldo) + z * 16;
            const __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at)), 16));
            const __m512 sum = _mm512_add_ps(o, round_bf16x16(acc[i][z]));
            _mm256_mask_storeu_epi16(at, mask, (__m256i)_mm512_cvtneps_pbh(sum));
        }
}
#else
constexpr bool kDotBf16 = false;
#endif

// How a thread holds its rows of x for the shrink: bf16 as they are on vdpbf16ps, else float32.
template <bool kBf16>
using Staged = std::conditional_t<kBf16 && kDotBf16, uint16_t, float>;

// Rows [i, i + RM) (RM 1 or 2) of the staged x through A's rows [r0, r0 + 4) (fewer at A's end)
// into s[i * si + r * sr].
template <int RM, bool kBf16>
void shrink_rows(const Staged<kBf16>* x, const char* a, int64_t width, int64_t k, int64_t r0, float* s, int64_t si,
                 int64_t sr, const char* next) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    const char* rows = a + r0 * k * kElem;
    float* out = s + r0 * sr;
#if defined(PAGELLM_AVX512_BF16)
    if constexpr (kBf16) {
        if (r0 + 4 <= width) {
            shrink_tile_dp<RM, 4>(x, rows, k, out, si, sr, next);
        } else {
            for (int64_t r = r0; r < width; ++r) shrink_tile_dp<RM, 1>(x, a + r * k * kElem, k, s + r * sr, si, sr, nullptr);
        }
        return;
    }
#endif
    if constexpr (!(kBf16 && kDotBf16)) {
        if (r0 + 4 <= width && RM == 1) {
            shrink_tile<1, 4, kBf16>(x, rows, k, out, si, sr, next);
        } else if (r0 + 4 <= width) {
            shrink_tile<RM, 2, kBf16>(x, rows, k, out, si, sr, next);
            shrink_tile<RM, 2, kBf16>(x, rows + 2 * k * kElem, k, out + 2 * sr, si, sr, nullptr);
        } else {
            for (int64_t r = r0; r < width; ++r) shrink_tile<RM, 1, kBf16>(x, a + r * k * kElem, k, s + r * sr, si, sr, nullptr);
        }
    }
}

// Rows [i, i + RM) through B's chunk (its part's s values s[i * si + j * sj]) into out (rows ldo
// bytes apart) at the chunk's columns.
template <int RM, bool kBf16>
void expand_rows(const float* s, int64_t si, int64_t sj, const char* chunk, int64_t rank, char* out, int64_t ldo,
                 int64_t cols, const char* next) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
#if defined(PAGELLM_AVX512_BF16)
    if constexpr (kBf16) {
        if (RM == 1) {
            expand_tile_dp<1, 4>(s, si, sj, chunk, 0, rank, out, ldo, cols, next);
        } else {
            expand_tile_dp<RM, 2>(s, si, sj, chunk, 0, rank, out, ldo, std::min<int64_t>(32, cols), next);
            if (cols > 32) expand_tile_dp<RM, 2>(s, si, sj, chunk, 32, rank, out + 32 * kElem, ldo, cols - 32, nullptr);
        }
        return;
    }
#endif
    if (RM == 1) {
        expand_tile<1, 8, kBf16>(s, si, sj, chunk, 0, rank, out, ldo, cols, next);
        return;
    }
    expand_tile<RM, 4, kBf16>(s, si, sj, chunk, 0, rank, out, ldo, std::min<int64_t>(32, cols), next);
    if (cols > 32) expand_tile<RM, 4, kBf16>(s, si, sj, chunk, 32, rank, out + 32 * kElem, ldo, cols - 32, nullptr);
}

// B's chunk c: its part and its first output column (the parts' chunks one after another).
struct ChunkPlace {
    int64_t part, col;
};
inline ChunkPlace chunk_place(const PagellmLoRALinear& L, int64_t c) {
    int64_t p = 0;
    for (;; ++p) {
        const int64_t chunks = (L.part_cols[p + 1] - L.part_cols[p] + kChunk - 1) / kChunk;
        if (c < chunks || p + 1 == L.parts) return {p, L.part_cols[p] + c * kChunk};
        c -= chunks;
    }
}

inline int64_t chunk_count(const PagellmLoRALinear& L) {
    int64_t count = 0;
    for (int64_t p = 0; p < L.parts; ++p) count += (L.part_cols[p + 1] - L.part_cols[p] + kChunk - 1) / kChunk;
    return count;
}

// The calling thread's scratch `which` of at least n values, kept from call to call: a step
// makes hundreds of these products, and their buffers' allocations showed at batch 1.
template <typename T, int which>
T* scratch(size_t n) {
    thread_local std::vector<T> buffer;
    if (buffer.size() < n) buffer.resize(n);
    return buffer.data();
}

// Rows of x as the shrink takes them (Staged), k apart.
template <bool kBf16>
void stage(const void* x, int64_t ldx, int64_t rows, int64_t k, Staged<kBf16>* out) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < k; ++c) {
            if constexpr (kBf16 && kDotBf16) out[i * k + c] = static_cast<const uint16_t*>(x)[i * ldx + c];
            else if constexpr (kBf16) out[i * k + c] = bf16_to_float(static_cast<const uint16_t*>(x)[i * ldx + c]);
            else out[i * k + c] = static_cast<const float*>(x)[i * ldx + c];
        }
}

// B's values a chunk holds per rank row (bf16: the rank rounded up to even, pairs of rows).
inline int64_t chunk_rows(int64_t rank, bool bf16) { return bf16 ? (rank + 1) / 2 * 2 : rank; }

// Up to kFewRows rows: the threads split A's rows, then B's chunks, each over all the rows (each
// thread widens the rows itself; only the shrunk values, [width][m], cross cores). A and B are
// read once, in order, from memory: at a decode step the adapters' weights are not in cache,
// and a split by rows (each thread reading all of A and B) took twice as long (NOTES.md, 66).
template <bool kBf16>
void lora_few_rows(const PagellmLoRALinear& L, const char* a, const char* b, const void* x, int64_t ldx, int64_t m,
                   int64_t k, char* out, int64_t ldo, int num_threads) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    const int64_t width = L.width, rank = L.rank, tiles = (width + 3) / 4;
    float* s = scratch<float, 0>(static_cast<size_t>(width * m));  // (shared by the threads)
    const int64_t count = chunk_count(L);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && m * width * k >= kMinParallelMacs)
    {
        Staged<kBf16>* xf = scratch<Staged<kBf16>, 1>(static_cast<size_t>(m * k));
        stage<kBf16>(x, ldx, m, k, xf);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const char* next = 4 * t + 8 <= width ? a + (4 * t + 4) * k * kElem : nullptr;
            int64_t i = 0;
            for (; i + 2 <= m; i += 2, next = nullptr)
                shrink_rows<2, kBf16>(xf + i * k, a, width, k, 4 * t, s + i, 1, m, next);
            if (i < m) shrink_rows<1, kBf16>(xf + i * k, a, width, k, 4 * t, s + i, 1, m, next);
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < count; ++c) {
            const auto [p, col] = chunk_place(L, c);
            const int64_t cols = std::min(kChunk, L.part_cols[p + 1] - col);
            const char* chunk = b + c * chunk_rows(rank, kBf16) * kChunk * kElem;
            const char* next = c + 1 < count ? chunk + chunk_rows(rank, kBf16) * kChunk * kElem : nullptr;
            const float* sp = s + p * rank * m;
            int64_t i = 0;
            for (; i + 2 <= m; i += 2, next = nullptr)
                expand_rows<2, kBf16>(sp + i, 1, m, chunk, rank, out + (i * ldo + col) * kElem, ldo * kElem, cols, next);
            if (i < m) expand_rows<1, kBf16>(sp + i, 1, m, chunk, rank, out + (i * ldo + col) * kElem, ldo * kElem, cols, next);
        }
    }
}

// More rows: each pair of rows by one thread, whole (A and B come from cache after the first
// pairs; no value crosses cores). A row's bits are the same either way: no sum depends on the
// tile, the rows it went with, or the threads.
template <bool kBf16>
void lora_many_rows(const PagellmLoRALinear& L, const char* a, const char* b, const void* x, int64_t ldx, int64_t m,
                    int64_t k, char* out, int64_t ldo, int num_threads) {
    constexpr int64_t kElem = kBf16 ? 2 : 4;
    const int64_t width = L.width, rank = L.rank;
    const int64_t count = chunk_count(L);
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<Staged<kBf16>> xf(static_cast<size_t>(2 * k));
        std::vector<float> s(static_cast<size_t>(2 * width));
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (m + 1) / 2; ++pair) {
            const int64_t i = 2 * pair, rows = std::min<int64_t>(2, m - i);
            stage<kBf16>(static_cast<const char*>(x) + i * ldx * kElem, ldx, rows, k, xf.data());
            for (int64_t r0 = 0; r0 < width; r0 += 4) {
                if (rows == 2) shrink_rows<2, kBf16>(xf.data(), a, width, k, r0, s.data(), width, 1, nullptr);
                else shrink_rows<1, kBf16>(xf.data(), a, width, k, r0, s.data(), width, 1, nullptr);
            }
            for (int64_t c = 0; c < count; ++c) {
                const auto [p, col] = chunk_place(L, c);
                const int64_t cols = std::min(kChunk, L.part_cols[p + 1] - col);
                const char* chunk = b + c * chunk_rows(rank, kBf16) * kChunk * kElem;
                char* o = out + (i * ldo + col) * kElem;
                if (rows == 2) expand_rows<2, kBf16>(s.data() + p * rank, width, 1, chunk, rank, o, ldo * kElem, cols, nullptr);
                else expand_rows<1, kBf16>(s.data() + p * rank, width, 1, chunk, rank, o, ldo * kElem, cols, nullptr);
            }
        }
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
    if (lora == nullptr || slot < 0 || slot >= lora->max_loras || m < 0 || k <= 0 || k != lora->features_in || ldx < k ||
        ldo < n || (dtype != 0 && dtype != 1))
        return -1;
    if (lora->parts < 1 || lora->parts > 4 || lora->rank < 1 || lora->width != lora->parts * lora->rank ||
        lora->part_cols[0] != 0 || lora->part_cols[lora->parts] != n || lora->dtype != dtype)
        return -1;
    for (int64_t p = 0; p < lora->parts; ++p)
        if (lora->part_cols[p + 1] <= lora->part_cols[p]) return -1;
    if (m == 0 || !lora->active[slot]) return 0;
    if (num_threads < 1) num_threads = 1;
    const auto* a = static_cast<const char*>(lora->a[slot]);
    const auto* b = static_cast<const char*>(lora->b[slot]);
    auto* o = static_cast<char*>(out);
    if (m <= kFewRows)
        dtype == 1 ? lora_few_rows<true>(*lora, a, b, x, ldx, m, k, o, ldo, num_threads)
                   : lora_few_rows<false>(*lora, a, b, x, ldx, m, k, o, ldo, num_threads);
    else
        dtype == 1 ? lora_many_rows<true>(*lora, a, b, x, ldx, m, k, o, ldo, num_threads)
                   : lora_many_rows<false>(*lora, a, b, x, ldx, m, k, o, ldo, num_threads);
    return 0;
#else
    (void)lora, (void)slot, (void)x, (void)ldx, (void)m, (void)k, (void)out, (void)ldo, (void)n, (void)dtype,
        (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
