// The integer GEMM's vector operations per ISA (`Simd`), for gemm_int8.cpp's kernels: one zmm per
// tile of 16 columns on AVX-512 VNNI, two ymm on AVX-VNNI and AVX2. Included by gemm_int8.cpp
// inside its anonymous namespace, where PAGELLM_QGEMM_ISA is 1-3.
#if PAGELLM_QGEMM_ISA == 3
// One zmm per tile of 16 columns.
struct Simd {
    using I = __m512i;
    using F = __m512;
    static constexpr int kVecs = 1;       // vectors per tile
    static constexpr int kQ8Offset = 128;  // q8 codes enter vpdpbusd as u8 = q + 128
    static constexpr bool kOneQ4Chain = false;  // two chains hide vpdpbusd's latency
    static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static I load_int(const int32_t* p) { return _mm512_loadu_si512(p); }
    static void store_int(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
    static I shift_left32(I v, int n) { return _mm512_slli_epi32(v, n); }
    // acc + x.lo16 * y.lo16 + x.hi16 * y.hi16 per int32 lane (int16 pairs)
    static I dot_pairs(I acc, I x, I y) { return _mm512_dpwssd_epi32(acc, x, y); }
    static I set1(int32_t v) { return _mm512_set1_epi32(v); }
    static I zero() { return _mm512_setzero_si512(); }
    static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
    static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
    static I high_nibbles_x16(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xf0))); }
    static I sra(I v, int n) { return _mm512_srai_epi32(v, n); }
    // Bits of `plane` moved by `shift` (left if positive) within 16-bit lanes, masked per byte.
    static I bits(I plane, int shift, int mask) {
        const I v = shift > 0 ? _mm512_slli_epi16(plane, shift) : shift < 0 ? _mm512_srli_epi16(plane, -shift) : plane;
        return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(mask)));
    }
    static I or_(I x, I y) { return _mm512_or_si512(x, y); }
    static I int8_scales(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    static I uint8_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    static I mullo(I x, I y) { return _mm512_mullo_epi32(x, y); }
    static I dot_q4(I acc, I w, I a) { return _mm512_dpbusd_epi32(acc, w, a); }
    static I finish_q4(I acc) { return acc; }
    static I dot_q8(I acc, I w, I a) { return _mm512_dpbusd_epi32(acc, w, a); }
    static I add(I x, I y) { return _mm512_add_epi32(x, y); }
    static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
    static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
    static F load_float(const uint8_t* p) { return _mm512_loadu_ps(p); }
    static F fset1(float v) { return _mm512_set1_ps(v); }
    static F fzero() { return _mm512_setzero_ps(); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static F fload(const float* p) { return _mm512_loadu_ps(p); }
};
#else
// Two ymm per tile of 16 columns.
struct Simd {
    using I = __m256i;
    using F = __m256;
    static constexpr int kVecs = 2;
#if PAGELLM_QGEMM_ISA == 2
    static constexpr int kQ8Offset = 128;
#else
    static constexpr int kQ8Offset = 0;  // the |w|, sign(a, w) form multiplies the signed codes
#endif
    static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static I load_int(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static void store_int(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
    static I shift_left32(I v, int n) { return _mm256_slli_epi32(v, n); }
#if PAGELLM_QGEMM_ISA == 2
    static I dot_pairs(I acc, I x, I y) { return _mm256_dpwssd_avx_epi32(acc, x, y); }
#else
    static I dot_pairs(I acc, I x, I y) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, y)); }
#endif
    static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static I zero() { return _mm256_setzero_si256(); }
    static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
    static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
    static I high_nibbles_x16(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(0xf0))); }
    static I sra(I v, int n) { return _mm256_srai_epi32(v, n); }
    static I bits(I plane, int shift, int mask) {
        const I v = shift > 0 ? _mm256_slli_epi16(plane, shift) : shift < 0 ? _mm256_srli_epi16(plane, -shift) : plane;
        return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(mask)));
    }
    static I or_(I x, I y) { return _mm256_or_si256(x, y); }
    static I int8_scales(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    static I uint8_lanes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    static I mullo(I x, I y) { return _mm256_mullo_epi32(x, y); }
#if PAGELLM_QGEMM_ISA == 2
    static constexpr bool kOneQ4Chain = false;  // two chains hide vpdpbusd's latency
    static I dot_q4(I acc, I w, I a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
    static I finish_q4(I acc) { return acc; }
    static I dot_q8(I acc, I w, I a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
#else
    // q4: int16 pair sums, widened by finish_q4 (bounded: see the header), both nibbles of a
    // block in one chain: fewer live registers than two (16 ymm in all; two chains spilled).
    static constexpr bool kOneQ4Chain = true;
    static I dot_q4(I acc, I w, I a) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a)); }
    static I finish_q4(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
    static I dot_q8(I acc, I w, I a) {
        const I signed_w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
        const I pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(signed_w), _mm256_sign_epi8(a, signed_w));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    static I add(I x, I y) { return _mm256_add_epi32(x, y); }
    static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
    static F half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    static F load_float(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
    static F fset1(float v) { return _mm256_set1_ps(v); }
    static F fzero() { return _mm256_setzero_ps(); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static F fload(const float* p) { return _mm256_loadu_ps(p); }
};
#endif
