// The integer GEMM of gemm_int8.cpp on AMX tiles (TDPBSUD: signed int8 activations times
// unsigned 8-bit weight codes, 16 x 16 int32 results), for batches of many rows on Sapphire
// Rapids and later. Included by gemm_int8.cpp inside its anonymous namespace, after `store_tile`.
//
// Why: above a few rows the dot-product path computes, not reads; a tile product does 16 x 16
// x 32 multiply-adds in one instruction, and the quantized weights need no dense bf16 copy
// (2 bytes a weight) to use the tiles.
//
// Each (16 rows, 16 columns, block of 32) product is exact in int32, then scaled in fp32 with the
// very operations and order of the dot-product path, so the two give identical bits:
//   acc += float(isum) * (dw * da) (+ mw * (da * sum(q)) for q4 / q4f), isum - 128 sum(q) for q8,
//   isum - 8 sum(q) for q4s.
// B tiles: a block's q8 record is one as it is (8 rows of 16 columns x 4 k); q4 / q4f codes are
// unpacked once per column tile into a thread buffer (low nibbles of group g are k = 8g .. 8g + 3:
// B row 2g; high nibbles B row 2g + 1). A tiles read the quantized rows in place (padded with zero
// rows to a multiple of 16). A 16 x 16 output stays in 16 zmm over the blocks, so each block's
// scaling is 2-3 vector operations a row. Four blocks are in flight: C tiles 0-3, one per
// block, with A tiles 4-5 and B tiles 6-7 alternating.

namespace qamx {

constexpr int kRows = 16;
constexpr int kTileBytes = 512;  // one B tile: 8 rows x 64 bytes
constexpr int kSlots = 4;        // blocks in flight on the tiles

void configure() {
    AmxTileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = kRows, cfg.colsb[t] = 64;  // C: 16 x 16 int32
    for (int t = 4; t < 6; ++t) cfg.rows[t] = kRows, cfg.colsb[t] = 32;  // A: 16 rows x 32 int8
    for (int t = 6; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;      // B: 8 x (16 columns x 4 k)
    amx_load_config(cfg);
}

// The q4 / q4f / q4s codes of one column tile (all blocks) as B tiles: out[b * 512].
template <int kFmt>
void unpack_codes(const uint8_t* tile, int64_t blocks, uint8_t* out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rec = block_codes<kFmt>(tile, b);
        uint8_t* dst = out + b * kTileBytes;
        for (int g = 0; g < 4; ++g) {
            const __m512i v = _mm512_loadu_si512(rec + g * 64);
            _mm512_storeu_si512(dst + g * 128, _mm512_and_si512(v, low));
            _mm512_storeu_si512(dst + g * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

// One block's product into C tile `c` (A tile `ta`, B tile `tb`), stored to isum [16][16]. Four
// slots let the next blocks' tile work run while a block is scaled. (The tile intrinsics take
// tile numbers as literals: one function a slot.)
#define PAGELLM_QAMX_BLOCK_PRODUCT(name, c, ta, tb)                                        \
    inline void name(const int8_t* a, int64_t lq, const uint8_t* b, int32_t* isum) {       \
        _tile_zero(c);                                                                     \
        _tile_loadd(ta, a, lq);                                                            \
        _tile_loadd(tb, b, 64);                                                            \
        _tile_dpbsud(c, ta, tb);                                                           \
        _tile_stored(c, isum, 64);                                                         \
        amx_memory_barrier(); /* the isum reads stay after the store, whatever the intrinsic declares */ \
    }
PAGELLM_QAMX_BLOCK_PRODUCT(block_product_0, 0, 4, 6)
PAGELLM_QAMX_BLOCK_PRODUCT(block_product_1, 1, 5, 7)
PAGELLM_QAMX_BLOCK_PRODUCT(block_product_2, 2, 4, 6)
PAGELLM_QAMX_BLOCK_PRODUCT(block_product_3, 3, 5, 7)
#undef PAGELLM_QAMX_BLOCK_PRODUCT

// Per (row, block) terms of the scaling, as the dot-product path forms them: da * sum(q) (q4,
// q4f) and the integer offset -code_zero * sum(q) (q8: -128, q4s: -8).
struct RowTerms {
    std::vector<float> d_sum;
    std::vector<int32_t> isum_offset;
};

RowTerms row_terms(const QuantizedA& qa, int32_t zero) {
    RowTerms t;
    t.d_sum.resize(qa.d.size());
    t.isum_offset.resize(qa.d.size());
    for (size_t i = 0; i < qa.d.size(); ++i) {
        t.d_sum[i] = qa.d[i] * static_cast<float>(qa.sum[i]);
        t.isum_offset[i] = -zero * qa.sum[i];
    }
    return t;
}

// out[r][c] = rows r0 .. r0 + 15 of A times one column tile (records from `rec0`, B tiles from
// `b0`), summed over the blocks as `accumulate` in gemm_int8.cpp does, in registers.
template <int kFmt>
void row_tile(const QuantizedA& qa, const RowTerms& terms, int64_t r0, const uint8_t* rec0, const uint8_t* b0,
              int64_t b_step, float* out) {
    constexpr bool kNibbles = kFmt != kQ8;
    constexpr bool kFloatOffset = kFmt == kQ4 || kFmt == kQ4F;
    constexpr int64_t kRecord = kRecordBytes[kFmt];
    alignas(64) int32_t isum[kSlots][256];
    const int64_t blocks = qa.blocks, lq = blocks * kBlock;
    const int8_t* a = qa.q.data() + r0 * lq;
    const float* da = qa.d.data() + r0 * blocks;
    const float* ds = terms.d_sum.data() + r0 * blocks;
    const int32_t* off = terms.isum_offset.data() + r0 * blocks;
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    const auto issue = [&](int64_t b) {
        if (b >= blocks) return;
        const int8_t* ab = a + b * kBlock;
        const uint8_t* bb = b0 + b * b_step;
        switch (b % kSlots) {
            case 0: return block_product_0(ab, lq, bb, isum[0]);
            case 1: return block_product_1(ab, lq, bb, isum[1]);
            case 2: return block_product_2(ab, lq, bb, isum[2]);
            default: return block_product_3(ab, lq, bb, isum[3]);
        }
    };
    // q4k: a super-block's scales and mins as bytes, and its integer sums per row (q4k_add_block).
    alignas(64) uint8_t sc[kSuperBlocks * kTileCols], mn[kSuperBlocks * kTileCols];
    alignas(64) int32_t scaled[kRows][kTileCols], mins[kRows][kTileCols];
    const int32_t* sums = qa.sum.data() + r0 * blocks;
    for (int64_t b = 0; b < kSlots - 1; ++b) issue(b);
    for (int64_t b = 0; b < blocks; ++b) {
        issue(b + kSlots - 1);
        const uint8_t* rec = rec0 + b * kRecord;
        const int32_t* s = isum[b % kSlots];
        if constexpr (kFmt == kQ4K) {
            const int j = static_cast<int>(b % kSuperBlocks);
            const uint8_t* super = rec0 + (b / kSuperBlocks) * kSuperRecord;
            if (j == 0) {
                q4k_scale_bytes(super, sc, mn);
                std::memset(scaled, 0, sizeof(scaled));
                std::memset(mins, 0, sizeof(mins));
            }
            const __m512i scale = Simd::uint8_lanes(sc + kTileCols * j), min = Simd::uint8_lanes(mn + kTileCols * j);
#pragma GCC unroll 16
            for (int r = 0; r < kRows; ++r) {
                __m512i sr = _mm512_load_si512(scaled[r]), mr = _mm512_load_si512(mins[r]);
                q4k_add_block(sr, mr, _mm512_load_si512(s + r * 16), scale, min, sums[r * blocks + b]);
                _mm512_store_si512(scaled[r], sr);
                _mm512_store_si512(mins[r], mr);
            }
            if (j == kSuperBlocks - 1) {
                const __m512 d = Simd::half(super + kQ4KD), dmin = Simd::half(super + kQ4KDmin);
#pragma GCC unroll 16
                for (int r = 0; r < kRows; ++r)
                    acc[r] = q4k_finish_super(acc[r], _mm512_load_si512(scaled[r]), _mm512_load_si512(mins[r]), d, dmin,
                                              da[r * blocks + b]);
            }
            continue;
        }
        __m512 dw, mw = _mm512_setzero_ps();
        if constexpr (kFmt == kQ4F) {
            dw = _mm512_loadu_ps(rec + 256);
            mw = _mm512_loadu_ps(rec + 320);
        } else {
            dw = Simd::half(rec + (kNibbles ? 256 : 512));
            if constexpr (kFloatOffset) mw = Simd::half(rec + 288);
        }
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
            const int64_t ab = r * blocks + b;
            __m512i v = _mm512_load_si512(s + r * 16);
            if constexpr (!kFloatOffset) v = _mm512_add_epi32(v, _mm512_set1_epi32(off[ab]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dw, _mm512_set1_ps(da[ab])), acc[r]);
            if constexpr (kFloatOffset) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[ab]), acc[r]);
        }
    }
    for (int r = 0; r < kRows; ++r) _mm512_store_ps(out + r * 16, acc[r]);
}

// As gemm_int8.cpp's `gemm`, on tiles: work items are (column tile, chunk of rows); `qa` holds
// its rows padded with zeros to a multiple of 16.
template <int kFmt, bool kBf16Out>
void gemm(const QuantizedA& qa, int64_t m, const uint8_t* packed, int64_t n, void* c, int64_t ldc, bool silu_mul,
          int threads) {
    const int64_t per_tile = silu_mul ? 8 : kTileCols;
    const int64_t tiles = (n + per_tile - 1) / per_tile;
    const int64_t blocks = qa.blocks, tile_bytes = blocks * kRecordBytes[kFmt];
    const int64_t chunk = std::max<int64_t>(kRows, kChunkBytes / (blocks * kBlock) / kRows * kRows);
    const RowTerms terms = row_terms(qa, code_zero(kFmt));
    WorkRanges work(tiles, (m + chunk - 1) / chunk, threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        WorkRanges::Item item;
        if (work.next(t, item)) {
            configure();
            alignas(64) float out[kRows * kTileCols];
            std::vector<uint8_t> unpacked(kFmt == kQ8 ? 0 : static_cast<size_t>(blocks * kTileBytes));
            int64_t unpacked_tile = -1;
            do {
                const uint8_t* rec0 = packed + item.panel * tile_bytes;
                const uint8_t* b0 = rec0;
                int64_t b_step = kRecordBytes[kFmt];
                if constexpr (kFmt != kQ8) {
                    if (unpacked_tile != item.panel) {
                        unpack_codes<kFmt>(rec0, blocks, unpacked.data());
                        amx_memory_barrier();
                        unpacked_tile = item.panel;
                    }
                    b0 = unpacked.data();
                    b_step = kTileBytes;
                }
                const int64_t m0 = item.chunk * chunk, m1 = std::min(m, m0 + chunk);
                for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
                    row_tile<kFmt>(qa, terms, r0, rec0, b0, b_step, out);
                    const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - r0));
                    store_tile<kBf16Out>(out, rows, 1, item.panel, silu_mul, n, c, ldc, r0);
                }
            } while (work.next(t, item));
            _tile_release();
        }
    }
}

}  // namespace qamx
