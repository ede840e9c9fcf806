// Paged attention on AVX2 + FMA, head_dim 64, 128 and 256: every dtype on CPUs without AVX-512
// BF16, float32 queries on all of them (the AVX-512 BF16 path takes bf16 ones there).
#pragma once

#include "attention_common.h"
#include "avx2_simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGELLM_ATTENTION_AVX2 1
namespace {

// attend_one for head_dim 64 and 128 on AVX2 + FMA, float32 arithmetic throughout: every dtype
// on CPUs without AVX-512 BF16 (Haswell..Skylake, AMD Zen 1-3: the -march=x86-64-v3 build), and
// float32 caches everywhere (on an AVX-512 build it replaces the compiler-vectorized attend_one
// for float32: 17.4 ms per 2 layers of 64 x 192 decode rows against about 5.5).
// Against the compiler-vectorized attend_one: no float32 copy of each cache row (widened in
// registers), no horizontal sum per score (a head's accumulators for 4 or 8 positions are
// reduced together with hadd), up to 3 query heads per pass over a key or value row, a
// vectorized exp, and value sums held in registers over a tile of 16 positions.
// Measured on a Sapphire Rapids VM (x86-64-v3 build, so attend_one against this), decode
// attention over 64 rows x 192 positions, 30 layers' caches in turn, 9 heads / 3 KV heads,
// median ms per step, 1 / 2 threads: float32 145 -> 82 / 70 -> 41, bf16 112 -> 49 / 57 -> 26,
// fp8 251 -> 52 / 130 -> 28; a 4 x 512-token prefill (5 layers, 2 threads): float32 313 -> 89,
// bf16 289 -> 78, fp8 855 -> 145.

constexpr int64_t kAvx2Tile = 16;  // positions whose rows are looked up (and prefetched) at a time

// 16 consecutive values (query or cache row) as two float32 vectors. float32: in order. bf16
// and e4m3: the even values (0, 2, .., 14), then the odd ones: a 32-bit lane holds a pair, and
// `<< 16` / `& 0xffff0000` widen it in 2 ops (in order would take 4, two of them shuffles).
// Queries, keys, values and the sums all share the order; only the output puts it back.
inline void split_pairs(__m256i x, __m256& even, __m256& odd) {
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void load16(const float* p, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& a, __m256& b) {
    split_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), a, b);
}
// 16 e4m3 bytes -> their bf16 bits (e4m3_to_bf16_bits, exactly), 16 lanes of 16 bits: normals
// by arithmetic, subnormals by pshufb from kE4m3Subnormals (bytes 2m, 2m + 1), NaN, then the sign.
inline __m256i e4m3x16_to_bf16(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    __m256i r = _mm256_add_epi16(_mm256_slli_epi16(mag, 4), _mm256_set1_epi16(120 << 7));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE4m3Subnormals)));
    const __m256i index = _mm256_add_epi16(_mm256_mullo_epi16(mag, _mm256_set1_epi16(0x0202)), _mm256_set1_epi16(0x0100));
    r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(table, index), _mm256_cmpgt_epi16(_mm256_set1_epi16(8), mag));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7fc0), _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)));
    return _mm256_or_si256(r, _mm256_slli_epi16(_mm256_xor_si256(w, mag), 8));
}

// 16 int8 codes -> their bf16 bits in order, exactly (|code| <= 127): widened to float32, whose
// upper halves these are.
inline __m256i int8x16_to_bf16(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))), 16);
    const __m256i hi =
        _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))), 16);
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);  // packs per 128-bit lane
}

// exp_nonpositive on 8 lanes (the same reduction and polynomial, with FMAs); float32 takes the
// 1-ulp exp_x8 (avx2_simd.h) instead. max returns its second operand for NaN: NaN stays NaN.
inline __m256 exp_nonpositive_x8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6188865e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503406e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022657e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// The rows of one KV head's positions [start, ctx), kAvx2Tile at a time, through the block table.
// Each row looked up prefetches the one kPrefetchDistance positions ahead (as
// for_each_context_row), or, with `values` (see attend_one_avx2), the first rows up front and
// each position's value row along with its key row, and the value pass's walk none.
template <int D, typename KV>
class ContextTiles {
  public:
    ContextTiles(const KV* cache, const int64_t* table, int64_t start, int64_t ctx, int64_t block_size,
                 int64_t row_stride, int64_t offset, bool ahead, const KV* values = nullptr)
        : cache_(cache + offset), values_(values ? values + offset : nullptr), table_(table), ctx_(ctx),
          block_size_(block_size), row_stride_(row_stride), pos_(start), block_(start / block_size),
          i_(start % block_size), ahead_block_((start + kPrefetchDistance) / block_size),
          ahead_i_((start + kPrefetchDistance) % block_size), ahead_(ahead) {
        int64_t block = block_, i = i_;
        if (values)
            for (int64_t p = start; p < ctx && p < start + kPrefetchDistance; ++p) prefetch(cache_ + index(block, i));
    }

    // rows[0:n] = the next n = min(kAvx2Tile, positions left) rows; rows[n:round_up(n, 8)] = the
    // last one again (a valid row: whatever is computed from it is dropped). Returns n.
    int64_t next(const KV** rows) {
        const int64_t n = ctx_ - pos_ < kAvx2Tile ? ctx_ - pos_ : kAvx2Tile;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t at = index(block_, i_);
            rows[i] = cache_ + at;
            if (values_) prefetch(values_ + at);
            if (ahead_ && pos_ + i + kPrefetchDistance < ctx_) prefetch(cache_ + index(ahead_block_, ahead_i_));
        }
        pos_ += n;
        for (int64_t i = n; i < ((n + 7) & ~int64_t{7}); ++i) rows[i] = rows[n - 1];
        return n;
    }

  private:
    static void prefetch(const KV* row) {
        const char* a = reinterpret_cast<const char*>(row);
        for (int64_t b = 0; b < kv_row<KV>(D) * int64_t{sizeof(KV)}; b += 64) __builtin_prefetch(a + b, 0, 2);
    }
    // The next row's offset from cache_ (block, i: its block-table entry and position there).
    int64_t index(int64_t& block, int64_t& i) const {
        const int64_t at = (table_[block] * block_size_ + i) * row_stride_;
        if (++i == block_size_) {
            i = 0;
            ++block;
        }
        return at;
    }
    const KV* cache_;
    const KV* values_;
    const int64_t* table_;
    int64_t ctx_, block_size_, row_stride_, pos_, block_, i_, ahead_block_, ahead_i_;
    bool ahead_;
};

// s[g * cs + i] = q_g . rows[i] for NG query heads (q: [NG][D], scaled, load16 order) and P
// positions: NG x P accumulators, each key row widened once for all NG heads, and each head's
// P sums reduced 4 at a time by hadd.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

template <int NG, int P, int D, typename KV>
inline void score_group(const float* q, const KV* const* rows, float* s, int64_t cs) {
    __m256 acc[NG][P];
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
        for (int i = 0; i < P; ++i) acc[g][i] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < D; j += 16)
#pragma GCC unroll 8
        for (int i = 0; i < P; ++i) {
            __m256 k0, k1;
            load16(rows[i] + j, k0, k1);
#pragma GCC unroll 8
            for (int g = 0; g < NG; ++g) {
                acc[g][i] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(q + g * D + j), acc[g][i]);
                acc[g][i] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(q + g * D + j + 8), acc[g][i]);
            }
        }
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
        for (int i = 0; i < P; i += 4)
            _mm_storeu_ps(s + g * cs + i, sum4(acc[g][i], acc[g][i + 1], acc[g][i + 2], acc[g][i + 3]));
}

// acc[g][0:D] += sum over i < n of w[g * cs + i] * rows[i] for NG query heads, 8 * VC columns
// at a time in registers (NG * VC accumulators: at most 12 of the 16 ymm registers).
template <int NG, int VC, int D, typename KV>
inline void value_group(const float* w, int64_t cs, const KV* const* rows, int64_t n, float* acc) {
    for (int j0 = 0; j0 < D; j0 += 8 * VC) {
        __m256 a[NG][VC];
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < VC; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + j0 + 8 * c);
        for (int64_t i = 0; i < n; ++i) {
            __m256 wg[NG];
#pragma GCC unroll 8
            for (int g = 0; g < NG; ++g) wg[g] = _mm256_broadcast_ss(w + g * cs + i);
#pragma GCC unroll 8
            for (int c = 0; c < VC; c += 2) {
                __m256 v0, v1;
                load16(rows[i] + j0 + 8 * c, v0, v1);
#pragma GCC unroll 8
                for (int g = 0; g < NG; ++g) {
                    a[g][c] = _mm256_fmadd_ps(wg[g], v0, a[g][c]);
                    a[g][c + 1] = _mm256_fmadd_ps(wg[g], v1, a[g][c + 1]);
                }
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < VC; ++c) _mm256_storeu_ps(acc + g * D + j0 + 8 * c, a[g][c]);
    }
}

// sg[0:cs] (cs = ctx rounded up to 8; the lanes past ctx hold copies of the last score) ->
// exp(sg - max) over the first ctx, 0 past them; returns their sum (and a sink's exp(sink - max)
// where it is not -inf). A NaN score is passed over by the max and makes the sum, so the head's
// whole output, NaN (as attend_one, and torch).
template <bool kPrecise>
inline float exp_scores(float* sg, int64_t ctx, int64_t cs, float sink = -INFINITY) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (int64_t p = 0; p < cs; p += 8) vm = _mm256_max_ps(_mm256_loadu_ps(sg + p), vm);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 vmax = _mm256_broadcastss_ps(m4);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t p = 0; p < cs; p += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sg + p), vmax);
        __m256 e = kPrecise ? exp_x8(x) : exp_nonpositive_x8(x);
        if (p + 8 > ctx)
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ctx - p)),
                                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        _mm256_storeu_ps(sg + p, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4))) + sink_term(sink, _mm_cvtss_f32(m4));
}

// The rows the score and value loops read for a tile of n positions (ContextTiles::next's
// rows): in place, or decoded into buf [kAvx2Tile][D] once for every query head: an fp8 cache's
// (Row = uint16_t) to bf16, an int8 cache's codes to the query's type (their scales apply to the
// scores and weights). The loops then are the bf16 (or float32) ones, so an fp8 cache gives, bit
// for bit, what the bf16 kernel gives over it widened. Decoding inside the loops instead ran out
// of registers: with this, fp8 decode 54.5 -> 51.7 ms, prefill 272 -> 241 ms (1 thread).
template <int D, typename KV, typename Row>
inline const Row* const* tile_rows(const KV* const* rows, int64_t n, Row* buf, const Row** decoded) {
    if constexpr (std::is_same_v<KV, Row>) {
        (void)n, (void)buf, (void)decoded;
        return rows;
    } else {
        for (int64_t i = 0; i < n; ++i) {
            Row* out = buf + i * D;
            for (int j = 0; j < D; j += 16) {
                if constexpr (std::is_same_v<KV, uint8_t>) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), e4m3x16_to_bf16(rows[i] + j));
                } else if constexpr (std::is_same_v<Row, uint16_t>) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), int8x16_to_bf16(rows[i] + j));
                } else {
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + j));
                    _mm256_storeu_ps(out + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
                    _mm256_storeu_ps(out + j + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
                }
            }
            decoded[i] = out;
        }
        for (int64_t i = n; i < ((n + 7) & ~int64_t{7}); ++i) decoded[i] = decoded[n - 1];
        return decoded;
    }
}

// An int8 tile's row scales applied: s[g * cs + i] *= scale of rows[i] for the G heads and
// positions i < n (the score pass gives n = the tile's padded count, rows past the tile being
// copies of its last, so those lanes stay copies of its last score). Nothing for other caches.
template <int D, typename KV>
inline void scale_tile(const KV* const* rows, int64_t n, float* s, int64_t G, int64_t cs) {
    if constexpr (std::is_same_v<KV, int8_t>) {
        float f[kAvx2Tile];
        for (int64_t i = 0; i < n; ++i) f[i] = kv_row_scale(rows[i], D);
        for (int64_t g = 0; g < G; ++g)
            for (int64_t i = 0; i < n; ++i) s[g * cs + i] *= f[i];
    } else {
        (void)rows, (void)n, (void)s, (void)G, (void)cs;
    }
}

// attend_one (same arguments, same three passes) for head_dim D = 64, 128 or 256. Query heads are
// taken 3 at a time (a last chunk of 1 or 2): scores for 4 positions at once (8 for a lone
// head, so that 8 FMA chains stay in flight), value sums over 32 columns (64 for a lone head).
template <int D, typename T, typename KV>
void attend_one_avx2(const T* q_row, T* out_row, const KV* key_cache, const KV* value_cache,
                     const int64_t* block_table, int64_t start, int64_t ctx, int64_t kvh, int64_t G,
                     int64_t num_kv_heads, int64_t block_size, float scale, float softcap, const float* sinks,
                     std::vector<float>& scores, std::vector<float>& work, bool lone) {
    static_assert(D % 64 == 0, "head_dim a multiple of 64");
    const int64_t len = ctx - start;  // positions attended (a sliding window's, or all)
    const int64_t cs = (len + 7) & ~int64_t{7};
    scores.resize(static_cast<size_t>(G * cs));
    work.resize(static_cast<size_t>(2 * G * D + G));
    float* s = scores.data();   // [G, cs]
    float* qf = work.data();    // [G, D] scaled queries (load16 order)
    float* acc = qf + G * D;    // [G, D] weighted value sums (load16 order)
    float* inv = acc + G * D;   // [G] 1 / softmax denominators
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < D; j += 16) {
            __m256 a, b;
            load16(q_row + (kvh * G + g) * D + j, a, b);
            _mm256_storeu_ps(qf + g * D + j, _mm256_mul_ps(a, vscale));
            _mm256_storeu_ps(qf + g * D + j + 8, _mm256_mul_ps(b, vscale));
        }
    const int64_t head_row = kv_row<KV>(D);
    const int64_t row_stride = num_kv_heads * head_row;
    using Row = std::conditional_t<std::is_same_v<KV, uint8_t>, uint16_t, std::conditional_t<std::is_same_v<KV, int8_t>, T, KV>>;
    const KV* rows[kAvx2Tile];
    const Row* decoded[kAvx2Tile];
    alignas(32) Row buf[std::is_same_v<KV, Row> ? 1 : kAvx2Tile * D];

    // For a lone row (a decode) whose values fit in kFetchValuesMaxBytes, the key walk fetches
    // the value rows too, as attend_one_avx512 does (see there): decode, 1 thread, float32 /
    // bf16 / fp8 69.9 / 46.5 / 50.1 -> 66.5 / 40.3 / 44.3 ms.
    const bool fetch_values = lone && len * head_row * int64_t{sizeof(KV)} <= kFetchValuesMaxBytes;
    ContextTiles<D, KV> keys(key_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, true,
                             fetch_values ? value_cache : nullptr);
    for (int64_t p0 = 0; p0 < len; p0 += kAvx2Tile) {
        const int64_t n = keys.next(rows);
        const int64_t n8 = (n + 7) & ~int64_t{7};
        const Row* const* tile = tile_rows<D>(rows, n, buf, decoded);
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float* q = qf + g0 * D;
            float* sg = s + g0 * cs + p0;
            if (G - g0 == 1)
                for (int64_t i = 0; i < n8; i += 8) score_group<1, 8, D>(q, tile + i, sg + i, cs);
            else if (G - g0 == 2)
                for (int64_t i = 0; i < n8; i += 4) score_group<2, 4, D>(q, tile + i, sg + i, cs);
            else
                for (int64_t i = 0; i < n8; i += 4) score_group<3, 4, D>(q, tile + i, sg + i, cs);
        }
        scale_tile<D>(rows, n8, s + p0, G, cs);
    }

    for (int64_t g = 0; g < G; ++g) {
        cap_scores(s + g * cs, cs, softcap);  // the lanes past len are copies, dropped by exp_scores
        inv[g] = 1.f / exp_scores<std::is_same_v<T, float>>(s + g * cs, len, cs, sink_of(sinks, kvh * G + g));
    }

    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(G * D));
    ContextTiles<D, KV> values(value_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, !fetch_values);
    for (int64_t p0 = 0; p0 < len; p0 += kAvx2Tile) {
        const int64_t n = values.next(rows);
        const Row* const* tile = tile_rows<D>(rows, n, buf, decoded);
        scale_tile<D>(rows, n, s + p0, G, cs);  // the weights (done with: inv is taken)
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float* w = s + g0 * cs + p0;
            if (G - g0 == 1)
                value_group<1, 8, D>(w, cs, tile, n, acc + g0 * D);
            else if (G - g0 == 2)
                value_group<2, 4, D>(w, cs, tile, n, acc + g0 * D);
            else
                value_group<3, 4, D>(w, cs, tile, n, acc + g0 * D);
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        T* oh = out_row + (kvh * G + g) * D;
        const float* ag = acc + g * D;
        if constexpr (std::is_same_v<T, float>) {
            for (int64_t d = 0; d < D; ++d) oh[d] = ag[d] * inv[g];
        } else {
            for (int64_t j = 0; j < D; j += 16)
                for (int64_t l = 0; l < 8; ++l) {
                    oh[j + 2 * l] = float_to_bf16(ag[j + l] * inv[g]);
                    oh[j + 2 * l + 1] = float_to_bf16(ag[j + 8 + l] * inv[g]);
                }
        }
    }
}

}  // namespace
#endif
