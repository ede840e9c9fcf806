// bfloat16 matrix products for the decoder's linear layers: C[M, N] = A[M, K] @ W[N, K]^T.
//
// Why not oneDNN: at decode batch sizes (M ~ 8-128) on CPUs with AVX-512 BF16 but no AMX,
// torch's oneDNN call runs at 60-80% of the vdpbf16ps peak; this register-blocked kernel runs
// at 85-95% and fuses the MLP's silu(gate) * up into its epilogue. Its sums are the same
// as oneDNN's there: float32 accumulation of bf16 pair products in K order, rounded once.
//
// The weight is packed once (by pagellm/kernels/__init__.py, in torch) into column panels of
// NR = 16 * NZ columns laid out [K / 2][NR][2]: one 64-byte load gives 16 columns' values for
// two consecutive k, exactly the operand vdpbf16ps pairs with a broadcast (A[m, k], A[m, k+1]).
// Each thread takes a contiguous range of panels and, for each, runs every MR-row block of A
// over the panel (the panel stays in L2 while A's rows stream through L1); its first blocks
// prefetch the thread's next panel into L2, so the weight's trip from memory overlaps the
// arithmetic.

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include <omp.h>

#include "amx_bf16_tiles.h"
#include "bf16_simd.h"
#include "exports.h"
#include "work_ranges.h"


#ifdef PAGELLM_AVX512_BF16
namespace {

constexpr int kLine = 64;  // bytes in a cache line = one packed row of 16 column pairs

// The next panel is prefetched by the first (up to) this many row blocks, each taking every
// kPrefetchPhases-th packed k-pair row, so its trip from memory is spread over the panel's
// work. Taking all of it in the first NZ blocks (one line of each row per block) left M=64
// products waiting on memory: 30 layers' four linears, cold weights, 2 threads, on a Zen 5 VM,
// 15.7-16.3 ms against 14.8-15.1 (M=16: 6.1-6.5 against 5.4-5.6; benchmarks/NOTES.md 33).
constexpr int kPrefetchPhases = 16;

// Which part of the next panel one row block prefetches: every line of the packed k-pair rows
// kp with kp % phases == phase (none if phase < 0).
struct Prefetch {
    const char* next = nullptr;
    int phase = -1;
    int phases = 1;
};

// acc[r][j] = sum over k of A[r, k] * panel column block j, for MR rows of A.
template <int MR, int NZ>
inline void accumulate(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t kpairs,
                       const Prefetch& pf, __m512 (&acc)[MR][NZ]) {
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_setzero_ps();
    const int32_t* rows[MR];
    for (int r = 0; r < MR; ++r) rows[r] = reinterpret_cast<const int32_t*>(a + r * lda);
    const int64_t row_bytes = int64_t{NZ} * kLine;
    int phase = 0;
    for (int64_t kp = 0; kp < kpairs; ++kp) {
        __m512i w[NZ];
        for (int j = 0; j < NZ; ++j) w[j] = _mm512_loadu_si512(panel + (kp * NZ + j) * 32);
        if (phase == pf.phase)
            for (int j = 0; j < NZ; ++j) _mm_prefetch(pf.next + kp * row_bytes + j * kLine, _MM_HINT_T1);
        if (++phase == pf.phases) phase = 0;
        for (int r = 0; r < MR; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(rows[r][kp]);
            for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, (__m512bh)w[j]);
        }
    }
}

// Plain epilogue: 16 * NZ output columns (the first `cols` of them exist) rounded to bf16.
template <int NZ_, int MR_>
struct PlainN {
    static constexpr int NZ = NZ_;
    static constexpr int MR = MR_;
    static constexpr int64_t out_cols = 16 * NZ;
    template <int R>
    static void store(const __m512 (&acc)[R][NZ], uint16_t* c, int64_t ldc, int64_t cols) {
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NZ; ++j) {
                const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
                _mm256_mask_storeu_epi16(c + r * ldc + j * 16, first_lanes(cols - j * 16), v);
            }
    }
};
using Plain = PlainN<3, 8>;     // dot products: 24 accumulators + 3 weight registers + 1 broadcast
using PlainAmx = PlainN<2, 32>;  // AMX: 32-column panels, 2 x 2 tiles of 16 rows x 16 columns

// MLP epilogue: the panel holds 32 gate columns then the same 32 up columns; out =
// silu(gate) * up with each intermediate rounded to bf16, the order of HF's unfused bf16 ops.
struct SiluMul {
    static constexpr int NZ = 4;
    static constexpr int MR = 6;  // 24 accumulators
    static constexpr int64_t out_cols = 32;
    template <int R>
    static void store(const __m512 (&acc)[R][NZ], uint16_t* c, int64_t ldc, int64_t cols) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) {
                const __m512 gate = round_bf16x16(acc[r][h]);
                const __m512 up = round_bf16x16(acc[r][h + 2]);
                const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gate);
                const __m512 act = round_bf16x16(_mm512_div_ps(gate, _mm512_add_ps(one, exp_x16(neg))));
                const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, up));
                _mm256_mask_storeu_epi16(c + r * ldc + h * 16, first_lanes(cols - h * 16), v);
            }
    }
};

template <class Epi, int R>
void row_block(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t kpairs, const Prefetch& pf,
               uint16_t* c, int64_t ldc, int64_t cols) {
    __m512 acc[R][Epi::NZ];
    accumulate<R, Epi::NZ>(a, lda, panel, kpairs, pf, acc);
    Epi::template store<R>(acc, c, ldc, cols);
}

template <class Epi, int... R>
constexpr auto row_block_table(std::integer_sequence<int, R...>) {
    using Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const Prefetch&, uint16_t*, int64_t,
                        int64_t);
    return std::array<Fn, sizeof...(R)>{row_block<Epi, R + 1>...};
}

template <class Epi>
void gemm(const uint16_t* a, int64_t lda, int64_t m, int64_t k, const uint16_t* packed, int64_t n, uint16_t* c,
          int64_t ldc, int num_threads) {
    static constexpr auto kBlocks = row_block_table<Epi>(std::make_integer_sequence<int, Epi::MR>{});
    constexpr int NZ = Epi::NZ;
    const int64_t kpairs = k / 2;
    const int64_t panel_elems = kpairs * NZ * 32;
    const int64_t panels = (n + Epi::out_cols - 1) / Epi::out_cols;
    const int64_t row_blocks = (m + Epi::MR - 1) / Epi::MR;
    WorkRanges work(panels, 1, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num();
        for (WorkRanges::Item item; work.next(t, item);) {
            const int64_t p = item.panel;
            const uint16_t* panel = packed + p * panel_elems;
            const int64_t cols = n - p * Epi::out_cols;
            Prefetch pf;
            if (item.next_is_own) pf.next = reinterpret_cast<const char*>(panel + panel_elems);
            for (int64_t b = 0; b < row_blocks; ++b) {
                pf.phases = static_cast<int>(row_blocks < kPrefetchPhases ? row_blocks : kPrefetchPhases);
                pf.phase = pf.next != nullptr && b < pf.phases ? static_cast<int>(b) : -1;
                const int64_t r0 = b * Epi::MR;
                const int64_t rows = m - r0 < Epi::MR ? m - r0 : Epi::MR;
                kBlocks[rows - 1](a + r0 * lda, lda, panel, kpairs, pf, c + r0 * ldc + p * Epi::out_cols, ldc, cols);
            }
        }
    }
}

#ifdef PAGELLM_AMX
// AMX tiles (Sapphire Rapids and later), on the same packed weight (amx_bf16_tiles.h). Blocks of
// 16 or 32 rows of A run over each panel of the thread's range, A taken in chunks of rows that
// stay in L2 while the thread's panels stream past.
namespace amx {

constexpr int64_t kChunkBytes = 384 << 10;  // rows of A kept in L2 while the panels pass
// Products with a longer k (an MLP's down projection: k = the intermediate width) run k in blocks
// of at most this, the panels in groups of kGroupPanels: a chunk of A's rows is sized by the
// block, not by all of k, and each of its k-blocks passes the group's panels while it is in L2,
// the C tiles kept in a buffer between blocks. Unsplit, k = 8192 left 16-row chunks (single
// tiles, and the whole weight streamed again every 16 rows): 460-520 GFLOP/s, against 1,100-1,600
// at k = 2048 (benchmarks/NOTES.md, 59).
constexpr int64_t kMaxKBlock = 2048;
constexpr int64_t kGroupPanels = 8;

// The k-block width: k split evenly into blocks of at most kMaxKBlock, rounded up to kStep.
inline int64_t k_block(int64_t k) {
    const int64_t count = (k + kMaxKBlock - 1) / kMaxKBlock;
    const int64_t width = (k + count - 1) / count;
    return (width + amx_bf16::kStep - 1) / amx_bf16::kStep * amx_bf16::kStep;
}

template <class Epi>
void gemm(const uint16_t* a, int64_t lda, int64_t m, int64_t k, const uint16_t* packed, int64_t n, uint16_t* c,
          int64_t ldc, int num_threads) {
    constexpr int NZ = Epi::NZ;
    const int64_t panel_elems = (k / 2) * NZ * 32;
    const int64_t panels = (n + Epi::out_cols - 1) / Epi::out_cols;
    const int64_t kc = k > kMaxKBlock ? k_block(k) : k;
    const int64_t group = kc < k ? kGroupPanels : 1;
    const int64_t groups = (panels + group - 1) / group;
    int64_t chunk = kChunkBytes / (kc * 2) / amx_bf16::kRows * amx_bf16::kRows;
    if (chunk < amx_bf16::kRows) chunk = amx_bf16::kRows;
    WorkRanges work(groups, (m + chunk - 1) / chunk, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num();
        WorkRanges::Item item;
        if (work.next(t, item)) {
            amx_bf16::configure();
            amx_bf16::TailRows tail;
            // C tiles of each panel of a group between k-blocks (a 16-row slot: NZ tiles).
            const int64_t slots = (chunk + amx_bf16::kRows - 1) / amx_bf16::kRows;
            std::vector<float> sums(kc < k ? group * slots * NZ * 256 : 0);
            do {
                const int64_t m0 = item.chunk * chunk;
                const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
                const int64_t p0 = item.panel * group;
                const int64_t p1 = p0 + group < panels ? p0 + group : panels;
                for (int64_t k0 = 0; k0 < k; k0 += kc) {
                    amx_bf16::KBlock kb;
                    if (kc < k) kb = {k0, k - k0 < kc ? k - k0 : kc, nullptr, k0 > 0, k0 + kc >= k};
                    for (int64_t p = p0; p < p1; ++p) {
                        const uint16_t* panel = packed + p * panel_elems;
                        const int64_t cols = n - p * Epi::out_cols;
                        // Prefetched meanwhile: the group's next panel, else its first at the next block.
                        const char* next = nullptr;
                        if (p + 1 < p1)
                            next = reinterpret_cast<const char*>(panel + panel_elems);
                        else if (kb.width > 0 && !kb.last)
                            next = reinterpret_cast<const char*>(packed + p0 * panel_elems) + kc * NZ * 32;
                        else if (kb.width == 0 && item.next_is_own)
                            next = reinterpret_cast<const char*>(panel + panel_elems);
                        if (kb.width > 0) kb.c = sums.data() + (p - p0) * slots * NZ * 256;
                        amx_bf16::panel_rows<NZ>(
                            a, lda, m0, m1, k, panel, next, tail,
                            [&](int64_t r0, int64_t rows, const float* out, int64_t group_stride) {
                                for (int64_t r = 0; r < rows; ++r) {
                                    __m512 acc[1][NZ];
                                    for (int j = 0; j < NZ; ++j)
                                        acc[0][j] = _mm512_loadu_ps(out + j * group_stride + r * 16);
                                    Epi::template store<1>(acc, c + (r0 + r) * ldc + p * Epi::out_cols, ldc, cols);
                                }
                            },
                            kb);
                    }
                }
            } while (work.next(t, item));
            _tile_release();
        }
    }
}

}  // namespace amx
#endif

}  // namespace
#endif

extern "C" {

// 1 when this build has the AVX-512 BF16 GEMM (else pagellm_gemm_bf16 returns -2).
int pagellm_gemm_bf16_available() {
#ifdef PAGELLM_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

// 1 when this build has the AMX path and the kernel lets this process use AMX tiles.
int pagellm_gemm_bf16_amx_available() {
#ifdef PAGELLM_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// c[m, n] = a[m, k] @ W^T on a packed W (layout above). epilogue 0: plain (48-column panels,
// 32-column ones with use_amx);
// 1: silu(gate) * up (panels of 32 gate + 32 up columns; n = the up/gate width). use_amx: AMX
// tiles (needs k % 32 == 0 and pagellm_gemm_bf16_amx_available()) instead of dot products.
// Returns 0, -1 on a bad argument, -2 where the build lacks AVX-512 BF16 (or AMX, if asked).
int pagellm_gemm_bf16(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                      int64_t ldc, int epilogue, int num_threads, int use_amx) {
#ifdef PAGELLM_AVX512_BF16
    if (m < 0 || k <= 0 || k % 2 != 0 || n <= 0 || lda < k || ldc < n) return -1;
    if (use_amx) {
#ifdef PAGELLM_AMX
        if (k % amx_bf16::kStep != 0 || (epilogue != 0 && epilogue != 1)) return -1;
        if (!amx_permitted()) return -2;
        if (num_threads < 1) num_threads = 1;
        if (m == 0) return 0;
        const auto* A = static_cast<const uint16_t*>(a);
        const auto* W = static_cast<const uint16_t*>(packed);
        auto* C = static_cast<uint16_t*>(c);
        if (epilogue == 0)
            amx::gemm<PlainAmx>(A, lda, m, k, W, n, C, ldc, num_threads);
        else
            amx::gemm<SiluMul>(A, lda, m, k, W, n, C, ldc, num_threads);
        return 0;
#else
        return -2;
#endif
    }
    if (num_threads < 1) num_threads = 1;
    if (m == 0) return 0;
    const auto* A = static_cast<const uint16_t*>(a);
    const auto* W = static_cast<const uint16_t*>(packed);
    auto* C = static_cast<uint16_t*>(c);
    if (epilogue == 0) {
        gemm<Plain>(A, lda, m, k, W, n, C, ldc, num_threads);
    } else if (epilogue == 1) {
        gemm<SiluMul>(A, lda, m, k, W, n, C, ldc, num_threads);
    } else {
        return -1;
    }
    return 0;
#else
    (void)a, (void)lda, (void)m, (void)k, (void)packed, (void)n, (void)c, (void)ldc, (void)epilogue, (void)num_threads,
        (void)use_amx;
    return -2;
#endif
}

}  // extern "C"
