// Paged attention over the KV cache, read in place through each request's block table:
// scalar (any CPU), AVX2 + FMA, AVX-512 BF16 and AMX paths, over float32, bf16, fp8 (e4m3) or int8 caches.

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_common.h"
#include "exports.h"

namespace {

template <typename T, typename KV = T>
void paged_attention(const T* query, int64_t q_row_stride, T* out, int64_t out_row_stride,
                     const KV* key_cache, const KV* value_cache, const int64_t* block_tables,
                     int64_t block_table_stride, const int32_t* row_token, const int32_t* row_req,
                     const int32_t* row_start, const int32_t* row_ctx, int64_t num_rows, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                     const float* sinks, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    // Rows attend from position 0 unless a sliding window gives each its first position.
    std::vector<int32_t> zeros;
    if (row_start == nullptr) {
        zeros.assign(static_cast<size_t>(num_rows), 0);
        row_start = zeros.data();
    }
    bool amx = false;
#ifdef PAGELLM_AMX
    // The same condition as attend_one_avx512's (head_dim 64 or 128), so `amx` is never set
    // for a row the scalar attend_one takes.
    amx = std::is_same_v<T, uint16_t> && std::is_same_v<KV, T> && block_size == kAmxBlock && group >= 1 && group <= 16 &&
          (head_dim == 64 || head_dim == 128) && amx_permitted();
#endif
    // Work units: single rows, or (with AMX) runs of up to 16 rows of one request, a prefill
    // chunk's rows, which attend_tile_amx takes together. unit_start[u] .. unit_start[u + 1].
    std::vector<int64_t> unit_start;
    unit_start.reserve(static_cast<size_t>(num_rows) + 1);
    for (int64_t r = 0; r < num_rows; ++r)
        if (!amx || r == 0 || row_req[r] != row_req[r - 1] || r - unit_start.back() == kAmxTileRows)
            unit_start.push_back(r);
    unit_start.push_back(num_rows);
    const int64_t units = static_cast<int64_t>(unit_start.size()) - 1;
    // Fewer (unit, KV head) pairs than threads (a batch-1 decode over one KV head: MLA's latent,
    // MQA): each pair's query heads dealt out in parts, every part reading the pair's K/V rows
    // itself. A head's arithmetic is the same in any part.
    const int64_t pairs = units * num_kv_heads;
    const int64_t parts = !amx && pairs > 0 && pairs < num_threads ? std::min<int64_t>(group, (num_threads + pairs - 1) / pairs) : 1;
    const int64_t items = pairs * parts;
    // Fewer units than threads (batch 1): deal out single heads (or parts), or one thread does all.
    const int64_t chunk = units >= num_threads ? num_kv_heads : 1;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores, work;
#ifdef PAGELLM_AMX
        if (amx) configure_score_tiles();
#endif
        // All KV heads of a unit on one thread, one after the other: a cache row holds every KV
        // head of its position, so the lines the hardware prefetchers fetch around one head's
        // rows hold the next head's, used from this core's L2 instead of fetched again by
        // another core. 30 layers' decode attention (64 rows x 192 positions): 22.7-24.6 ms,
        // against 28.4-35.2 with items dealt out one head at a time (alternating builds).
#pragma omp for schedule(dynamic, chunk)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t u = it / parts / num_kv_heads;
            const int64_t r = unit_start[u];
            const int64_t kvh = it / parts % num_kv_heads;
            // This part's query heads g0 .. g0 + gn of the group: every path indexes head
            // (kvh * G + g), so the rows and sinks are shifted to give head kvh * group + g0 + g.
            const int64_t part = it % parts, g0 = group * part / parts, gn = group * (part + 1) / parts - g0;
            const int64_t shift = kvh * (group - gn) + g0;
            const float* part_sinks = sinks == nullptr ? nullptr : sinks + shift;
#ifdef PAGELLM_AMX
            if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<KV, T>) {
                const int64_t n = unit_start[u + 1] - r;
                if (n > 1) {
                    const int64_t* table = block_tables + static_cast<int64_t>(row_req[r]) * block_table_stride;
                    if (head_dim == 64)
                        attend_tile_amx<2>(query, q_row_stride, out, out_row_stride, key_cache, value_cache, table,
                                           row_token + r, row_start + r, row_ctx + r, n, kvh, group, num_kv_heads,
                                           scale, softcap, sinks, scores);
                    else
                        attend_tile_amx<4>(query, q_row_stride, out, out_row_stride, key_cache, value_cache, table,
                                           row_token + r, row_start + r, row_ctx + r, n, kvh, group, num_kv_heads,
                                           scale, softcap, sinks, scores);
                    continue;
                }
            }
#endif
            const int64_t tok = row_token[r];
            [[maybe_unused]] const bool lone =
                (r == 0 || row_req[r - 1] != row_req[r]) && (r + 1 == num_rows || row_req[r + 1] != row_req[r]);
            const T* q_row = query + tok * q_row_stride + shift * head_dim;
            T* out_row = out + tok * out_row_stride + shift * head_dim;
            const int64_t* table = block_tables + static_cast<int64_t>(row_req[r]) * block_table_stride;
            const int64_t start = row_start[r], ctx = row_ctx[r];
#ifdef PAGELLM_AVX512_BF16
            if constexpr (std::is_same_v<T, uint16_t>) {
                if (head_dim == 64) {
                    attend_one_avx512<2, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn,
                                         num_kv_heads, block_size, scale, softcap, part_sinks, scores, work, amx, lone);
                    continue;
                }
                if (head_dim == 128) {
                    attend_one_avx512<4, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn,
                                         num_kv_heads, block_size, scale, softcap, part_sinks, scores, work, amx, lone);
                    continue;
                }
            }
#endif
#ifdef PAGELLM_ATTENTION_AVX2
            if (head_dim == 64) {
                attend_one_avx2<64, T, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn,
                                           num_kv_heads, block_size, scale, softcap, part_sinks, scores, work, lone);
                continue;
            }
            if (head_dim == 128) {
                attend_one_avx2<128, T, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn,
                                            num_kv_heads, block_size, scale, softcap, part_sinks, scores, work, lone);
                continue;
            }
            if (head_dim == 256) {  // Gemma 2 and 3
                attend_one_avx2<256, T, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn,
                                            num_kv_heads, block_size, scale, softcap, part_sinks, scores, work, lone);
                continue;
            }
#endif
            attend_one<T, KV>(q_row, out_row, key_cache, value_cache, table, start, ctx, kvh, gn, num_kv_heads,
                          head_dim, block_size, scale, softcap, part_sinks, scores, work);
        }
#ifdef PAGELLM_AMX
        if (amx) _tile_release();
#endif
    }
}

}  // namespace

extern "C" {

// out[row_token[r], h, :] = attention of query[row_token[r], h, :] over positions
// [row_start[r], row_ctx[r]) of request row_req[r] (block_tables row), for every row r and query
// head h; row_start null: from 0. Scores are capped by softcap * tanh(score / softcap) where
// softcap > 0 (0: no cap); sinks (null: none): a logit per query head in its softmax, over no value
// (gpt-oss). dtype: 0 float32, 1 bfloat16, 2 bfloat16 query and out over an fp8
// (e4m3) cache, 3 bfloat16 and 4 float32 over an int8 cache (rows of head_dim codes and a scale).
// Returns 0 on success, -1 on an unsupported argument.
int pagellm_paged_attention(const void* query, int64_t q_row_stride, void* out, int64_t out_row_stride,
                            const void* key_cache, const void* value_cache, const int64_t* block_tables,
                            int64_t block_table_stride, const int32_t* row_token, const int32_t* row_req,
                            const int32_t* row_start, const int32_t* row_ctx, int64_t num_rows, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
                            const float* sinks, int dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return -1;
    if (num_threads < 1) num_threads = 1;
    const auto run = [&](auto tag, auto cache_tag) {
        using T = decltype(tag);
        using KV = decltype(cache_tag);
        paged_attention<T, KV>(static_cast<const T*>(query), q_row_stride, static_cast<T*>(out), out_row_stride,
                               static_cast<const KV*>(key_cache), static_cast<const KV*>(value_cache), block_tables,
                               block_table_stride, row_token, row_req, row_start, row_ctx, num_rows, num_heads,
                               num_kv_heads, head_dim, block_size, scale, softcap, sinks, num_threads);
    };
    return with_cache_types(dtype, run) ? 0 : -1;
}

}  // extern "C"
