// Quantized weights times activations quantized on the fly, summed in integer dot products:
// C[M, N] = A[M, K] @ W[N, K]^T, W held as 4- or 8-bit codes with a scale (and an offset) per
// 32 weights of a row, as GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K store it
// (and --quantization int8).
//
// Why: at batch 1 a step reads every weight once, so its bytes set the time (Q4_1 reads 0.625
// bytes a weight against bf16's 2); at larger batches the integer dot products (vpdpbusd: 64
// multiply-adds an instruction on a zmm, against vdpbf16ps' 32) raise the compute floor.
//
// Activations: each row of A, cut into blocks of 32 along k (a tail padded with zeros), is
// quantized per block to int8 as llama.cpp's Q8_0: d = amax / 127, q = round-half-even(x * (1/d))
// (for q4k and q6k the amax of a super-block of 256, as llama.cpp's Q8_K).
// Per (row, column, block): isum = sum over the block of code * q, in int32, exact; then in fp32
//   q4, q4f, q5f: acc += isum * (dw * da) + mw * (da * sum(q))  weight = dw * code + mw, code 0..15
//                 (q5f: 0..31)
//   q8: acc += (isum - 128 * sum(q)) * (dw * da)            code = q_w + 128 (u8 for vpdpbusd)
//   q4s: acc += (isum - 8 * sum(q)) * (dw * da)             weight = dw * (code - 8), code 0..15
//   q6k: two halves of 16 with int8 scales s0, s1 under one fp16 d per super-block of 256 (weight =
//        d * s_h * (code - 32), code 0..63): per super-block
//        acc += float(sum over its blocks of s0 * (isum0 - 32 * sum0(q)) + s1 * (isum1 - 32 * sum1(q))) * (d * da),
//        the sum exact in int32
// (GGUF's Q4_0 is q4s as stored; the int32 bracket is exact, so no offset is stored or multiplied.)
//
// Packed weight: tiles of 16 columns, one record per block of k (gemm_int8_layout.h).
// One 64-byte group is 16 columns x 4 consecutive k: one vpdpbusd with a broadcast of 4 bytes
// of the quantized activation row adds four products into each column's int32 lane.
//
// Paths, chosen at compile time: AVX-512 VNNI (a tile is one zmm); AVX-VNNI (vpdpbusd on two
// ymm); AVX2 (vpmaddubsw + vpmaddwd). On AVX2, q4's int16 pair sums of a whole block (both
// nibbles in one chain) stay in int16 (|sum| <= 16 * 15 * 127 = 30480) and are widened once per
// block (one chain measured 10-20% faster than two from L2, NOTES 42); with vpdpbusd (no int16
// step) and few vectors in flight q4's high nibbles enter in place, as 16 x code, and the block's
// sum is shifted back once (an AND instead of a shift and an AND per 64 bytes), while a tile of
// 4 rows x 2 zmm takes both nibbles in one chain (one_q4_chain); q8's codes go through
// |w| and sign(a, w), since (q_w + 128) * 127 * 2 would saturate vpmaddubsw's int16. Where the
// compiler targets AMX-INT8, the same sums also run on tiles for big batches (gemm_int8_amx.h).
//
// Epilogue silu_mul (an MLP's gate and up in one product): each tile holds 8 gate columns then
// the same 8 up columns, and the tile's 8 outputs are silu(gate) * up, in fp32, rounded once.
//
// Threading follows gemm_avx2.cpp: work items (chunk of A's rows, group of tiles) split into one
// range per thread with stealing (work_ranges.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "amx_bf16_tiles.h"
#include "avx2_simd.h"
#include "cpu_common.h"
#include "exports.h"
#include "work_ranges.h"

namespace {

#include "gemm_int8_layout.h"

constexpr int kMaxRows = 4;                 // rows of A per register tile
constexpr int64_t kChunkBytes = 192 << 10;  // quantized rows of A kept in L2 while tiles pass
// A chunk holds at least 128 rows however long k is. At an MLP's down projection (k = 8,192-14,336)
// the L2-sized chunk held 12-24 rows, so a 128-token prefill read each weight tile from memory 5-11
// times; 128 rows of A (up to 1.8 MB) read from L3 instead ran q4k 1.05-1.13x and q6k 1.11-1.21x
// at 128 rows on a Zen 4, 1.07x on its AVX2 build; 256 rows no better (NOTES 76).
constexpr int64_t kMinChunkRows = 128;

#include "gemm_int8_quantize.h"

inline int32_t load4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

}  // namespace

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGELLM_QGEMM_ISA 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define PAGELLM_QGEMM_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGELLM_QGEMM_ISA 1
#else
#define PAGELLM_QGEMM_ISA 0
#endif

#if PAGELLM_QGEMM_ISA > 0
#include <immintrin.h>

namespace {

#include "gemm_int8_simd.h"

// q4's nibbles in one int32 chain per output vector, the high nibbles shifted down (one more
// operation per 64 bytes, shared by the register tile's rows), or in two chains with the high
// nibbles in place as 16 x code (the block's sum shifted back, per row and vector). Two chains
// hide vpdpbusd's latency where few vectors are in flight; from 8 on, one does less work a row.
// AVX2's int16 pair sums always take one chain.
constexpr bool one_q4_chain(int vectors) { return Simd::kOneQ4Chain || vectors >= 8; }

constexpr int kLanes = kTileCols / Simd::kVecs;  // columns per vector
constexpr int kGroupBytes = 64;
// One row (a decode step) takes four tiles at once: four weight streams in flight. From DRAM (1B
// shapes, q4s) one thread read 17.9 GB/s with two tiles and 20.6 with four; two threads
// 26.2-27.2 against 27.6-29.4 (benchmarks/NOTES.md, 53).
constexpr int kWideGroup = 4;
// Except q6k: at four tiles its 4 x 2 planes of top bits, codes and chains fill the registers; one
// tile at a time (a single weight stream, prefetched) ran 1.10-1.15x faster at 1B-8B shapes,
// where q4k was level and q4s and q8 0.88-0.98x (NOTES 70).
template <int kFmt>
constexpr int decode_group() { return kFmt == kQ6K ? 1 : kWideGroup; }
// A decode step also prefetches each of its four streams 1 KB ahead into L2: on a 2-core Zen 4,
// 1.02-1.20x the weights' stream rate from memory (3B shapes), and a 1B Q4_K_M decode 1.24x; 512
// B, 2 KB and 4 KB ahead were slower than 1 KB (NOTES 61).
constexpr int64_t kPrefetchAhead = 1024;

// The `bytes` of each of G tiles (`tile_bytes` apart) that lie kPrefetchAhead past `at`, into L2.
template <int G>
inline void prefetch_ahead(const uint8_t* at, int64_t bytes, int64_t tile_bytes) {
#pragma GCC unroll 4
    for (int t = 0; t < G; ++t)
        for (int64_t line = 0; line < bytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(at + t * tile_bytes + kPrefetchAhead + line), _MM_HINT_T1);
}

// Group g's codes of a q5f or q6k block completed from their top bits' plane (q5f: its one
// plane, bit 2g (2g + 1) to bit 4; q6k: plane g / 2, bits 4e, 4e + 1 (+ 2) to bits 4, 5, e = g % 2):
// `lo` and `hi` hold the group's low and high nibbles (each in its byte's low 4 bits).
template <int kFmt>
inline void add_top_bits(typename Simd::I plane, int g, typename Simd::I& lo, typename Simd::I& hi) {
    if constexpr (kFmt == kQ5F) {
        lo = Simd::or_(lo, Simd::bits(plane, 4 - 2 * g, 0x10));
        hi = Simd::or_(hi, Simd::bits(plane, 3 - 2 * g, 0x10));
    } else {
        const int e = g % 2;
        lo = Simd::or_(lo, Simd::bits(plane, 4 - 4 * e, 0x30));
        hi = Simd::or_(hi, Simd::bits(plane, 2 - 4 * e, 0x30));
    }
}

// tile[r][t * 16 + c] = row r0 + r of A times column c of tile t (G tiles, `tile_bytes` apart).
template <int R, int G, int kFmt>
void accumulate(const QuantizedA& qa, int64_t r0, const uint8_t* w, int64_t tile_bytes, float* tile) {
    using I = typename Simd::I;
    using F = typename Simd::F;
    constexpr int V = G * Simd::kVecs;  // vectors across the tiles
    constexpr bool kNibbles = kFmt != kQ8;
    constexpr bool kWide = kFmt == kQ5F || kFmt == kQ6K;  // codes above 15: no int16 chain per block
    constexpr bool kOneChain = kNibbles && !kWide && one_q4_chain(R * V);
    constexpr bool kInPlaceHigh = kNibbles && !kWide && !kOneChain;
    // q6k on vpdpbusd: a chain per half of the block (both nibbles), or four where few vectors
    // are in flight (the halves' high nibbles apart, added back per block).
    constexpr bool kHalfChains = kFmt == kQ6K && !Simd::kOneQ4Chain && R * V >= 4;
    constexpr int kGroups = kNibbles ? 4 : 8;
    const int64_t blocks = qa.blocks, lq = blocks * kBlock;
    F acc[R][V];
    I total[R][V];  // q6k: the super-block's integer sum so far
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) acc[r][v] = Simd::fzero(), total[r][v] = Simd::zero();
    for (int64_t b = 0; b < blocks; ++b) {
        if constexpr (R == 1 && G == decode_group<kFmt>())
            prefetch_ahead<G>(block_record<kFmt>(w, b), kFmt == kQ6K ? kQ6KBlock : kRecordBytes[kFmt], tile_bytes);
        // Two chains per output vector (q4: low / high nibbles; q8: even / odd groups); q6k: its
        // halves' low nibbles in s0 / s1, their high nibbles in s2 / s3 (dot products only).
        I s0[R][V], s1[R][V], s2[R][V], s3[R][V];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) s0[r][v] = s1[r][v] = s2[r][v] = s3[r][v] = Simd::zero();
        const int8_t* a = qa.q.data() + r0 * lq + b * kBlock;
        I planes[kFmt == kQ6K ? 2 : 1][V];  // the codes' bits above the nibbles (q5f, q6k)
        if constexpr (kWide) {
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
#pragma GCC unroll 2
                for (int p = 0; p < (kFmt == kQ6K ? 2 : 1); ++p)
                    planes[p][v] = Simd::load(block_record<kFmt>(w + (v / Simd::kVecs) * tile_bytes, b) +
                                              top_bits_plane(kFmt, p) + (v % Simd::kVecs) * (kGroupBytes / Simd::kVecs));
        }
#pragma GCC unroll 8
        for (int g = 0; g < kGroups; g += kNibbles ? 1 : 2) {
            I lo[V], hi[V];
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v) {
                const uint8_t* rec = block_codes<kFmt>(w + (v / Simd::kVecs) * tile_bytes, b);
                const int off = (v % Simd::kVecs) * (kGroupBytes / Simd::kVecs);
                if constexpr (kNibbles) {
                    const I codes = Simd::load(rec + g * kGroupBytes + off);
                    lo[v] = Simd::low_nibbles(codes);
                    // vpdpbusd (no int16 step to saturate) takes 4-bit high nibbles in place, as
                    // 16 x code; the block's sum is divided back, exactly, once.
                    hi[v] = kInPlaceHigh ? Simd::high_nibbles_x16(codes) : Simd::high_nibbles(codes);
                    if constexpr (kWide) add_top_bits<kFmt>(planes[kFmt == kQ6K ? g / 2 : 0][v], g, lo[v], hi[v]);
                } else {
                    lo[v] = Simd::load(rec + g * kGroupBytes + off);
                    hi[v] = Simd::load(rec + (g + 1) * kGroupBytes + off);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int8_t* ar = a + r * lq;
                const I a0 = Simd::set1(load4(ar + (kNibbles ? 8 * g : 4 * g)));
                const I a1 = Simd::set1(load4(ar + (kNibbles ? 8 * g + 4 : 4 * g + 4)));
#pragma GCC unroll 8
                for (int v = 0; v < V; ++v) {
                    if constexpr (kOneChain) {
                        s0[r][v] = Simd::dot_q4(Simd::dot_q4(s0[r][v], lo[v], a0), hi[v], a1);
                    } else if constexpr (kWide && Simd::kOneQ4Chain) {
                        // int16 pair sums of one group (|sum| <= 4 * 63 * 127), widened at once;
                        // q6k's halves (groups 0-1, 2-3) apart.
                        const I group = Simd::finish_q4(Simd::dot_q4(Simd::dot_q4(Simd::zero(), lo[v], a0), hi[v], a1));
                        if (kFmt == kQ6K && g >= 2) {
                            s1[r][v] = Simd::add(s1[r][v], group);
                        } else {
                            s0[r][v] = Simd::add(s0[r][v], group);
                        }
                    } else if constexpr (kHalfChains) {
                        I& half = g < 2 ? s0[r][v] : s1[r][v];
                        half = Simd::dot_q4(Simd::dot_q4(half, lo[v], a0), hi[v], a1);
                    } else if constexpr (kFmt == kQ6K) {
                        I& low = g < 2 ? s0[r][v] : s1[r][v];
                        I& high = g < 2 ? s2[r][v] : s3[r][v];
                        low = Simd::dot_q4(low, lo[v], a0);
                        high = Simd::dot_q4(high, hi[v], a1);
                    } else if constexpr (kNibbles) {
                        s0[r][v] = Simd::dot_q4(s0[r][v], lo[v], a0);
                        s1[r][v] = Simd::dot_q4(s1[r][v], hi[v], a1);
                    } else {
                        s0[r][v] = Simd::dot_q8(s0[r][v], lo[v], a0);
                        s1[r][v] = Simd::dot_q8(s1[r][v], hi[v], a1);
                    }
                }
            }
        }
        // The block's epilogue in fp32.
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
            const uint8_t* rec = block_record<kFmt>(w + (v / Simd::kVecs) * tile_bytes, b);
            const int lane0 = (v % Simd::kVecs) * kLanes;
            F dw, mw;
            I sc0, sc1;
            if constexpr (kFmt == kQ4F || kFmt == kQ5F) {
                constexpr int kScales = kFmt == kQ4F ? 256 : 320;
                dw = Simd::load_float(rec + kScales + 4 * lane0);
                mw = Simd::load_float(rec + kScales + 64 + 4 * lane0);
            } else if constexpr (kFmt == kQ6K) {
                sc0 = Simd::int8_scales(rec + 384 + lane0);
                sc1 = Simd::int8_scales(rec + 400 + lane0);
                // d of the super-block, after its 8 blocks
                dw = Simd::half(w + (v / Simd::kVecs) * tile_bytes + (b / kSuperBlocks) * kQ6KSuper +
                                kSuperBlocks * kQ6KBlock + 2 * lane0);
            } else if constexpr (kFmt == kQ4S) {
                dw = Simd::half(rec + 256 + 2 * lane0);
            } else {
                dw = Simd::half(rec + (kNibbles ? 256 : 512) + 2 * lane0);
                mw = kNibbles ? Simd::half(rec + 288 + 2 * lane0) : Simd::fzero();
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int64_t ab = (r0 + r) * blocks + b;
                const float da = qa.d[ab];
                I isum;
                if constexpr (kFmt == kQ6K) {
                    const int32_t low = qa.sum_lo[ab], high = qa.sum[ab] - low;
                    I half0 = Simd::add(s0[r][v], Simd::set1(-32 * low)), half1 = Simd::add(s1[r][v], Simd::set1(-32 * high));
                    if constexpr (!Simd::kOneQ4Chain && !kHalfChains)
                        half0 = Simd::add(half0, s2[r][v]), half1 = Simd::add(half1, s3[r][v]);
                    // Summed over the super-block in int32 (|total| <= 16 * 128 * 16 * 32 * 127 < 2^28),
                    // scaled once at its end.
                    total[r][v] = Simd::add(total[r][v], Simd::add(Simd::mullo(sc0, half0), Simd::mullo(sc1, half1)));
                    if (b % kSuperBlocks == kSuperBlocks - 1) {
                        acc[r][v] = Simd::fmadd(Simd::to_float(total[r][v]), Simd::mul(dw, Simd::fset1(da)), acc[r][v]);
                        total[r][v] = Simd::zero();
                    }
                    continue;
                } else if constexpr (kWide) {
                    isum = Simd::add(s0[r][v], s1[r][v]);  // int32 sums on every path
                } else if constexpr (kOneChain) {
                    isum = Simd::finish_q4(s0[r][v]);
                } else if constexpr (kInPlaceHigh) {
                    isum = Simd::add(s0[r][v], Simd::sra(s1[r][v], 4));
                } else {
                    isum = Simd::add(s0[r][v], s1[r][v]);
                    if constexpr (Simd::kQ8Offset != 0) isum = Simd::add(isum, Simd::set1(-Simd::kQ8Offset * qa.sum[ab]));
                }
                if constexpr (kFmt == kQ4S) isum = Simd::add(isum, Simd::set1(-code_zero(kFmt) * qa.sum[ab]));
                acc[r][v] = Simd::fmadd(Simd::to_float(isum), Simd::mul(dw, Simd::fset1(da)), acc[r][v]);
                if constexpr (kNibbles && kFmt != kQ6K && kFmt != kQ4S)
                    acc[r][v] = Simd::fmadd(mw, Simd::fset1(da * static_cast<float>(qa.sum[ab])), acc[r][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) Simd::store(tile + r * G * kTileCols + v * kLanes, acc[r][v]);
}

using TileFn = void (*)(const QuantizedA&, int64_t, const uint8_t*, int64_t, float*);

#include "gemm_int8_q4k.h"

// The register-tile kernel of a format: q4k's own (integer scales), else `accumulate`.
template <int R, int G, int kFmt>
constexpr TileFn tile_kernel() {
    if constexpr (kFmt == kQ4K) {
        return accumulate_q4k<R, G>;
    } else {
        return accumulate<R, G, kFmt>;
    }
}

// Whether 3-4 rows take two tiles at once: the 4-bit formats on AVX-512, whose 32 registers hold
// 4 x 2 chains and sums (the weights unpacked once for 4 rows, an activation broadcast serving
// two tiles); elsewhere one tile (register budget).
template <int kFmt>
constexpr bool pair_tiles() {
    return Simd::kVecs == 1 && (kFmt == kQ4 || kFmt == kQ4S || kFmt == kQ4F || kFmt == kQ4K);
}

// One row takes decode_group tiles at once, 2 rows two (more independent chains for the latency of
// vpdpbusd, more weight streams in flight), 3-4 rows two or one (pair_tiles).
template <int kFmt>
TileFn tile_fn(int rows, int group) {
    if constexpr (decode_group<kFmt>() == kWideGroup) {  // (q6k decodes one tile: no wide kernel)
        if (group == kWideGroup) return tile_kernel<1, kWideGroup, kFmt>();
    }
    if (group == 2) {
        if constexpr (pair_tiles<kFmt>()) {
            static constexpr TileFn kTwo[kMaxRows] = {tile_kernel<1, 2, kFmt>(), tile_kernel<2, 2, kFmt>(),
                                                      tile_kernel<3, 2, kFmt>(), tile_kernel<4, 2, kFmt>()};
            return kTwo[rows - 1];
        }
        return rows == 1 ? tile_kernel<1, 2, kFmt>() : tile_kernel<2, 2, kFmt>();
    }
    static constexpr TileFn kOne[kMaxRows] = {tile_kernel<1, 1, kFmt>(), tile_kernel<2, 1, kFmt>(),
                                              tile_kernel<3, 1, kFmt>(), tile_kernel<4, 1, kFmt>()};
    return kOne[rows - 1];
}

// Writes `rows` x `tiles` finished tiles (16 columns each) to C from tile index t0: plain, 16
// outputs a tile; silu_mul, 8 (silu(gate) * up).
template <bool kBf16Out>
void store_tile(const float* tile, int rows, int tiles, int64_t t0, bool silu_mul, int64_t n, void* c, int64_t ldc,
                int64_t r0) {
    constexpr int64_t kElem = kBf16Out ? 2 : 4;
    const int cols = tiles * kTileCols;
    for (int r = 0; r < rows; ++r) {
        char* row = static_cast<char*>(c) + (r0 + r) * ldc * kElem;
        const float* t = tile + r * cols;
        if (!silu_mul) {
            const int64_t col0 = t0 * kTileCols;
            for (int x = 0; x < cols && col0 + x < n; x += 8)
                store8<kBf16Out>(row + (col0 + x) * kElem, _mm256_loadu_ps(t + x), n - col0 - x);
            continue;
        }
        for (int g = 0; g < tiles && (t0 + g) * 8 < n; ++g) {
            const __m256 gate = _mm256_loadu_ps(t + g * kTileCols), up = _mm256_loadu_ps(t + g * kTileCols + 8);
            const __m256 act = silu_x8(gate);
            const int64_t col = (t0 + g) * 8;
            store8<kBf16Out>(row + col * kElem, _mm256_mul_ps(act, up), n - col);
        }
    }
}

#include "gemm_int8_unpacked.h"

template <int kFmt, bool kBf16Out>
void gemm(const QuantizedA& qa, int64_t m, const uint8_t* packed, int64_t n, void* c, int64_t ldc, bool silu_mul,
          int threads) {
    const int64_t per_tile = silu_mul ? 8 : kTileCols;  // outputs a tile gives
    const int64_t tiles = (n + per_tile - 1) / per_tile;
    const int64_t tile_bytes = qa.blocks * kRecordBytes[kFmt];
    const int64_t row_bytes = qa.blocks * kBlock;
    const int64_t chunk = std::max<int64_t>(kMinChunkRows, kChunkBytes / row_bytes / kMaxRows * kMaxRows);
    // Where chunks hold at least kUnpackMinRows rows, every work item (two tiles over a chunk)
    // unpacks its codes first (unpacks); the fallback's 3-4-row tiles need group 1 for these formats.
    const bool unpack = unpacks(kFmt) && std::min(m, chunk) >= kUnpackMinRows;
    const int group = m == 1 && tiles >= decode_group<kFmt>()                         ? decode_group<kFmt>()
                      : (m <= 2 || pair_tiles<kFmt>() || unpack) && tiles >= 2 ? 2
                                                                                     : 1;
    const int64_t groups = (tiles + group - 1) / group;
    WorkRanges work(groups, (m + chunk - 1) / chunk, threads);
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float tile[kMaxRows * 4 * kTileCols];
        // Each tile's codes are written before they are read: no zeroing.
        const std::unique_ptr<uint8_t[]> codes(unpack ? new uint8_t[group * qa.blocks * kUnpackedBlock] : nullptr);
        const int t = omp_get_thread_num();
        for (WorkRanges::Item item; work.next(t, item);) {
            const int64_t t0 = item.panel * group, count = std::min<int64_t>(group, tiles - t0);
            const int64_t m0 = item.chunk * chunk, m1 = std::min(m, m0 + chunk);
            if (unpack) {
                multiply_unpacked<kFmt, kBf16Out>(qa, m0, m1, packed + t0 * tile_bytes, tile_bytes, count, t0,
                                                 codes.get(), tile, silu_mul, n, c, ldc);
                continue;
            }
            for (int64_t r0 = m0; r0 < m1; r0 += kMaxRows) {
                const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - r0));
                if (count == group && group > 1) {
                    tile_fn<kFmt>(rows, group)(qa, r0, packed + t0 * tile_bytes, tile_bytes, tile);
                    store_tile<kBf16Out>(tile, rows, group, t0, silu_mul, n, c, ldc, r0);
                    continue;
                }
                for (int64_t x = 0; x < count; ++x) {
                    tile_fn<kFmt>(rows, 1)(qa, r0, packed + (t0 + x) * tile_bytes, tile_bytes, tile);
                    store_tile<kBf16Out>(tile, rows, 1, t0 + x, silu_mul, n, c, ldc, r0);
                }
            }
        }
    }
}

#if PAGELLM_QGEMM_ISA == 3 && defined(PAGELLM_AMX) && defined(__AMX_INT8__)
#define PAGELLM_QGEMM_AMX 1
#include "gemm_int8_amx.h"
#include "gemm_int8_bf16_tiles.h"
#endif

}  // namespace
#endif

extern "C" {

// Which integer path this build has: 0 none (no AVX2/FMA/F16C), 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI.
int pagellm_gemm_q_isa() { return PAGELLM_QGEMM_ISA; }

// 1 when this CPU (cpuid, so an emulated CPU's, whatever /proc/cpuinfo says) has what the
// build's integer path executes, else 0. Compiled for the baseline ISA: safe to call anywhere.
__attribute__((target("arch=x86-64")))
int pagellm_gemm_q_runs_here() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    switch (PAGELLM_QGEMM_ISA) {
        case 3:
            return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vnni");
        case 2:
            return avx2 && __builtin_cpu_supports("avxvnni");
        case 1:
            return avx2;
        default:
            return 0;
    }
}

// 1 when this build has the integer GEMM on AMX tiles and this process may use them, else 0.
int pagellm_gemm_q_amx_available() {
#ifdef PAGELLM_QGEMM_AMX
    return pagellm_gemm_q_runs_here() && amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// The activation quantization the GEMM applies, for tests: a [m, k] (rows lda apart; a_dtype 0
// float32, 1 bf16) -> q [m, blocks * 32] int8, d [m, blocks] float32, sum [m, blocks] int32;
// super_scale 1: a scale per 256 (q4k's and q6k's).
int pagellm_quantize_rows(const void* a, int64_t lda, int64_t m, int64_t k, int a_dtype, void* q, void* d, void* sum,
                          int super_scale, int num_threads) {
    if (m < 0 || k <= 0 || lda < k || (a_dtype != 0 && a_dtype != 1) || (super_scale != 0 && super_scale != 1))
        return -1;
    QuantizedA qa;
    quantize_rows(a, lda, m, k, a_dtype == 1, qa, num_threads < 1 ? 1 : num_threads, 1, super_scale == 1);
    std::memcpy(q, qa.q.data(), qa.q.size());
    std::memcpy(d, qa.d.data(), qa.d.size() * sizeof(float));
    std::memcpy(sum, qa.sum.data(), qa.sum.size() * sizeof(int32_t));
    return 0;
}

// c[m, n] = a[m, k] @ W^T for a packed W (layout above; w_format 0 q4, 1 q8, 2 q4f, 3 q5f, 4 q6k, 5 q4s,
// 6 q4k: k a multiple of 256) with k's blocks.
// a_dtype: 0 float32, 1 bf16 (c has a's dtype); epilogue 0 plain, 1 silu_mul (n = the gate / up
// width); tiles (pagellm_gemm_q_amx_available): 0 integer dot products; 1 the same bits on AMX-INT8
// tiles (q4, q8, q4f, q4s, q4k); 2 the weight dequantized to bf16 on AMX-BF16 tiles (bf16 a, k a
// multiple of 32; every format). Returns 0, -1 on a bad argument, -2 where the build has no
// integer path (or no AMX one, if asked).
int pagellm_gemm_q(const void* a, int64_t lda, int64_t m, int64_t k, const void* packed, int64_t n, void* c,
                   int64_t ldc, int a_dtype, int w_format, int epilogue, int num_threads, int tiles) {
#if PAGELLM_QGEMM_ISA > 0
    if (m < 0 || k <= 0 || n <= 0 || lda < k || ldc < n) return -1;
    if ((a_dtype != 0 && a_dtype != 1) || w_format < 0 || w_format >= kFormats || (epilogue != 0 && epilogue != 1))
        return -1;
    if (super_scaled(w_format) && k % (kSuperBlocks * kBlock) != 0) return -1;
    if (tiles < 0 || tiles > 2) return -1;
    if (tiles == 1 && (w_format == kQ5F || w_format == kQ6K)) return -1;  // integer tiles: q4, q8, q4f, q4s, q4k
    if (tiles == 2 && (a_dtype != 1 || k % kBlock != 0)) return -1;       // bf16 tiles: bf16 rows, whole blocks
    if (tiles != 0 && !pagellm_gemm_q_amx_available()) return -2;
    if (m == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const auto* w = static_cast<const uint8_t*>(packed);
#ifdef PAGELLM_QGEMM_AMX
    if (tiles == 2) {
        using BfFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, uint16_t*, int64_t,
                              bool, int);
        static constexpr BfFn kBf16[kFormats] = {qbf16::gemm<kQ4>,  qbf16::gemm<kQ8>,  qbf16::gemm<kQ4F>,
                                                 qbf16::gemm<kQ5F>, qbf16::gemm<kQ6K>, qbf16::gemm<kQ4S>,
                                                 qbf16::gemm<kQ4K>};
        kBf16[w_format](static_cast<const uint16_t*>(a), lda, m, k, w, n, static_cast<uint16_t*>(c), ldc, epilogue == 1,
                        num_threads);
        return 0;
    }
#endif
    using Fn = void (*)(const QuantizedA&, int64_t, const uint8_t*, int64_t, void*, int64_t, bool, int);
    QuantizedA qa;
    quantize_rows(a, lda, m, k, a_dtype == 1, qa, num_threads, tiles == 1 ? 16 : 1, super_scaled(w_format));
#ifdef PAGELLM_QGEMM_AMX
    static constexpr Fn kAmx[kFormats][2] = {{qamx::gemm<kQ4, false>, qamx::gemm<kQ4, true>},
                                             {qamx::gemm<kQ8, false>, qamx::gemm<kQ8, true>},
                                             {qamx::gemm<kQ4F, false>, qamx::gemm<kQ4F, true>},
                                             {nullptr, nullptr},
                                             {nullptr, nullptr},
                                             {qamx::gemm<kQ4S, false>, qamx::gemm<kQ4S, true>},
                                             {qamx::gemm<kQ4K, false>, qamx::gemm<kQ4K, true>}};
    if (tiles == 1) {
        kAmx[w_format][a_dtype](qa, m, w, n, c, ldc, epilogue == 1, num_threads);
        return 0;
    }
#endif
    static constexpr Fn kGemm[kFormats][2] = {{gemm<kQ4, false>, gemm<kQ4, true>},
                                              {gemm<kQ8, false>, gemm<kQ8, true>},
                                              {gemm<kQ4F, false>, gemm<kQ4F, true>},
                                              {gemm<kQ5F, false>, gemm<kQ5F, true>},
                                              {gemm<kQ6K, false>, gemm<kQ6K, true>},
                                              {gemm<kQ4S, false>, gemm<kQ4S, true>},
                                              {gemm<kQ4K, false>, gemm<kQ4K, true>}};
    kGemm[w_format][a_dtype](qa, m, w, n, c, ldc, epilogue == 1, num_threads);
    return 0;
#else
    (void)a, (void)lda, (void)m, (void)k, (void)packed, (void)n, (void)c, (void)ldc, (void)a_dtype, (void)w_format,
        (void)epilogue, (void)num_threads, (void)tiles;
    return -2;
#endif
}

// A packed weight (w_format, k a multiple of 32; q4k and q6k of 256) of `tiles` column tiles,
// dequantized to bf16 into w in the dense AMX GEMM's packed layout (gemm_bf16.cpp): its plain
// panels, or with silu_mul (a silu_mul weight) its silu_mul panels. QuantizedWeight.dequantize()
// rounded to bf16: the dense copy's weight. Returns 0, -1 on a bad argument, -2 where the build
// lacks the bf16 tiles.
int pagellm_dequant_q_bf16(const void* packed, int64_t tiles, int64_t k, int w_format, int silu_mul, void* w,
                           int num_threads) {
#ifdef PAGELLM_QGEMM_AMX
    if (tiles < 0 || k <= 0 || k % kBlock != 0 || w_format < 0 || w_format >= kFormats || (silu_mul != 0 && silu_mul != 1))
        return -1;
    if (super_scaled(w_format) && k % (kSuperBlocks * kBlock) != 0) return -1;
    using Fn = void (*)(const uint8_t*, int64_t, int64_t, bool, uint16_t*, int);
    static constexpr Fn kDequant[kFormats] = {qbf16::dequantize_weight<kQ4>,  qbf16::dequantize_weight<kQ8>,
                                              qbf16::dequantize_weight<kQ4F>, qbf16::dequantize_weight<kQ5F>,
                                              qbf16::dequantize_weight<kQ6K>, qbf16::dequantize_weight<kQ4S>,
                                              qbf16::dequantize_weight<kQ4K>};
    kDequant[w_format](static_cast<const uint8_t*>(packed), tiles, k, silu_mul == 1, static_cast<uint16_t*>(w),
                       num_threads < 1 ? 1 : num_threads);
    return 0;
#else
    (void)packed, (void)tiles, (void)k, (void)w_format, (void)silu_mul, (void)w, (void)num_threads;
    return -2;
#endif
}

}  // extern "C"
