// Quantized weights on AMX-BF16 tiles, for batches of many bf16 rows: the weight's column tiles
// are dequantized to bf16, two at a time, into a thread's panel in the layout of
// amx_bf16_tiles.h, which the bf16 tile products then read for every 16 or 32 rows of the
// chunk. Included by gemm_int8.cpp inside its anonymous namespace, after gemm_int8_amx.h.
//
// Why: the integer tiles (gemm_int8_amx.h) stop after every block of 32 to store and scale their
// int32 tile in fp32 (GGUF's scales change every 32 weights), which holds them far below their
// peak; a bf16 tile accumulates over all of k. At 64 rows and more this runs about as fast as a
// dense bf16 copy of the weight, without the copy's 2 bytes a weight (benchmarks/NOTES.md, 58),
// and it takes every format, Q6_K and Q5_K too.
//
// The dequantized weight is, bit for bit, QuantizedWeight.dequantize (quant_formats.py) rounded
// to bf16: the same float32 operations in the same order (code * scale + offset, or
// (code - zero) * scale), so a product equals the one over the dense bf16 copy on AMX tiles
// (gemm_bf16.cpp). A column's 4 bytes are one 32-bit lane: byte j's code is taken in place as
// code * 2^(8j), with the scale times 2^(-8j) (both exact), which saves a shift a k.
// Activations: the bf16 rows as they are (no quantization); output bf16; epilogue silu_mul as
// the dense GEMM's (gate and up rounded to bf16, silu rounded, their product rounded).
namespace qbf16 {

constexpr int64_t kGroups = 2;                 // column tiles a panel
constexpr int64_t kPanelRow = kGroups * 64;    // bytes: one k-pair row of a panel
constexpr int64_t kChunkBytes = 1 << 20;       // bf16 rows of A per work item (a multiple of 32 rows)

// One panel row: (even[c], odd[c]) as bf16 pairs for the 16 columns c.
inline void put_pair(uint8_t* row, __m512 even, __m512 odd) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // lanes 0-15: even, 16-31: odd
    _mm512_store_si512(row, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both));
}

// Byte j of each lane as float: code * 2^(8j).
inline __m512 byte_lane(__m512i v, int j) {
    return _mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFu << (8 * j)))));
}

// s << bits (bits < 0: >>) on 16-bit lanes; callers mask whole bits of each byte afterwards.
inline __m512i shift_bits(__m512i v, int bits) {
    return bits >= 0 ? _mm512_slli_epi16(v, static_cast<unsigned>(bits)) : _mm512_srli_epi16(v, static_cast<unsigned>(-bits));
}

inline __m512 negate(__m512 v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }

// A block's scales per byte position j: scale * 2^(-8j), exact.
struct ByteScales {
    __m512 s[4];
    explicit ByteScales(__m512 scale) {
        for (int j = 0; j < 4; ++j) s[j] = _mm512_mul_ps(scale, _mm512_set1_ps(std::ldexp(1.0f, -8 * j)));
    }
};

// The 32 weights of one block of a nibble format as 16 panel rows `stride` bytes apart: group g's
// byte j holds k = 8g + j in its low nibble and k = 8g + 4 + j in its high one; `extra(g, lo, hi)`
// ORs in the codes' higher bits (q5f, q6k); `weight(g, j, x)` forms the float weight of x = code *
// 2^(8j).
template <class Extra, class Weight>
inline void nibble_block(const uint8_t* codes, uint8_t* out, int64_t stride, Extra&& extra, Weight&& weight) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * g);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        extra(g, lo, hi);
        __m512 x[8];
        for (int j = 0; j < 4; ++j) {
            x[j] = weight(g, j, byte_lane(lo, j));
            x[4 + j] = weight(g, j, byte_lane(hi, j));
        }
        for (int q = 0; q < 4; ++q) put_pair(out + (4 * g + q) * stride, x[2 * q], x[2 * q + 1]);
    }
}

// code * scale + offset (q4, q4f, q4k, q5f), as QuantizedWeight.dequantize.
struct ScaleOffset {
    ByteScales scale;
    __m512 offset;
    __m512 operator()(int, int j, __m512 x) const { return _mm512_add_ps(_mm512_mul_ps(x, scale.s[j]), offset); }
};

constexpr auto kNoExtra = [](int, __m512i&, __m512i&) {};

// Block b of a column tile (records from `tile`) as 16 panel rows from `out`, `stride` bytes apart.
template <int kFmt>
void dequantize_block(const uint8_t* tile, int64_t b, uint8_t* out, int64_t stride) {
    const uint8_t* rec = block_record<kFmt>(tile, b);
    if constexpr (kFmt == kQ8) {  // codes q + 128, 4 k a group: weight = q * d
        const __m512 d = _mm512_mul_ps(Simd::half(rec + 512), _mm512_set1_ps(std::ldexp(1.0f, -24)));
        const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFF000000u)), flip = _mm512_set1_epi8(-128);
        for (int g = 0; g < 8; ++g) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * g), flip);  // bytes: q as int8
            __m512 x[4];
            for (int j = 0; j < 4; ++j)  // q * 2^24, signed
                x[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_slli_epi32(v, 24 - 8 * j), top)), d);
            put_pair(out + (2 * g) * stride, x[0], x[1]);
            put_pair(out + (2 * g + 1) * stride, x[2], x[3]);
        }
    } else if constexpr (kFmt == kQ4) {
        nibble_block(rec, out, stride, kNoExtra, ScaleOffset{ByteScales(Simd::half(rec + 256)), Simd::half(rec + 288)});
    } else if constexpr (kFmt == kQ4F) {
        nibble_block(rec, out, stride, kNoExtra,
                     ScaleOffset{ByteScales(_mm512_loadu_ps(rec + 256)), _mm512_loadu_ps(rec + 320)});
    } else if constexpr (kFmt == kQ5F) {  // fifth bits: byte j's bit 2g (low nibble), 2g + 1 (high)
        const __m512i fifth = _mm512_loadu_si512(rec + 256), bit4 = _mm512_set1_epi8(0x10);
        nibble_block(
            rec, out, stride,
            [&](int g, __m512i& lo, __m512i& hi) {
                lo = _mm512_or_si512(lo, _mm512_and_si512(shift_bits(fifth, 4 - 2 * g), bit4));
                hi = _mm512_or_si512(hi, _mm512_and_si512(shift_bits(fifth, 3 - 2 * g), bit4));
            },
            ScaleOffset{ByteScales(_mm512_loadu_ps(rec + 320)), _mm512_loadu_ps(rec + 384)});
    } else if constexpr (kFmt == kQ4S) {  // (code - 8) * d
        const ByteScales d(Simd::half(rec + 256));
        nibble_block(rec, out, stride, kNoExtra, [&](int, int j, __m512 x) {
            return _mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(std::ldexp(8.0f, 8 * j))), d.s[j]);
        });
    } else if constexpr (kFmt == kQ4K) {  // per block d * sc and -(dmin * m), as QuantizedWeight.as_q4f
        const uint8_t* super = tile + (b / kSuperBlocks) * kSuperRecord;
        alignas(64) uint8_t sc[kSuperBlocks * kTileCols], mn[kSuperBlocks * kTileCols];
        q4k_scale_bytes(super, sc, mn);
        const int64_t j = b % kSuperBlocks;
        const __m512 scale = _mm512_mul_ps(Simd::half(super + kQ4KD), _mm512_cvtepi32_ps(Simd::uint8_lanes(sc + kTileCols * j)));
        const __m512 offset = negate(_mm512_mul_ps(Simd::half(super + kQ4KDmin), _mm512_cvtepi32_ps(Simd::uint8_lanes(mn + kTileCols * j))));
        nibble_block(block_codes<kQ4K>(tile, b), out, stride, kNoExtra, ScaleOffset{ByteScales(scale), offset});
    } else {  // q6k: (code - 32) * (d * s_h), the top two bits in planes (plane g / 2: bits 4e.., e = g % 2)
        static_assert(kFmt == kQ6K, "every format dequantizes");
        const uint8_t* super = tile + (b / kSuperBlocks) * kQ6KSuper;
        const __m512 d = Simd::half(super + kSuperBlocks * kQ6KBlock);
        const auto half_scale = [&](int h) {
            const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 384 + 16 * h));
            return ByteScales(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s))));
        };
        const ByteScales scales[2] = {half_scale(0), half_scale(1)};
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        nibble_block(
            rec + 128, out, stride,
            [&](int g, __m512i& lo, __m512i& hi) {
                const __m512i plane = _mm512_loadu_si512(rec + 64 * (g / 2));
                const int e = g % 2;
                lo = _mm512_or_si512(lo, _mm512_and_si512(shift_bits(plane, 4 - 4 * e), bits45));
                hi = _mm512_or_si512(hi, _mm512_and_si512(shift_bits(plane, 2 - 4 * e), bits45));
            },
            [&](int g, int j, __m512 x) {
                return _mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(std::ldexp(32.0f, 8 * j))), scales[g / 2].s[j]);
            });
    }
}

// Column tile `t` (of `tiles`) as k-pair rows of 64 bytes from `out`, `stride` bytes apart (a
// column group of a panel); zeros past the last tile.
template <int kFmt>
void dequantize_tile(const uint8_t* packed, int64_t tile_bytes, int64_t t, int64_t tiles, int64_t blocks,
                     uint8_t* out, int64_t stride) {
    if (t >= tiles) {
        for (int64_t row = 0; row < blocks * 16; ++row) std::memset(out + row * stride, 0, 64);
        return;
    }
    const uint8_t* tile = packed + t * tile_bytes;
    for (int64_t b = 0; b < blocks; ++b) dequantize_block<kFmt>(tile, b, out + b * 16 * stride, stride);
}

// Panel p: column tiles 2p and 2p + 1 in the dense AMX GEMM's plain layout ([k / 2][32][2] bf16),
// what the GEMM below multiplies and what the dense copy holds.
template <int kFmt>
void dequantize_panel(const uint8_t* packed, int64_t tile_bytes, int64_t p, int64_t tiles, int64_t blocks,
                      uint8_t* panel) {
    for (int64_t g = 0; g < kGroups; ++g)
        dequantize_tile<kFmt>(packed, tile_bytes, p * kGroups + g, tiles, blocks, panel + g * 64, kPanelRow);
}

// The whole weight in the dense AMX GEMM's packed layout (pagellm_dequant_q_bf16): plain panels,
// or (silu_mul) its panels of [k / 2][64][2], 32 gate columns then the same 32 up ones, from four
// tiles of 8 gate and 8 up columns. The dense bf16 copy, made from the packed records at load
// instead of unpacking the file's blocks in numpy and dequantizing and packing in torch.
template <int kFmt>
void dequantize_weight(const uint8_t* packed, int64_t tiles, int64_t k, bool silu_mul, uint16_t* w, int threads) {
    const int64_t blocks = k / kBlock, tile_bytes = blocks * kRecordBytes[kFmt], kpairs = k / 2;
    auto* out = reinterpret_cast<uint8_t*>(w);
    if (!silu_mul) {
        const int64_t panels = (tiles + kGroups - 1) / kGroups;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
        for (int64_t p = 0; p < panels; ++p)
            dequantize_panel<kFmt>(packed, tile_bytes, p, tiles, blocks, out + p * kpairs * kPanelRow);
        return;
    }
    constexpr int64_t kPerPanel = 4, kRow = kPerPanel * 16 * 4;  // tiles a panel; bytes a k-pair row
    const int64_t slots = (tiles + kPerPanel - 1) / kPerPanel * kPerPanel;  // past the last tile: zeros
#pragma omp parallel num_threads(threads)
    {
        std::vector<uint32_t> buf(static_cast<size_t>(kpairs * kTileCols + 16));
        uint8_t* rows = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < slots; ++t) {
            dequantize_tile<kFmt>(packed, tile_bytes, t, tiles, blocks, rows, 64);
            const int64_t slot = t % kPerPanel;
            uint8_t* panel = out + t / kPerPanel * kpairs * kRow;
            for (int64_t p = 0; p < kpairs; ++p) {  // gate columns 8 slot .. 8 slot + 7, up columns 32 + the same
                std::memcpy(panel + p * kRow + slot * 32, rows + p * 64, 32);
                std::memcpy(panel + p * kRow + 128 + slot * 32, rows + p * 64 + 32, 32);
            }
        }
    }
}

// Writes the panel's results for `rows` rows from r0 (row r of group j at out + j * group_stride
// + r * 16): plain, 16 outputs a column tile; silu_mul, 8 (silu(gate) * up, the dense GEMM's order).
inline void store_rows(const float* out, int64_t group_stride, int64_t r0, int64_t rows, int64_t t0, int64_t tiles,
                       bool silu_mul, int64_t n, uint16_t* c, int64_t ldc) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < kGroups && t0 + j < tiles; ++j) {
            const __m512 v = _mm512_load_ps(out + j * group_stride + r * 16);
            uint16_t* row = c + (r0 + r) * ldc;
            if (!silu_mul) {
                const int64_t col = (t0 + j) * kTileCols;
                _mm256_mask_storeu_epi16(row + col, first_lanes(n - col), (__m256i)_mm512_cvtneps_pbh(v));
                continue;
            }
            const __m512 gate = round_bf16x16(v);  // lanes 0-7 (lanes 8-15: up, unused)
            const __m512 up = round_bf16x16(_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 2, 3, 2)));
            const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gate);
            const __m512 act = round_bf16x16(_mm512_div_ps(gate, _mm512_add_ps(one, exp_x16(neg))));
            const int64_t col = (t0 + j) * 8, left = n - col;
            _mm256_mask_storeu_epi16(row + col, first_lanes(left < 8 ? left : 8), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, up)));
        }
}

// c = a @ W^T (bf16 a, k a multiple of 32) for a packed W of format kFmt; work items are (panel
// of two column tiles, chunk of rows), a thread's panel dequantized once for consecutive items.
template <int kFmt>
void gemm(const uint16_t* a, int64_t lda, int64_t m, int64_t k, const uint8_t* packed, int64_t n, uint16_t* c,
          int64_t ldc, bool silu_mul, int threads) {
    const int64_t per_tile = silu_mul ? 8 : kTileCols;
    const int64_t tiles = (n + per_tile - 1) / per_tile, panels = (tiles + kGroups - 1) / kGroups;
    const int64_t blocks = k / kBlock, tile_bytes = blocks * kRecordBytes[kFmt];
    const int64_t chunk = std::max<int64_t>(2 * amx_bf16::kRows, kChunkBytes / (k * 2) / 32 * 32);
    WorkRanges work(panels, (m + chunk - 1) / chunk, threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        WorkRanges::Item item;
        if (work.next(t, item)) {
            amx_bf16::configure();
            std::vector<uint16_t> panel_buf(static_cast<size_t>(k * kGroups * kTileCols + 32));
            uint8_t* panel = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(panel_buf.data()) + 63) & ~uintptr_t{63});
            int64_t held = -1;
            amx_bf16::TailRows tail;
            do {
                const int64_t t0 = item.panel * kGroups;
                if (held != item.panel) {
                    dequantize_panel<kFmt>(packed, tile_bytes, item.panel, tiles, blocks, panel);
                    amx_memory_barrier();
                    held = item.panel;
                }
                const int64_t m0 = item.chunk * chunk, m1 = std::min(m, m0 + chunk);
                amx_bf16::panel_rows<kGroups>(a, lda, m0, m1, k, reinterpret_cast<const uint16_t*>(panel), nullptr, tail,
                                              [&](int64_t r0, int64_t rows, const float* out, int64_t group_stride) {
                                                  store_rows(out, group_stride, r0, rows, t0, tiles, silu_mul, n, c, ldc);
                                              });
            } while (work.next(t, item));
            _tile_release();
        }
    }
}

}  // namespace qbf16
