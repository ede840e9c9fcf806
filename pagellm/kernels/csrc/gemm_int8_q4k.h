// The q4k product of gemm_int8.cpp (GGUF's Q4_K as stored) with Q4_K's 6-bit scales and mins
// applied as integers. Included by gemm_int8.cpp inside its anonymous namespace, after Simd.
//
// Why: with a float scale per block of 32 on both sides, each block ended in float work per
// column (the 6-bit scale and min decoded, converted, multiplied: as many vector operations as
// the block's dot products), and a decode step on Q4_K files ran at 27-31 GB/s where Q4_0's
// reached the read bandwidth (NOTES 55). Here the activations carry one scale per super-block of
// 256 (QuantizedA::super_scale, llama.cpp's Q8_K), so per (row, column, super-block)
//   S = sum over blocks j of sc_j * isum_j        (isum_j = sum of code * q over block j)
//   M = sum over blocks j of m_j * sum_j(q)
// are exact in int32 (|S| <= 8 * 63 * 32 * 15 * 127 < 2^25, |M| <= 8 * 63 * 32 * 127), and one
// float step a super-block scales them: acc += float(S) * (d * da) + float(M) * (dmin * -da).
// Every batch size runs this kernel, so a row's result does not depend on its batch.

// A tile's 6-bit scales and mins of one super-block as bytes, sc[16 j + c] and mn[16 j + c] for
// block j and column c: llama.cpp's get_scale_min_k4 on the 12 planes of 16 columns (plane p,
// byte c: byte p of column c's 12), four planes to a zmm (two ymm): planes 0-3 hold blocks 0-3's
// scales, 4-7 their mins, 8-11 blocks 4-7's low bits (scale in the low nibble, min in the high),
// whose top two bits are those of planes 0-3 (scales) and 4-7 (mins); (x >> 6) << 4 is
// (x >> 2) & 0x30 per byte.
inline void q4k_scale_bytes(const uint8_t* super, uint8_t* sc, uint8_t* mn) {
    const uint8_t* planes = super;  // (the record's first bytes)
#ifdef __AVX512BW__
    const __m512i a = _mm512_loadu_si512(planes), b = _mm512_loadu_si512(planes + 64), c = _mm512_loadu_si512(planes + 128);
    const __m512i low6 = _mm512_set1_epi8(0x3F), low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    _mm512_store_si512(sc, _mm512_and_si512(a, low6));
    _mm512_store_si512(mn, _mm512_and_si512(b, low6));
    _mm512_store_si512(sc + 64, _mm512_or_si512(_mm512_and_si512(c, low4), _mm512_and_si512(_mm512_srli_epi16(a, 2), top2)));
    _mm512_store_si512(mn + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), low4),
                                                _mm512_and_si512(_mm512_srli_epi16(b, 2), top2)));
#else
    const __m256i low6 = _mm256_set1_epi8(0x3F), low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const auto load = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes + at)); };
    const auto store = [](uint8_t* out, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(out), v); };
#pragma GCC unroll 2
    for (int h = 0; h < 64; h += 32) {
        const __m256i a = load(h), b = load(64 + h), c = load(128 + h);
        store(sc + h, _mm256_and_si256(a, low6));
        store(mn + h, _mm256_and_si256(b, low6));
        store(sc + 64 + h, _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_srli_epi16(a, 2), top2)));
        store(mn + 64 + h, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 2), top2)));
    }
#endif
}

// Block j's part of a super-block's integer sums for one row: `scaled` += sc_j * isum_j, `mins`
// += m_j * sum_j(q) (`scale`, `min`: the block's sc and m per column). Exact: any order gives the
// same sums (the AMX path's too).
inline void q4k_add_block(Simd::I& scaled, Simd::I& mins, Simd::I isum, Simd::I scale, Simd::I min, int32_t sum) {
    scaled = Simd::add(scaled, Simd::mullo(scale, isum));
    mins = Simd::add(mins, Simd::mullo(min, Simd::set1(sum)));
}

// The super-block's one float step for one row (activation scale `da`): the operations, in
// this order, of every path that computes q4k.
inline Simd::F q4k_finish_super(Simd::F acc, Simd::I scaled, Simd::I mins, Simd::F d, Simd::F dmin, float da) {
    acc = Simd::fmadd(Simd::to_float(scaled), Simd::mul(d, Simd::fset1(da)), acc);
    return Simd::fmadd(Simd::to_float(mins), Simd::mul(dmin, Simd::fset1(-da)), acc);
}

// Two adjacent int16 as one int32 (the first in the low half), for a broadcast.
inline int32_t load_pair(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// A tile's mins of one super-block as int16 pairs for vpdpwssd: pairs[i][c] = mn[2i][c] | mn[2i + 1][c] << 16.
inline void q4k_min_pairs(const uint8_t* mn, int32_t* pairs) {
#pragma GCC unroll 4
    for (int i = 0; i < kSuperBlocks / 2; ++i)
#pragma GCC unroll 2
        for (int c = 0; c < kTileCols; c += kLanes) {
            const Simd::I lo = Simd::uint8_lanes(mn + 32 * i + c), hi = Simd::uint8_lanes(mn + 32 * i + 16 + c);
            Simd::store_int(pairs + kTileCols * i + c, Simd::or_(lo, Simd::shift_left32(hi, 16)));
        }
}

// tile[r][t * 16 + c] = row r0 + r of A times column c of tile t (G tiles, `tile_bytes` apart), for
// q4k weights and activations with a scale per super-block. From 3 rows on, the mins' sum M of a
// super-block is four vpdpwssd per row and vector (the mins as int16 pairs against the blocks'
// sums of q), not a multiply per block; the output accumulates in `tile` (one load and store per
// super-block), so that 4 rows x 2 tiles keep their chains and integer sums in registers.
template <int R, int G>
void accumulate_q4k(const QuantizedA& qa, int64_t r0, const uint8_t* w, int64_t tile_bytes, float* tile) {
    using I = typename Simd::I;
    using F = typename Simd::F;
    constexpr int V = G * Simd::kVecs;
    constexpr bool kOneChain = one_q4_chain(R * V);
    // The mins as pairs cost their preparation per tile and super-block: worth it from 3 rows on
    // (from memory at 1-2 rows, 4% slower than a multiply per block: NOTES 61). Same sums either way.
    constexpr bool kMinPairs = R >= 3;
    const int64_t blocks = qa.blocks, lq = blocks * kBlock;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) Simd::store(tile + r * G * kTileCols + v * kLanes, Simd::fzero());
    alignas(64) uint8_t sc[G][kSuperBlocks * kTileCols], mn[G][kSuperBlocks * kTileCols];
    alignas(64) int32_t min_pairs[G][kSuperBlocks / 2 * kTileCols];
    for (int64_t s = 0; s < blocks / kSuperBlocks; ++s) {
#pragma GCC unroll 4
        for (int t = 0; t < G; ++t) {
            q4k_scale_bytes(w + t * tile_bytes + s * kSuperRecord, sc[t], mn[t]);
            if constexpr (kMinPairs) q4k_min_pairs(mn[t], min_pairs[t]);
        }
        I scaled[R][V], mins[R][V];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) scaled[r][v] = mins[r][v] = Simd::zero();
        for (int j = 0; j < kSuperBlocks; ++j) {
            const int64_t b = s * kSuperBlocks + j;
            if constexpr (R == 1 && G == kWideGroup)
                prefetch_ahead<G>(w + s * kSuperRecord + j * kRecordBytes[kQ4K], kRecordBytes[kQ4K], tile_bytes);
            I s0[R][V], s1[R][V];
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v) s0[r][v] = s1[r][v] = Simd::zero();
            const int8_t* a = qa.q.data() + r0 * lq + b * kBlock;
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g) {
                I lo[V], hi[V];
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v) {
                    const uint8_t* rec = block_codes<kQ4K>(w + (v / Simd::kVecs) * tile_bytes, b);
                    const I codes = Simd::load(rec + g * 64 + (v % Simd::kVecs) * (64 / Simd::kVecs));
                    lo[v] = Simd::low_nibbles(codes);
                    // In two chains (vpdpbusd: no int16 step to saturate) the high nibbles enter in
                    // place, as 16 x code, and the block's sum is divided back, exactly, once.
                    hi[v] = kOneChain ? Simd::high_nibbles(codes) : Simd::high_nibbles_x16(codes);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int8_t* ar = a + r * lq;
                    const I a0 = Simd::set1(load4(ar + 8 * g)), a1 = Simd::set1(load4(ar + 8 * g + 4));
#pragma GCC unroll 8
                    for (int v = 0; v < V; ++v) {
                        if constexpr (kOneChain) {
                            s0[r][v] = Simd::dot_q4(Simd::dot_q4(s0[r][v], lo[v], a0), hi[v], a1);
                        } else {
                            s0[r][v] = Simd::dot_q4(s0[r][v], lo[v], a0);
                            s1[r][v] = Simd::dot_q4(s1[r][v], hi[v], a1);
                        }
                    }
                }
            }
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) {
                const int lane0 = (v % Simd::kVecs) * kLanes;
                const I scale = Simd::uint8_lanes(sc[v / Simd::kVecs] + kTileCols * j + lane0);
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const I isum = kOneChain ? Simd::finish_q4(s0[r][v]) : Simd::add(s0[r][v], Simd::sra(s1[r][v], 4));
                    if constexpr (kMinPairs) {
                        scaled[r][v] = Simd::add(scaled[r][v], Simd::mullo(scale, isum));
                    } else {
                        const I min = Simd::uint8_lanes(mn[v / Simd::kVecs] + kTileCols * j + lane0);
                        q4k_add_block(scaled[r][v], mins[r][v], isum, scale, min, qa.sum[(r0 + r) * blocks + b]);
                    }
                }
            }
        }
        // The mins' sums and the super-block's one float step.
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int16_t* sums = qa.sum16.data() + (r0 + r) * blocks + s * kSuperBlocks;
            const float da = qa.d[(r0 + r) * blocks + s * kSuperBlocks];
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) {
                const int lane0 = (v % Simd::kVecs) * kLanes;
                if constexpr (kMinPairs) {
                    const int32_t* pairs = min_pairs[v / Simd::kVecs] + lane0;
#pragma GCC unroll 4
                    for (int i = 0; i < kSuperBlocks / 2; ++i)
                        mins[r][v] = Simd::dot_pairs(mins[r][v], Simd::load_int(pairs + kTileCols * i),
                                                     Simd::set1(load_pair(sums + 2 * i)));
                }
                const uint8_t* super = w + (v / Simd::kVecs) * tile_bytes + s * kSuperRecord;
                const F d = Simd::half(super + kQ4KD + 2 * lane0), dmin = Simd::half(super + kQ4KDmin + 2 * lane0);
                float* out = tile + r * G * kTileCols + v * kLanes;
                Simd::store(out, q4k_finish_super(Simd::fload(out), scaled[r][v], mins[r][v], d, dmin, da));
            }
        }
    }
}
