// Paged attention on AVX-512 BF16 (dot products of bf16 pairs) and AMX tiles (prefill scores),
// for bf16 queries over bf16, fp8 (e4m3) or int8 caches (AMX: bf16 caches). Compiled where the build targets them.
#pragma once

#include "attention_common.h"

#ifdef PAGELLM_AVX512_BF16
namespace {

// exp_nonpositive on 16 lanes (the same polynomial, so results match the scalar version).
inline __m512 exp_nonpositive_x16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // max returns its second operand for NaN: kept
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6188865e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022657e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// In place: sg[0:n] = softmax(sg[0:n]), with a sink's logit in the sum where it is not -inf.
inline void softmax_avx512(float* sg, int64_t n, float sink = -INFINITY) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t p = 0;
    for (; p + 16 <= n; p += 16) {
        const __m512 x = _mm512_loadu_ps(sg + p);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, x);
    }
    float m = _mm512_reduce_max_ps(vm);
    for (; p < n; ++p) {
        if (std::isnan(sg[p])) nan = 1;
        m = sg[p] > m ? sg[p] : m;
    }
    if (nan) m = NAN;  // a NaN score makes the whole row NaN, as in torch
    const __m512 vmax = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (p = 0; p + 16 <= n; p += 16) {
        const __m512 e = exp_nonpositive_x16(_mm512_sub_ps(_mm512_loadu_ps(sg + p), vmax));
        _mm512_storeu_ps(sg + p, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (p < n) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (n - p)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(mask, sg + p);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp_nonpositive_x16(_mm512_sub_ps(x, vmax)));
        _mm512_mask_storeu_ps(sg + p, mask, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / (_mm512_reduce_add_ps(vsum) + sink_term(sink, m)));
    for (p = 0; p + 16 <= n; p += 16) _mm512_storeu_ps(sg + p, _mm512_mul_ps(_mm512_loadu_ps(sg + p), inv));
    for (; p < n; ++p) sg[p] *= _mm512_cvtss_f32(inv);
}

#ifdef __AVX512VBMI__
// e4m3 -> bf16 by table lookup, 64 values at a time (AVX-512 VBMI: vpermi2b looks up 64 bytes
// in a 128-byte table): the low and the high byte of each code's bf16 (sign added after),
// interleaved back into 16-bit lanes. The bytes are first permuted so that the interleave,
// which works within 128-bit lanes, leaves the values in their order.
struct E4m3Tables {
    alignas(64) uint8_t lo[128], hi[128], order[64];
};
constexpr E4m3Tables make_e4m3_tables() {
    E4m3Tables t{};
    for (int m = 0; m < 128; ++m) {
        t.lo[m] = static_cast<uint8_t>(e4m3_to_bf16_bits(static_cast<uint8_t>(m)) & 0xff);
        t.hi[m] = static_cast<uint8_t>(e4m3_to_bf16_bits(static_cast<uint8_t>(m)) >> 8);
    }
    // Lane k of the permuted bytes: values 8k..8k+7 (unpacklo -> the first vector), then
    // 32+8k..32+8k+7 (unpackhi -> the second).
    for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 8; ++j) {
            t.order[16 * k + j] = static_cast<uint8_t>(8 * k + j);
            t.order[16 * k + 8 + j] = static_cast<uint8_t>(32 + 8 * k + j);
        }
    return t;
}
constexpr E4m3Tables kE4m3Tables = make_e4m3_tables();

// 64 e4m3 bytes -> bf16 values 0..31 (first) and 32..63 (second), exactly.
inline void e4m3x64_to_bf16(const uint8_t* p, __m512i& first, __m512i& second) {
    const __m512i lo0 = _mm512_loadu_si512(kE4m3Tables.lo), lo1 = _mm512_loadu_si512(kE4m3Tables.lo + 64);
    const __m512i hi0 = _mm512_loadu_si512(kE4m3Tables.hi), hi1 = _mm512_loadu_si512(kE4m3Tables.hi + 64);
    const __m512i b = _mm512_permutexvar_epi8(_mm512_loadu_si512(kE4m3Tables.order), _mm512_loadu_si512(p));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);  // index bits 0-6: the magnitude
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, _mm512_set1_epi8(char(0x80)),
                                                 0xf8);  // hi | (b & 0x80)
    first = _mm512_unpacklo_epi8(lo, hi);
    second = _mm512_unpackhi_epi8(lo, hi);
}
#else
// 32 e4m3 bytes -> 32 bf16, exactly (normals by arithmetic, subnormals from a table).
inline __m512i e4m3x32_to_bf16(const uint8_t* p) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __m512i table = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE4m3Subnormals)));
    r = _mm512_mask_mov_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), _mm512_permutexvar_epi16(mag, table));
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
    return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

inline void e4m3x64_to_bf16(const uint8_t* p, __m512i& first, __m512i& second) {
    first = e4m3x32_to_bf16(p);
    second = e4m3x32_to_bf16(p + 32);
}
#endif

// A cache row of 32 * C values (C even) as C bf16 vectors (bf16, or e4m3 decoded).
template <int C>
inline void load_bf16_row(const uint16_t* p, __m512bh (&k)[C]) {
    for (int c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_loadu_si512(p + 32 * c);
}
template <int C>
inline void load_bf16_row(const uint8_t* p, __m512bh (&k)[C]) {
    static_assert(C % 2 == 0, "rows of 64 values at a time");
    for (int c = 0; c < C; c += 2) {
        __m512i a, b;
        e4m3x64_to_bf16(p + 32 * c, a, b);
        k[c] = (__m512bh)a;
        k[c + 1] = (__m512bh)b;
    }
}

// The same row as 2 * C float32 vectors.
template <int C>
inline void load_f32_row(const uint16_t* p, __m512 (&v)[2 * C]) {
    for (int c = 0; c < 2 * C; ++c) v[c] = bf16x16_to_float(p + 16 * c);
}
template <int C>
inline void load_f32_row(const uint8_t* p, __m512 (&v)[2 * C]) {
    __m512bh k[C];
    load_bf16_row<C>(p, k);
    for (int c = 0; c < C; ++c) {
        const __m512i h = (__m512i)k[c];
        v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        v[2 * c + 1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    }
}

template <int C>
inline void load_f32_row(const int8_t* p, __m512 (&v)[2 * C]) {
    for (int c = 0; c < 2 * C; ++c)
        v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c))));
}

// A query head (32 * C bf16 values) as int16 for the int8 cache's dot products: q16 =
// round(q * 32767 / amax); returns the factor back (amax / 32767; 0 for a zero head). 15 bits
// against the head's largest value: its error is about 1/128 of the bf16 rounding q already has.
template <int C>
inline float query_int16(const uint16_t* q, __m512i (&out)[C]) {
    __m512 x[2 * C];
    __m512 amax = _mm512_setzero_ps();
    for (int c = 0; c < 2 * C; ++c) {
        x[c] = bf16x16_to_float(q + 16 * c);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x[c]));
    }
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int c = 0; c < C; ++c) {
        const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(x[2 * c], inv));
        const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(x[2 * c + 1], inv));
        out[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
    }
    return m > 0.f ? m / 32767.f : 0.f;
}

// sum of q16 * codes over one int8 key row (int32: |q16| <= 32767, |code| <= 127, 256 dims stay
// below 2^31), pairs of int16 products added in one instruction where AVX-512 VNNI has it.
template <int C>
inline __m512i dot_int16(const __m512i (&q)[C], const __m512i (&k)[C]) {
    __m512i a = _mm512_setzero_si512();
    for (int c = 0; c < C; ++c) {
#ifdef __AVX512VNNI__
        a = _mm512_dpwssd_epi32(a, q[c], k[c]);
#else
        a = _mm512_add_epi32(a, _mm512_madd_epi16(q[c], k[c]));
#endif
    }
    return a;
}

// attend_one_avx512's scores over an int8 cache: each query head as int16 (query_int16), each
// key row's codes widened to int16 once for all heads (one vpmovsxbw per 32), integer dot
// products, then score = sum * the query's factor * scale * the row's scale. Widening the codes
// to bf16 instead (10 ops per 64 codes, then the bf16 dot products) left the int8 cache slower
// than bf16 on a Sapphire Rapids VM (benchmarks/NOTES.md 57).
template <int C>
void int8_key_scores(const uint16_t* q_row, const int8_t* key_cache, const int8_t* value_cache,
                     const int64_t* block_table, int64_t start, int64_t ctx, int64_t kvh, int64_t G,
                     int64_t block_size, int64_t row_stride, float scale, bool fetch_values, float* s) {
    constexpr int64_t D = 32 * C;
    const int64_t head_row = kv_row<int8_t>(D), len = ctx - start;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = G - g0 < 4 ? G - g0 : 4;
        __m512i q[4][C];
        float f[4];
        for (int j = 0; j < gn; ++j) f[j] = query_int16<C>(q_row + (kvh * G + g0 + j) * D, q[j]) * scale;
        for_each_context_row(key_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, head_row,
                             [&](int64_t p, const int8_t* kp) {
                                 if (fetch_values && g0 == 0)
                                     prefetch_row(value_cache, block_table, p, block_size, row_stride, kvh * head_row,
                                                  head_row);
                                 __m512i k[C];
                                 for (int c = 0; c < C; ++c)
                                     k[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + 32 * c)));
                                 const float ks = kv_row_scale(kp, D);
                                 for (int j = 0; j < gn; ++j)
                                     s[(g0 + j) * len + p - start] =
                                         static_cast<float>(_mm512_reduce_add_epi32(dot_int16<C>(q[j], k))) * f[j] * ks;
                             });
    }
}

// attend_one for bfloat16 with head_dim = 32 * C, on AVX-512 BF16: q.k with vdpbf16ps
// (bf16 products, float32 sums, as a bf16 GEMM), softmax and the value sums in float32.
// Weight rows weighted_values takes at once: rows x 2C accumulators plus 2C value registers
// within the 32 vector registers (4 rows for head_dim 64, 3 for 128).
template <int C>
constexpr int64_t kValueRows = C <= 2 ? 4 : 3;

// acc[j][0:D] = sum over start <= p < ctx of w_j[p - start] * V[p] (D = 32 * C) for `rows` <=
// kValueRows<C> weight rows w_j = w + j * w_stride; each value row is read once for all of them.
// kPrefetch: prefetch the rows ahead (false where the caller already brought them in).
template <int C, bool kPrefetch = true, typename KV = uint16_t>
inline void weighted_values(const KV* value_cache, const int64_t* block_table, int64_t start, int64_t ctx,
                            int64_t block_size, int64_t row_stride, int64_t offset, const float* w, int64_t w_stride,
                            int64_t rows, float* acc) {
    constexpr int64_t D = 32 * C;
    __m512 a[kValueRows<C>][2 * C];
    for (int j = 0; j < kValueRows<C>; ++j)
        for (int c = 0; c < 2 * C; ++c) a[j][c] = _mm512_setzero_ps();
    for_each_context_row<kPrefetch>(value_cache, block_table, start, ctx, block_size, row_stride, offset,
                                    kv_row<KV>(D) * int64_t{sizeof(KV)}, [&](int64_t p, const KV* vp) {
                                        __m512 v[2 * C];
                                        load_f32_row<C>(vp, v);
                                        const float vs = row_scale(vp, D);
                                        for (int j = 0; j < rows; ++j) {
                                            const __m512 wj = _mm512_set1_ps(w[j * w_stride + p - start] * vs);
                                            for (int c = 0; c < 2 * C; ++c)
                                                a[j][c] = _mm512_fmadd_ps(wj, v[c], a[j][c]);
                                        }
                                    });
    for (int j = 0; j < rows; ++j)
        for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(acc + j * D + 16 * c, a[j][c]);
}

#ifdef PAGELLM_AMX
// Scores on AMX tiles, for blocks of kAmxBlock positions: S^T[p, g] = K[p, :] . q_g, with one
// block's K rows of this head as the A tile (16 positions x 32 dims, straight from the cache:
// row stride = the cache row) and the G queries as B tiles (dim pairs x G, built per item).
// Tile 0 holds S^T, tiles 1..C (C = head_dim / 32, at most 4) the query, tile 7 the keys. The
// tail rows of a partial block read stale cache rows; each only makes its own score row, which
// is dropped.
constexpr int64_t kAmxBlock = 16;

// Every tile 16 rows of 64 bytes: S^T is 16 positions x 16 query columns (G heads of one row
// in decode, 16 rows of one head in a prefill tile; unused columns are zero queries).
inline void configure_score_tiles() {
    AmxTileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    amx_load_config(cfg);
}

// Query vector q (D = 32 * C values) as column `col` of the query tiles' layout qb[c] =
// [dim pair][16 query columns][2].
template <int C>
inline void put_query_column(uint16_t (&qb)[C][16 * 16 * 2], const uint16_t* q, int64_t col) {
    for (int c = 0; c < C; ++c)
        for (int64_t kp = 0; kp < 16; ++kp) {
            qb[c][(kp * 16 + col) * 2] = q[32 * c + 2 * kp];
            qb[c][(kp * 16 + col) * 2 + 1] = q[32 * c + 2 * kp + 1];
        }
}

// Loads query tile c (tiles 1..C) from qb[c].
template <int C>
inline void load_query_tiles(const uint16_t (&qb)[C][16 * 16 * 2]) {
    amx_memory_barrier();
    _tile_loadd(1, qb[0], 64);
    if constexpr (C > 1) _tile_loadd(2, qb[1], 64);
    if constexpr (C > 2) _tile_loadd(3, qb[2], 64);
    if constexpr (C > 3) _tile_loadd(4, qb[3], 64);
}

// st[i][j] = K[p0 + i] . query column j over all D dims, for the 16 positions of the block
// holding p0 (the query tiles loaded).
template <int C>
inline void block_scores(const uint16_t* key_cache, const int64_t* block_table, int64_t p0, int64_t ctx,
                         int64_t kvh, int64_t row_stride, float (&st)[16][16]) {
    constexpr int64_t D = 32 * C;
    const uint16_t* base = key_cache + block_table[p0 / kAmxBlock] * kAmxBlock * row_stride + kvh * D;
    if (p0 + kPrefetchDistance < ctx)
        for (int64_t i = 0; i < kAmxBlock; ++i)
            prefetch_row(key_cache, block_table, p0 + kPrefetchDistance + i, kAmxBlock, row_stride, kvh * D, D * 2);
    const int64_t a_stride = row_stride * 2;
    _tile_zero(0);
    _tile_loadd(7, base, a_stride);
    _tile_dpbf16ps(0, 7, 1);
    if constexpr (C > 1) {
        _tile_loadd(7, base + 32, a_stride);
        _tile_dpbf16ps(0, 7, 2);
    }
    if constexpr (C > 2) {
        _tile_loadd(7, base + 64, a_stride);
        _tile_dpbf16ps(0, 7, 3);
    }
    if constexpr (C > 3) {
        _tile_loadd(7, base + 96, a_stride);
        _tile_dpbf16ps(0, 7, 4);
    }
    _tile_stored(0, st, 64);
}

// s[g * (ctx - start) + p - start] = scale * q_g . K[p] for positions [start, ctx): whole
// blocks of kAmxBlock from the one holding `start` (its rows before `start` are dropped).
template <int C>
void scores_amx(const uint16_t* q_row, const uint16_t* key_cache, const int64_t* block_table, int64_t start,
                int64_t ctx, int64_t kvh, int64_t G, int64_t row_stride, float scale, float* s) {
    static_assert(C >= 1 && C <= 4, "head_dim up to 128");
    constexpr int64_t D = 32 * C;
    alignas(64) uint16_t qb[C][16 * 16 * 2] = {};  // query head g is column g
    for (int64_t g = 0; g < G; ++g) put_query_column<C>(qb, q_row + (kvh * G + g) * D, g);
    load_query_tiles<C>(qb);
    alignas(64) float st[16][16];
    const int64_t len = ctx - start;
    for (int64_t p0 = start - start % kAmxBlock; p0 < ctx; p0 += kAmxBlock) {
        block_scores<C>(key_cache, block_table, p0, ctx, kvh, row_stride, st);
        const int64_t n = ctx - p0 < kAmxBlock ? ctx - p0 : kAmxBlock;
        for (int64_t i = p0 < start ? start - p0 : 0; i < n; ++i)
            for (int64_t g = 0; g < G; ++g) s[g * len + p0 + i - start] = st[i][g] * scale;
    }
}

// Up to 16 rows of one request (a prefill chunk, each row j attending to positions
// [row_start[j], row_ctx[j])) and one KV head, one query head g at a time: the rows are the 16
// query columns of the score tiles, so each key block is multiplied once for all of them.
// Softmax per row, then the value sums a few rows at a time (positions a row must not see get
// weight 0; every position from the first row's start to the largest limit holds a written
// value row: a window releases only blocks before the step's first row's start).
template <int C>
void attend_tile_amx(const uint16_t* query, int64_t q_row_stride, uint16_t* out, int64_t out_row_stride,
                     const uint16_t* key_cache, const uint16_t* value_cache, const int64_t* block_table,
                     const int32_t* row_token, const int32_t* row_start, const int32_t* row_ctx, int64_t n,
                     int64_t kvh, int64_t G, int64_t num_kv_heads, float scale, float softcap,
                     const float* sinks, std::vector<float>& scores) {
    constexpr int64_t D = 32 * C;
    const int64_t row_stride = num_kv_heads * D;
    int64_t ctx_max = 0, lo = INT64_MAX;
    for (int64_t j = 0; j < n; ++j) {
        ctx_max = row_ctx[j] > ctx_max ? row_ctx[j] : ctx_max;
        lo = row_start[j] < lo ? row_start[j] : lo;
    }
    const int64_t width = ctx_max - lo;  // score row j holds positions lo .. ctx_max - 1
    scores.resize(static_cast<size_t>(n * width));
    float* s = scores.data();
    alignas(64) uint16_t qb[C][16 * 16 * 2];
    alignas(64) float st[16][16];
    alignas(64) float acc[kValueRows<C> * D];
    for (int64_t g = 0; g < G; ++g) {
        std::memset(qb, 0, sizeof(qb));
        for (int64_t j = 0; j < n; ++j)
            put_query_column<C>(qb, query + row_token[j] * q_row_stride + (kvh * G + g) * D, j);
        load_query_tiles<C>(qb);
        for (int64_t p0 = lo - lo % kAmxBlock; p0 < ctx_max; p0 += kAmxBlock) {
            block_scores<C>(key_cache, block_table, p0, ctx_max, kvh, row_stride, st);
            const int64_t np = ctx_max - p0 < kAmxBlock ? ctx_max - p0 : kAmxBlock;
            for (int64_t i = p0 < lo ? lo - p0 : 0; i < np; ++i)
                for (int64_t j = 0; j < n; ++j) s[j * width + p0 + i - lo] = st[i][j] * scale;
        }
        for (int64_t j = 0; j < n; ++j) {
            float* sj = s + j * width;
            const int64_t a = row_start[j] - lo, b = row_ctx[j] - lo;
            cap_scores(sj + a, b - a, softcap);
            softmax_avx512(sj + a, b - a, sink_of(sinks, kvh * G + g));
            std::fill(sj, sj + a, 0.0f);
            std::fill(sj + b, sj + width, 0.0f);
        }
        for (int64_t j0 = 0; j0 < n; j0 += kValueRows<C>) {
            const int64_t jn = n - j0 < kValueRows<C> ? n - j0 : kValueRows<C>;
            int64_t hi = 0, first = INT64_MAX;
            for (int64_t j = j0; j < j0 + jn; ++j) {
                hi = row_ctx[j] > hi ? row_ctx[j] : hi;
                first = row_start[j] < first ? row_start[j] : first;
            }
            weighted_values<C>(value_cache, block_table, first, hi, kAmxBlock, row_stride, kvh * D,
                               s + j0 * width + (first - lo), width, jn, acc);
            for (int64_t j = 0; j < jn; ++j) {
                uint16_t* o = out + row_token[j0 + j] * out_row_stride + (kvh * G + g) * D;
                for (int64_t d = 0; d < D; ++d) o[d] = float_to_bf16(acc[j * D + d]);
            }
        }
    }
}
#endif

template <int C, typename KV = uint16_t>
void attend_one_avx512(const uint16_t* q_row, uint16_t* out_row, const KV* key_cache,
                       const KV* value_cache, const int64_t* block_table, int64_t start, int64_t ctx,
                       int64_t kvh, int64_t group, int64_t num_kv_heads, int64_t block_size, float scale,
                       float softcap, const float* sinks, std::vector<float>& scores, std::vector<float>& work, bool amx,
                       bool lone) {
    constexpr int64_t D = 32 * C;
    const int64_t G = group;
    const int64_t len = ctx - start;  // positions attended (a sliding window's, or all)
    scores.resize(static_cast<size_t>(G * len));
    work.resize(static_cast<size_t>(G * D));
    float* s = scores.data();
    float* acc = work.data();
    const int64_t head_row = kv_row<KV>(D);
    const int64_t row_stride = num_kv_heads * head_row;
    const int64_t row_bytes = head_row * int64_t{sizeof(KV)};

    // AMX scores exist for bf16 caches only (paged_attention never sets amx for others).
    amx = amx && std::is_same_v<KV, uint16_t>;
#ifdef PAGELLM_AMX
    if constexpr (std::is_same_v<KV, uint16_t>)
        if (amx) scores_amx<C>(q_row, key_cache, block_table, start, ctx, kvh, G, row_stride, scale, s);
#else
    (void)amx;
#endif
    // Scores: each key row is read once for all G query heads (up to 4 at a time in registers).
    // For a lone row (a decode), whose context nobody else just read, the first key rows, which
    // the loop's prefetch never reaches, are fetched up front, and each position's value row
    // alongside its key row, so the value pass finds them in L2: a batch-64 decode step's
    // attention 9.6-9.8 -> 8.6 ms in the engine on a Zen 5 VM (benchmarks/NOTES.md 34). Only
    // while the item's values fit in kFetchValuesMaxBytes: longer, they leave L2 before the
    // value pass reaches them (64 rows x 1024 positions: 14.6 -> 15.4 ms; 4 x 8192: 6.9 -> 8.2).
    // A prefill row's context mostly comes from cache (the rows before it read it), where the
    // extra prefetches only cost.
    const bool fetch_values = !amx && lone && len * row_bytes <= kFetchValuesMaxBytes;
    if (fetch_values)
        for (int64_t p = start; p < ctx && p < start + kPrefetchDistance; ++p)
            prefetch_row(key_cache, block_table, p, block_size, row_stride, kvh * head_row, row_bytes);
    if constexpr (std::is_same_v<KV, int8_t>) {
        int8_key_scores<C>(q_row, key_cache, value_cache, block_table, start, ctx, kvh, G, block_size, row_stride, scale,
                           fetch_values, s);
    } else {
        for (int64_t g0 = 0; g0 < G && !amx; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            __m512bh q[4][C];
            for (int j = 0; j < gn; ++j)
                for (int c = 0; c < C; ++c)
                    q[j][c] = (__m512bh)_mm512_loadu_si512(q_row + (kvh * G + g0 + j) * D + 32 * c);
            for_each_context_row(key_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, row_bytes,
                                 [&](int64_t p, const KV* kp) {
                                     if (fetch_values && g0 == 0)
                                         prefetch_row(value_cache, block_table, p, block_size, row_stride, kvh * head_row,
                                                      row_bytes);
                                     __m512bh k[C];
                                     load_bf16_row<C>(kp, k);
                                     for (int j = 0; j < gn; ++j) {
                                         __m512 a = _mm512_setzero_ps();
                                         for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, q[j][c], k[c]);
                                         s[(g0 + j) * len + p - start] = _mm512_reduce_add_ps(a) * scale;
                                     }
                                 });
        }
    }

    for (int64_t g = 0; g < G; ++g) {
        cap_scores(s + g * len, len, softcap);
        softmax_avx512(s + g * len, len, sink_of(sinks, kvh * G + g));
    }

    // Value sums, a few query heads at a time so the accumulators stay in registers.
    const auto values = fetch_values ? weighted_values<C, false, KV> : weighted_values<C, true, KV>;
    for (int64_t g0 = 0; g0 < G; g0 += kValueRows<C>)
        values(value_cache, block_table, start, ctx, block_size, row_stride, kvh * head_row, s + g0 * len, len,
               G - g0 < kValueRows<C> ? G - g0 : kValueRows<C>, acc + g0 * D);
    for (int64_t g = 0; g < G; ++g) {
        uint16_t* oh = out_row + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) oh[d] = float_to_bf16(acc[g * D + d]);
    }
}

}  // namespace
#endif
