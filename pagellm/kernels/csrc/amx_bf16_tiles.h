// bf16 products on AMX tiles (Sapphire Rapids and later) over one packed weight panel, shared by
// the dense bf16 GEMM (gemm_bf16.cpp) and the quantized weights dequantized to bf16 panels
// (gemm_int8_bf16_tiles.h). Header-only, internal linkage in each source.
//
// A panel holds NZ groups of 16 columns laid out [k / 2][16 * NZ][2]: group j over 32
// consecutive k is one B tile (16 k-pair rows of 64 bytes, row stride NZ * 64 bytes), so
// TDPBF16PS multiplies a 16 x 32 tile of A into a 16 x 16 float32 tile of C. Tiles 0..3 hold C,
// 4-5 A, 5-7 B. Every C element is the same sequence of tile products over k, whichever block
// or path runs it, so both users give the same bits for the same bf16 panel.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_simd.h"

#ifdef PAGELLM_AMX
#include <immintrin.h>

namespace {
namespace amx_bf16 {

constexpr int kRows = 16;
constexpr int64_t kStep = 32;  // k per tile product
constexpr int64_t kLine = 64;  // bytes: one packed row of 16 column pairs

inline void configure() {
    AmxTileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = kRows;
        cfg.colsb[t] = 64;
    }
    amx_load_config(cfg);
}

// out[j][r][0:16] = sum over k of A[r, k] * column group j of the panel, r < 16; meanwhile
// `pf_lines` lines from `pf` on (part of the next panel) are prefetched into L2, spread over
// the k steps. Without that the tile loads wait on memory: a panel's k step is one 4 KiB page,
// where the hardware prefetchers stop.
template <int NZ>
inline void tile_block(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t ksteps, float* out,
                       const char* pf, int64_t pf_lines, bool resume = false) {
    static_assert(NZ >= 1 && NZ <= 4, "at most 4 C tiles");
    const int64_t a_stride = lda * 2, b_stride = int64_t{NZ} * kLine;
    if (resume) {  // the sums of the k-blocks before, as stored below: the same float32 sequence
        _tile_loadd(0, out, kLine);
        if constexpr (NZ > 1) _tile_loadd(1, out + 256, kLine);
        if constexpr (NZ > 2) _tile_loadd(2, out + 512, kLine);
        if constexpr (NZ > 3) _tile_loadd(3, out + 768, kLine);
    } else {
        _tile_zero(0);
        if constexpr (NZ > 1) _tile_zero(1);
        if constexpr (NZ > 2) _tile_zero(2);
        if constexpr (NZ > 3) _tile_zero(3);
    }
    const char* b = reinterpret_cast<const char*>(panel);
    const int64_t pf_step = (pf_lines + ksteps - 1) / ksteps;
    for (int64_t s = 0; s < ksteps; ++s, b += 16 * b_stride) {
        for (int64_t i = 0; i < pf_step && pf_lines > 0; ++i, --pf_lines, pf += kLine) _mm_prefetch(pf, _MM_HINT_T1);
        _tile_loadd(4, a + s * kStep, a_stride);
        _tile_loadd(5, b, b_stride);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (NZ > 1) {
            _tile_loadd(6, b + kLine, b_stride);
            _tile_dpbf16ps(1, 4, 6);
        }
        if constexpr (NZ > 2) {
            _tile_loadd(7, b + 2 * kLine, b_stride);
            _tile_dpbf16ps(2, 4, 7);
        }
        if constexpr (NZ > 3) {
            _tile_loadd(5, b + 3 * kLine, b_stride);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, out, kLine);
    if constexpr (NZ > 1) _tile_stored(1, out + 256, kLine);
    if constexpr (NZ > 2) _tile_stored(2, out + 512, kLine);
    if constexpr (NZ > 3) _tile_stored(3, out + 768, kLine);
}

// 32 rows of A over a panel of NZ = 2 column groups (plain) or 4 (gate 0, 1, up 2, 3), two
// groups at a time (0 and 1; or gate_h and up_h): C tiles for both 16-row blocks and both
// groups, with both A tiles and both B tiles held, so each tile loaded serves two products.
// out[j][r][0:16], r < 32.
template <int NZ>
inline void pair_block(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t ksteps, float* out,
                       const char* pf, int64_t pf_lines, bool resume = false) {
    static_assert(NZ == 2 || NZ == 4, "column groups go in pairs");
    constexpr int kPasses = NZ / 2;
    const int64_t a_stride = lda * 2, b_stride = NZ * kLine;
    const int64_t pf_step = (pf_lines + kPasses * ksteps - 1) / (kPasses * ksteps);
    for (int h = 0; h < kPasses; ++h) {
        const int j0 = h, j1 = h + kPasses;
        if (resume) {
            _tile_loadd(0, out + j0 * 512, kLine);
            _tile_loadd(2, out + j0 * 512 + 256, kLine);
            _tile_loadd(1, out + j1 * 512, kLine);
            _tile_loadd(3, out + j1 * 512 + 256, kLine);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        const char* b = reinterpret_cast<const char*>(panel) + j0 * kLine;
        for (int64_t s = 0; s < ksteps; ++s, b += 16 * b_stride) {
            for (int64_t i = 0; i < pf_step && pf_lines > 0; ++i, --pf_lines, pf += kLine) _mm_prefetch(pf, _MM_HINT_T1);
            _tile_loadd(4, a + s * kStep, a_stride);
            _tile_loadd(5, a + 16 * lda + s * kStep, a_stride);
            _tile_loadd(6, b, b_stride);
            _tile_loadd(7, b + (j1 - j0) * kLine, b_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out + j0 * 512, kLine);
        _tile_stored(2, out + j0 * 512 + 256, kLine);
        _tile_stored(1, out + j1 * 512, kLine);
        _tile_stored(3, out + j1 * 512 + 256, kLine);
    }
}

// A last partial block of A's rows, zero-padded to a whole tile (a thread's; kept while the
// same rows pass further panels).
struct TailRows {
    std::vector<uint16_t> rows;
    int64_t first = -1;  // the row of A it was copied from
};

// Where a product's k is split into blocks (the dense GEMM's large k): the block's first k
// (a multiple of kStep) and width, a float32 buffer holding every row block's C tiles between
// blocks (16 * NZ * 16 floats for each 16 rows of m0 .. m1, in the tile stores' layout), and
// whether blocks came before (their sums are loaded, not zeroed) and this is the last (whose
// results go to `store`). Loading a stored C tile is exact, so the sums are the unsplit ones.
struct KBlock {
    int64_t k0 = 0, width = 0;
    float* c = nullptr;
    bool resume = false, last = true;
};

// Rows m0 .. m1 of A over one panel of NZ column groups (k / 32 steps): 32 rows at a time where
// NZ is even, else 16, the last block padded (`tail`). Each block's float32 results go to
// store(r0, rows, out, group_stride): row r of group j at out + j * group_stride + r * 16.
// `next` (or null): the panel to prefetch meanwhile, its lines shared among the blocks.
// `kb`: k-block `kb.k0 .. kb.k0 + kb.width` of the panel only (panel, next: the whole panels).
template <int NZ, class Store>
void panel_rows(const uint16_t* a, int64_t lda, int64_t m0, int64_t m1, int64_t k, const uint16_t* panel,
                const char* next, TailRows& tail, Store&& store, const KBlock& kb = KBlock{}) {
    constexpr bool kPairs = NZ % 2 == 0;
    alignas(64) float local[NZ * 512];
    const int64_t k0 = kb.width > 0 ? kb.k0 : 0, kc = kb.width > 0 ? kb.width : k;
    const int64_t ksteps = kc / kStep;
    panel += k0 / 2 * NZ * 32;
    if (next != nullptr) next += k0 / 2 * NZ * 32 * 2;
    const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
    const int64_t panel_lines = (kc / 2) * NZ * 32 * 2 / kLine;
    const int64_t lines_per_block = (panel_lines + blocks - 1) / blocks;
    for (int64_t r0 = m0; r0 < m1;) {
        float* out = kb.c != nullptr ? kb.c + (r0 - m0) / kRows * (NZ * 256) : local;
        // Block b of the chunk prefetches the b-th share of the next panel.
        const int64_t first = (r0 - m0) / kRows * lines_per_block;
        const char* pf = next != nullptr && first < panel_lines ? next + first * kLine : nullptr;
        if (kPairs && m1 - r0 >= 2 * kRows) {
            int64_t pf_lines = next == nullptr ? 0 : panel_lines - first;
            pf_lines = pf_lines < 2 * lines_per_block ? pf_lines : 2 * lines_per_block;
            if constexpr (kPairs)
                pair_block<NZ>(a + r0 * lda + k0, lda, panel, ksteps, out, pf, pf_lines > 0 ? pf_lines : 0, kb.resume);
            if (kb.last) store(r0, 2 * kRows, static_cast<const float*>(out), int64_t{512});
            r0 += 2 * kRows;
            continue;
        }
        int64_t pf_lines = next == nullptr ? 0 : panel_lines - first;
        pf_lines = pf_lines < lines_per_block ? pf_lines : lines_per_block;
        const int64_t rows = m1 - r0 < kRows ? m1 - r0 : kRows;
        const uint16_t* rows_a = a + r0 * lda;
        int64_t stride = lda;
        if (rows < kRows) {
            if (tail.first != r0) {
                tail.rows.assign(kRows * k, 0);
                tail.first = r0;
                for (int64_t r = 0; r < rows; ++r) std::memcpy(tail.rows.data() + r * k, rows_a + r * lda, k * 2);
            }
            amx_memory_barrier();
            rows_a = tail.rows.data();
            stride = k;
        }
        tile_block<NZ>(rows_a + k0, stride, panel, ksteps, out, pf, pf_lines > 0 ? pf_lines : 0, kb.resume);
        if (kb.last) store(r0, rows, static_cast<const float*>(out), int64_t{256});
        r0 += kRows;
    }
}

}  // namespace amx_bf16
}  // namespace
#endif
