// Big batches of q6k and q5f on AVX-512 VNNI: each work item's tiles unpacked once into one
// byte a weight, then every 4 rows of its chunk multiply those bytes (gemm_int8.cpp, included
// inside its anonymous namespace after store_tile; other builds get `unpacks` false and a stub).
//
// Why: a q6k code is a nibble and two bits of a plane (q5f's one bit); `accumulate` rebuilds each
// 64-byte group of codes (9 vector operations: mask, shift, mask, two bit-plane extractions and
// ORs) for every 4 rows it serves, more operations than the group's 8 dot products. Unpacked
// once per chunk of rows (2 tiles x 16 columns x k bytes a thread: in L2 up to k of about 16k),
// those operations are gone. (For q4's nibbles, 3 operations a group, the same change measured
// 0.86-0.95x: NOTES 69.) The sums are the same int32 and the epilogue the same operations in the
// same order as `accumulate`'s, so the bits do not change (tests compare the two paths).
#pragma once

#if PAGELLM_QGEMM_ISA == 3

// Rows of A's chunks from which a product unpacks its tiles' codes
// first; decided once per product, so a last, shorter chunk unpacks too.
constexpr int64_t kUnpackMinRows = 8;

// Whether a format takes the unpacked path.
constexpr bool unpacks(int fmt) { return fmt == kQ6K || fmt == kQ5F; }

// Bytes of one block of one tile once unpacked: q8's layout (8 groups of 16 columns x 4 k).
constexpr int64_t kUnpackedBlock = 512;

// `count` tiles (`tile_bytes` apart from `w`) unpacked: out[(b * count + t) * 512 + gg * 64 + 4c + j]
// = code (0..63) of column c, k = 32b + 4gg + j (q4's group g holds groups 2g and 2g + 1 in its
// nibbles; q6k's planes their top bits, as `accumulate` reads them).
template <int kFmt>
void unpack_tiles(const uint8_t* w, int64_t tile_bytes, int64_t count, int64_t blocks, uint8_t* out) {
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t t = 0; t < count; ++t) {
            const uint8_t* rec = block_record<kFmt>(w + t * tile_bytes, b);
            const uint8_t* nibbles = block_codes<kFmt>(w + t * tile_bytes, b);
            constexpr int kPlanes = kFmt == kQ6K ? 2 : 1;
            __m512i planes[kPlanes];
#pragma GCC unroll 2
            for (int p = 0; p < kPlanes; ++p) planes[p] = Simd::load(rec + top_bits_plane(kFmt, p));
            uint8_t* dst = out + (b * count + t) * kUnpackedBlock;
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g) {
                const __m512i codes = Simd::load(nibbles + g * 64);
                __m512i lo = Simd::low_nibbles(codes), hi = Simd::high_nibbles(codes);
                add_top_bits<kFmt>(planes[kPlanes == 2 ? g / 2 : 0], g, lo, hi);
                _mm512_storeu_si512(dst + 2 * g * 64, lo);
                _mm512_storeu_si512(dst + (2 * g + 1) * 64, hi);
            }
        }
}

// s[r][v] = the int32 dot products of groups kFirst..kEnd - 1 (4 k each) of one unpacked block
// (`block`: G tiles' codes) with R rows of quantized activations (`a`, rows `lq` apart).
template <int R, int G, int kFirst, int kEnd>
inline void dot_groups(const uint8_t* block, const int8_t* a, int64_t lq, __m512i (&s)[R][G]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < G; ++v) s[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int gg = kFirst; gg < kEnd; ++gg) {
        __m512i wv[G];
#pragma GCC unroll 4
        for (int v = 0; v < G; ++v) wv[v] = Simd::load(block + v * kUnpackedBlock + gg * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512i av = Simd::set1(load4(a + r * lq + 4 * gg));
#pragma GCC unroll 4
            for (int v = 0; v < G; ++v) s[r][v] = Simd::dot_q4(s[r][v], wv[v], av);
        }
    }
}

// acc[r][v] += the q5f block b of rows r0.. against tile v's unpacked codes at `block`: the int32
// sum of its 8 groups, then q4f's fp32 epilogue (scale and offset per column, as `accumulate`).
template <int R, int G>
inline void block_q5f(const QuantizedA& qa, int64_t r0, const uint8_t* w, int64_t tile_bytes, const uint8_t* block,
                      const int8_t* a, int64_t b, __m512 (&acc)[R][G]) {
    const int64_t blocks = qa.blocks, lq = blocks * kBlock;
    __m512i s[R][G];
    dot_groups<R, G, 0, 8>(block, a, lq, s);
#pragma GCC unroll 4
    for (int v = 0; v < G; ++v) {
        const uint8_t* rec = block_record<kQ5F>(w + v * tile_bytes, b);
        const __m512 dw = Simd::load_float(rec + 320), mw = Simd::load_float(rec + 320 + 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (r0 + r) * blocks + b;
            const float da = qa.d[ab];
            acc[r][v] = Simd::fmadd(Simd::to_float(s[r][v]), Simd::mul(dw, Simd::fset1(da)), acc[r][v]);
            acc[r][v] = Simd::fmadd(mw, Simd::fset1(da * static_cast<float>(qa.sum[ab])), acc[r][v]);
        }
    }
}

// tile[r][t * 16 + c] = row r0 + r of A times column c of tile t (G tiles), the codes read from
// `codes` (unpack_tiles' layout over `blocks`), the scales from the packed tiles at `w`.
template <int R, int G, int kFmt>
void accumulate_unpacked(const QuantizedA& qa, int64_t r0, const uint8_t* w, int64_t tile_bytes, const uint8_t* codes,
                         float* tile) {
    static_assert(unpacks(kFmt), "q6k and q5f only");
    const int64_t blocks = qa.blocks, lq = blocks * kBlock;
    __m512 acc[R][G];
    __m512i total[R][G];  // the super-block's integer sum so far
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < G; ++v) acc[r][v] = _mm512_setzero_ps(), total[r][v] = _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* a = qa.q.data() + r0 * lq + b * kBlock;
        const uint8_t* block = codes + b * G * kUnpackedBlock;
        if constexpr (kFmt == kQ5F) {
            block_q5f<R, G>(qa, r0, w, tile_bytes, block, a, b, acc);
            continue;
        }
        // q6k: the block's two halves of 16 (groups 0-3, 4-7), each under its own int8 scale.
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
            __m512i s[R][G];
            if (half == 0) {
                dot_groups<R, G, 0, 4>(block, a, lq, s);
            } else {
                dot_groups<R, G, 4, 8>(block, a, lq, s);
            }
#pragma GCC unroll 4
            for (int v = 0; v < G; ++v) {
                const __m512i sc = Simd::int8_scales(block_record<kFmt>(w + v * tile_bytes, b) + 384 + 16 * half);
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int64_t ab = (r0 + r) * blocks + b;
                    const int32_t low = qa.sum_lo[ab], sum = half == 0 ? low : qa.sum[ab] - low;
                    const __m512i centred = Simd::add(s[r][v], Simd::set1(-32 * sum));
                    total[r][v] = Simd::add(total[r][v], Simd::mullo(sc, centred));
                }
            }
        }
        if (b % kSuperBlocks != kSuperBlocks - 1) continue;
#pragma GCC unroll 4
        for (int v = 0; v < G; ++v) {
            // d of the super-block, after its 8 blocks
            const __m512 dw = Simd::half(w + v * tile_bytes + (b / kSuperBlocks) * kQ6KSuper + kSuperBlocks * kQ6KBlock);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const float da = qa.d[(r0 + r) * blocks + b];
                acc[r][v] = Simd::fmadd(Simd::to_float(total[r][v]), Simd::mul(dw, Simd::fset1(da)), acc[r][v]);
                total[r][v] = _mm512_setzero_si512();
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < G; ++v) Simd::store(tile + r * G * kTileCols + v * kTileCols, acc[r][v]);
}

using UnpackedTileFn = void (*)(const QuantizedA&, int64_t, const uint8_t*, int64_t, const uint8_t*, float*);

// The unpacked kernel for `rows` (1-4) rows of A over `group` (1 or 2) tiles.
template <int kFmt>
UnpackedTileFn unpacked_tile_fn(int rows, int group) {
    static constexpr UnpackedTileFn kTwo[kMaxRows] = {accumulate_unpacked<1, 2, kFmt>, accumulate_unpacked<2, 2, kFmt>,
                                                      accumulate_unpacked<3, 2, kFmt>, accumulate_unpacked<4, 2, kFmt>};
    static constexpr UnpackedTileFn kOne[kMaxRows] = {accumulate_unpacked<1, 1, kFmt>, accumulate_unpacked<2, 1, kFmt>,
                                                      accumulate_unpacked<3, 1, kFmt>, accumulate_unpacked<4, 1, kFmt>};
    return group == 2 ? kTwo[rows - 1] : kOne[rows - 1];
}

// Rows m0..m1 of A times `count` (1-2) tiles from tile index t0, their codes unpacked first.
template <int kFmt, bool kBf16Out>
void multiply_unpacked(const QuantizedA& qa, int64_t m0, int64_t m1, const uint8_t* w, int64_t tile_bytes, int64_t count,
                       int64_t t0, uint8_t* codes, float* tile, bool silu_mul, int64_t n, void* c, int64_t ldc) {
    if constexpr (unpacks(kFmt)) {
        unpack_tiles<kFmt>(w, tile_bytes, count, qa.blocks, codes);
        for (int64_t r0 = m0; r0 < m1; r0 += kMaxRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - r0));
            unpacked_tile_fn<kFmt>(rows, static_cast<int>(count))(qa, r0, w, tile_bytes, codes, tile);
            store_tile<kBf16Out>(tile, rows, static_cast<int>(count), t0, silu_mul, n, c, ldc, r0);
        }
    }
}
#else
constexpr bool unpacks(int) { return false; }
constexpr int64_t kUnpackMinRows = 0, kUnpackedBlock = 0;
template <int kFmt, bool kBf16Out>
void multiply_unpacked(const QuantizedA&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, uint8_t*, float*,
                       bool, int64_t, void*, int64_t) {}
#endif
