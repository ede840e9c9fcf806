// float32 / bfloat16 matrix products for CPUs with AVX2 and FMA but no AVX-512 (Haswell..,
// AMD Zen 1-3): C[M, N] = A[M, K] @ W[N, K]^T, float32 accumulation.
//
// Why: there torch multiplies bf16 by emulation (~1 GFLOP/s) and fp32 through MKL's or oneDNN's
// AVX2 code, which at decode batch sizes runs well below the FMA peak (2 ports x 8 lanes).
//
// Packed weight: column panels of 16 columns (silu_mul: 8 gate then the same 8 up columns), one
// 64-byte cache line per step of k:
//   float32:  [panels][K][16]        one k, 16 columns: two ymm loads;
//   bfloat16: [panels][K / 2][16][2] columns' (k, k+1) pairs: one ymm load holds 8 columns for
//             two k; `<< 16` widens the even k, `>> 16 << 16` the odd k (3 shifts per 16
//             widened values, against 4 ops, zero-extension + shift, for a [K][16] bf16 layout).
// 16 columns = two accumulators per row; 6 rows of A make 12 accumulators, plus 2 weight
// vectors and a broadcast of A: 15 of the 16 ymm registers. (An `& 0xffff0000` mask for the odd
// k would take the 16th, and GCC then spilled: the shifts measured ~10% faster.) A 4 x 24 tile,
// the other 12-accumulator choice, would leave a packed row 96 bytes, off the cache lines.
// Below 4 rows an accumulator chain (one FMA per k, 4-5 cycles of latency) would leave the FMA
// ports idle, so 1-3 rows take 4 / 2 / 2 adjacent panels at once.
//
// Every output is one chain of FMAs in k order, whatever the tile: a row's result does not
// depend on the batch it came in, nor on the weight's dtype (bf16 widens exactly). bf16 A is
// widened to a float32 copy first (M x K, negligible next to the product).
//
// Threading and prefetch follow gemm_bf16.cpp: work items (chunk of A's rows, panel group) split
// into one range per thread with stealing from the back; the first row blocks over a panel group
// prefetch the thread's next group into L2.
//
// Measured on a Sapphire Rapids VM built for x86-64-v3, torch held to AVX2 (MKL sgemm), SmolLM2-135M
// shapes, 1 thread (the VM's second vCPU was busy with other work; AVX2 FMA peak ~110-120),
// GFLOP/s ours f32W / bf16W (f32 A) vs torch f32: M=1 qkv 9.9 / 22.2 vs 13.7, lm_head 9.6 /
// 24.1 vs 5.3; M=16 64-75 vs 27-58; M=64 62-86 vs 57-92; M=256 67-95 vs 70-106. 30 layers'
// qkv, o, gate_up+silu_mul, down on cold weights: M=1 38.8 / 21.5 ms vs 40.8; M=64 196 / 183
// ms vs 208. The fp32 tile alone runs at 97% of the FMA peak; the bf16 one at ~60% (its 6
// shifts per 24 FMAs share the FMA ports on Intel) but reads half the bytes.

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <omp.h>

#include "avx2_simd.h"
#include "cpu_common.h"
#include "exports.h"
#include "work_ranges.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int kCols = 16;     // columns per packed panel (8 outputs per silu_mul panel)
constexpr int kRows = 6;      // rows of A per register tile
constexpr int kLine = 64;     // bytes per packed step of k (float32: 1 k; bf16: 2 k)
constexpr int kPrefetchPhases = 16;
constexpr int64_t kChunkBytes = 128 << 10;  // float32 rows of A kept in L2 while panels pass

// Which part of the next panel group a row block prefetches: the lines of the packed steps s
// with s % phases == phase (none if phase < 0).
struct Prefetch {
    const char* next = nullptr;
    int64_t panel_bytes = 0;
    int phase = -1;
    int phases = 1;
};

// tile[r][g * 16 + j] = sum over k of A[r, k] * W[g * 16 + j, k] for R rows of A and G adjacent
// panels (float32 A, rows lda apart; `panel` the first panel, the next ones panel_elems on).
template <int R, int G, bool kBf16W>
void accumulate(const float* a, int64_t lda, const void* panel, int64_t k, const Prefetch& pf, float* tile) {
    constexpr int V = 2 * G;  // 8-column vectors per row
    __m256 acc[R][V];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int j = 0; j < V; ++j) acc[r][j] = _mm256_setzero_ps();
    const int64_t steps = kBf16W ? k / 2 : k, panel_elems = k * kCols;
    // Prefetched steps: pf.phase, then every pf.phases-th (kept in locals: one compare a step).
    const char* const next = pf.next;
    int64_t pf_step = next != nullptr && pf.phase >= 0 ? pf.phase : steps;
#pragma GCC unroll 2
    for (int64_t s = 0; s < steps; ++s) {
        if (s == pf_step) {
#pragma GCC unroll 16
            for (int g = 0; g < G; ++g) _mm_prefetch(next + g * pf.panel_bytes + s * kLine, _MM_HINT_T1);
            pf_step += pf.phases;
        }
        if constexpr (kBf16W) {
            const auto* w = static_cast<const uint16_t*>(panel) + s * 2 * kCols;
            __m256 x[V];
#pragma GCC unroll 16
            for (int j = 0; j < V; ++j)  // even k: the low halves
                x[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j / 2) * panel_elems + (j % 2) * 16)), 16));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m256 b = _mm256_broadcast_ss(a + r * lda + 2 * s);
#pragma GCC unroll 16
                for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(b, x[j], acc[r][j]);
            }
#pragma GCC unroll 16
            for (int j = 0; j < V; ++j)  // odd k: the high halves (two shifts: no mask register)
                x[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j / 2) * panel_elems + (j % 2) * 16)), 16), 16));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m256 b = _mm256_broadcast_ss(a + r * lda + 2 * s + 1);
#pragma GCC unroll 16
                for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(b, x[j], acc[r][j]);
            }
        } else {
            const float* w = static_cast<const float*>(panel) + s * kCols;
            __m256 x[V];
#pragma GCC unroll 16
            for (int j = 0; j < V; ++j) x[j] = _mm256_loadu_ps(w + (j / 2) * panel_elems + (j % 2) * 8);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m256 b = _mm256_broadcast_ss(a + r * lda + s);
#pragma GCC unroll 16
                for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(b, x[j], acc[r][j]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int j = 0; j < V; ++j) _mm256_storeu_ps(tile + (r * V + j) * 8, acc[r][j]);
}

using BlockFn = void (*)(const float*, int64_t, const void*, int64_t, const Prefetch&, float*);

// The tile for a block of `rows` rows of A: over one panel, or, below 4 rows, where a panel's
// 2 accumulator chains per row would leave the FMA ports waiting on their latency, over
// `group` adjacent panels (1 row x 4 panels, 2 x 2, 3 x 2: 8-12 chains).
struct Tile {
    BlockFn fn;
    int group;
};

template <bool kBf16W>
Tile tile_for(int rows, bool wide) {
    static constexpr std::array<BlockFn, kRows> kOne = {
        accumulate<1, 1, kBf16W>, accumulate<2, 1, kBf16W>, accumulate<3, 1, kBf16W>,
        accumulate<4, 1, kBf16W>, accumulate<5, 1, kBf16W>, accumulate<6, 1, kBf16W>};
    if (!wide || rows > 3) return {kOne[rows - 1], 1};
    return rows == 1 ? Tile{accumulate<1, 4, kBf16W>, 4}
                     : rows == 2 ? Tile{accumulate<2, 2, kBf16W>, 2} : Tile{accumulate<3, 2, kBf16W>, 2};
}

// Writes a finished tile (`rows` x G panels) to C at the group's first output column.
// Plain: 16 outputs per panel; silu_mul: 8, silu(gate) * up with the rounding of the unfused
// ops in C's dtype (bf16: gate, up and silu(gate) each rounded to bf16, as F.silu(g) * u).
template <bool kBf16Out>
void finish(const float* tile, int rows, int G, int epilogue, int64_t panel0, int64_t n, void* c, int64_t ldc) {
    constexpr int64_t kElem = kBf16Out ? 2 : 4;
    auto* out = static_cast<char*>(c);
    for (int r = 0; r < rows; ++r) {
        const float* t = tile + r * G * kCols;
        char* row = out + r * ldc * kElem;
        if (epilogue == 0) {
            const int64_t col0 = panel0 * kCols;
            for (int64_t x = 0; x < G * kCols && col0 + x < n; x += 8)
                store8<kBf16Out>(row + (col0 + x) * kElem, _mm256_loadu_ps(t + x), n - col0 - x);
            continue;
        }
        for (int g = 0; g < G && (panel0 + g) * 8 < n; ++g) {
            __m256 gate = _mm256_loadu_ps(t + g * kCols), up = _mm256_loadu_ps(t + g * kCols + 8);
            if constexpr (kBf16Out) gate = round_bf16x8(gate), up = round_bf16x8(up);
            __m256 act = silu_x8(gate);
            if constexpr (kBf16Out) act = round_bf16x8(act);
            const int64_t col = (panel0 + g) * 8;
            store8<kBf16Out>(row + col * kElem, _mm256_mul_ps(act, up), n - col);
        }
    }
}

// kBf16AC: A and C are bf16 (else float32).
template <bool kBf16W, bool kBf16AC>
void gemm(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c, int64_t ldc,
          int epilogue, int num_threads) {
    // Under 4 rows, one block whose tile spans G panels: the work items are groups of G panels.
    const Tile wide = tile_for<kBf16W>(static_cast<int>(std::min<int64_t>(m, kRows)), true);
    const int G = wide.group;
    const int64_t panels = (n + (epilogue ? 8 : kCols) - 1) / (epilogue ? 8 : kCols);
    const int64_t groups = (panels + G - 1) / G;
    const int64_t panel_elems = k * kCols, panel_bytes = panel_elems * (kBf16W ? 2 : 4);
    const int64_t chunk = std::max<int64_t>(kRows, kChunkBytes / (k * 4) / kRows * kRows);
    const int64_t out_elem = kBf16AC ? 2 : 4;
    // bf16 A: a float32 copy (rows k apart) that the tiles broadcast from.
    std::vector<float> a32(kBf16AC ? static_cast<size_t>(m * k) : 0);
    const float* A = kBf16AC ? a32.data() : static_cast<const float*>(a);
    const int64_t ld = kBf16AC ? k : lda;
    WorkRanges work(groups, (m + chunk - 1) / chunk, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        if constexpr (kBf16AC) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r)
                for (int64_t i = 0; i < k; ++i) a32[r * k + i] = bf16_to_float(static_cast<const uint16_t*>(a)[r * lda + i]);
        }
        alignas(32) float tile[kRows * kCols];
        const int t = omp_get_thread_num();
        for (WorkRanges::Item item; work.next(t, item);) {
            const int64_t p0 = item.panel * G;
            const int64_t count = std::min<int64_t>(G, panels - p0);
            const char* panel = static_cast<const char*>(packed) + p0 * panel_bytes;
            const int64_t m0 = item.chunk * chunk, m1 = std::min(m, m0 + chunk);
            const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
            Prefetch pf;
            pf.panel_bytes = panel_bytes;
            pf.phases = static_cast<int>(std::min<int64_t>(blocks, kPrefetchPhases));
            // The next group, unless it is a short last one (its G panels would overrun W).
            if (item.next_is_own && panels - p0 - G >= G) pf.next = panel + G * panel_bytes;
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t r0 = m0 + b * kRows;
                const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
                pf.phase = pf.next != nullptr && b < pf.phases ? static_cast<int>(b) : -1;
                const float* a_rows = A + r0 * ld;
                char* c_rows = static_cast<char*>(c) + r0 * ldc * out_elem;
                if (count == G) {
                    (G > 1 ? wide.fn : tile_for<kBf16W>(rows, false).fn)(a_rows, ld, panel, k, pf, tile);
                    finish<kBf16AC>(tile, rows, G, epilogue, p0, n, c_rows, ldc);
                    continue;
                }
                for (int64_t g = 0; g < count; ++g) {  // a short last group: one panel at a time
                    tile_for<kBf16W>(rows, false).fn(a_rows, ld, panel + g * panel_bytes, k, Prefetch{}, tile);
                    finish<kBf16AC>(tile, rows, 1, epilogue, p0 + g, n, c_rows, ldc);
                }
            }
        }
    }
}

}  // namespace
#endif

extern "C" {

// 1 when this build has the AVX2 GEMM (compiled with __AVX2__ and __FMA__), else 0.
int pagellm_gemm_avx2_available() {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

// c[m, n] = a[m, k] @ W^T on a packed W (layout above). a_dtype: 0 float32, 1 bfloat16 (c has
// a's dtype); w_dtype: 0 float32, 1 bfloat16 (needs an even k); epilogue 0 plain, 1 silu_mul
// (n = the gate/up width). Returns 0, -1 on a bad argument, -2 where the build lacks AVX2/FMA.
int pagellm_gemm_avx2(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                      int64_t ldc, int a_dtype, int w_dtype, int epilogue, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m < 0 || k <= 0 || n <= 0 || lda < k || ldc < n) return -1;
    if ((a_dtype != 0 && a_dtype != 1) || (w_dtype != 0 && w_dtype != 1) || (epilogue != 0 && epilogue != 1))
        return -1;
    if (w_dtype == 1 && k % 2 != 0) return -1;
    if (m == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    using Fn = void (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t, void*, int64_t, int, int);
    static constexpr Fn kGemm[2][2] = {{gemm<false, false>, gemm<false, true>}, {gemm<true, false>, gemm<true, true>}};
    kGemm[w_dtype][a_dtype](a, lda, m, k, packed, n, c, ldc, epilogue, num_threads);
    return 0;
#else
    (void)a, (void)lda, (void)m, (void)k, (void)packed, (void)n, (void)c, (void)ldc, (void)a_dtype, (void)w_dtype,
        (void)epilogue, (void)num_threads;
    return -2;
#endif
}

// out[r, :n] = silu(x[r, :n]) * x[r, n:2n] for r < rows (x rows 2n apart, out rows n apart; a
// gate/up projection's output): the silu_mul epilogue run apart, to the same bits, where LoRA
// adapters add to gate and up between the GEMM and the activation. dtype: 0 float32, 1 bf16.
int pagellm_silu_mul(const void* x, int64_t rows, int64_t n, void* out, int dtype, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (rows < 0 || n <= 0 || (dtype != 0 && dtype != 1)) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t elem = dtype == 1 ? 2 : 4;
    const auto* in = static_cast<const char*>(x);
    auto* dst = static_cast<char*>(out);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= (int64_t{1} << 15))
    for (int64_t r = 0; r < rows; ++r) {
        const char* gate = in + r * 2 * n * elem;
        const char* up = gate + n * elem;
        char* o = dst + r * n * elem;
        for (int64_t i = 0; i < n; i += 8) {
            if (dtype == 1) {
                const __m256 act = round_bf16x8(silu_x8(load8<true>(gate + i * 2, n - i)));
                store8<true>(o + i * 2, _mm256_mul_ps(act, load8<true>(up + i * 2, n - i)), n - i);
            } else {
                const __m256 act = silu_x8(load8<false>(gate + i * 4, n - i));
                store8<false>(o + i * 4, _mm256_mul_ps(act, load8<false>(up + i * 4, n - i)), n - i);
            }
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)n, (void)out, (void)dtype, (void)num_threads;
    return -2;
#endif
}

// out[r, :] = gelu_tanh(x[r, :] + bias) for r < rows (rows n wide; bias n values or null; out may
// be x): a vision encoder's MLP activation with its first linear's bias, in one pass. gelu_tanh(v)
// = v / 2 (1 + tanh(u)), u = sqrt(2 / pi) (v + 0.044715 v^3), computed as v / (1 + exp(-2u)) (the
// same function: one exp and one division), in float32 (the bias added in float32, where torch
// rounds the sum to bf16 first: within a bf16 step of torch's). dtype: 0 float32, 1 bf16.
int pagellm_bias_gelu_tanh(const void* x, int64_t rows, int64_t n, const void* bias, void* out, int dtype,
                           int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (rows < 0 || n <= 0 || (dtype != 0 && dtype != 1)) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t elem = dtype == 1 ? 2 : 4;
    const auto* in = static_cast<const char*>(x);
    const auto* b = static_cast<const char*>(bias);
    auto* dst = static_cast<char*>(out);
    const __m256 k0 = _mm256_set1_ps(-2.0f * 0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= (int64_t{1} << 15))
    for (int64_t r = 0; r < rows; ++r) {
        const char* row = in + r * n * elem;
        char* o = dst + r * n * elem;
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = dtype == 1 ? load8<true>(row + i * 2, n - i) : load8<false>(row + i * 4, n - i);
            if (b != nullptr) v = _mm256_add_ps(v, dtype == 1 ? load8<true>(b + i * 2, n - i) : load8<false>(b + i * 4, n - i));
            const __m256 minus_2u = _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, v), _mm256_mul_ps(v, v), v));
            const __m256 g = _mm256_div_ps(v, _mm256_add_ps(one, exp_x8(minus_2u)));
            if (dtype == 1) store8<true>(o + i * 2, g, n - i);
            else store8<false>(o + i * 4, g, n - i);
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)n, (void)bias, (void)out, (void)dtype, (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
