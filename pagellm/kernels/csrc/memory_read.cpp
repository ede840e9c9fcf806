// The read bandwidth the kernels see, for the decode floor of `pagellm bench latency`: a batch-1
// decode token reads every weight once, so its best rate is the weight bytes over this. The
// buffer is split into one contiguous range per thread (as the GEMMs split weight panels) and
// read with this build's widest integer loads (512-bit with AVX-512, else 256-bit), summed so
// the loads cannot be dropped.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

// Sum of the 64-bit words of [p, p + bytes) (bytes a multiple of 64), with the build's vectors.
uint64_t sum_words(const uint8_t* p, int64_t bytes) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 256 <= bytes; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
    }
    uint64_t total = _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= bytes; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    uint64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    uint64_t total = 0;
#endif
    for (; i + 8 <= bytes; i += 8) {
        uint64_t word;
        std::memcpy(&word, p + i, sizeof word);
        total += word;
    }
    return total;
}

}  // namespace

extern "C" {

// The 64-bit wrapping sum of the buffer's words, read by num_threads threads in contiguous
// 64-byte-aligned ranges; bytes must be a positive multiple of 64. The value only keeps the
// reads alive (the caller times the call).
int pagellm_read_sum(const void* data, int64_t bytes, int num_threads, uint64_t* out) {
    if (bytes <= 0 || bytes % 64 != 0 || out == nullptr) return -1;
    if (num_threads < 1) num_threads = 1;
    const auto* p = static_cast<const uint8_t*>(data);
    const int64_t lines = bytes / 64;
    uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t first = lines * t / n, last = lines * (t + 1) / n;
        total += sum_words(p + first * 64, (last - first) * 64);
    }
    *out = total;
    return 0;
}

}  // extern "C"
