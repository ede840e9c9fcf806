// GGUF's quantized rows read straight from the memory-mapped file: packed into the integer
// GEMM's layout at load time (quant_formats.pack), in one pass with no unpacked codes in between,
// and dequantized a few at a time (an embedding's looked-up rows, so the table stays in the file).
// The bytes packed are exactly what quant_formats.pack writes for the weights
// gguf_blocks.from_gguf_blocks reads from the same rows, and the values dequantized exactly what
// gguf-py's dequantization gives, float32 operation for float32 operation (tested).
//
// A packed weight is [tiles][blocks][record] (q4k, q6k: [tiles][super-blocks][2304 / 3360]); a
// record holds one block of 32 weights (q4k, q6k: a super-block of 256) for the 16 columns of a tile. Each packed
// column reads one GGUF row, given by the offset of its first block wanted in the source (a
// tensor-parallel rank's columns start mid-row), or -1 for a zero column (a tile's padding, or a silu_mul
// tile's missing rows). Within a record, the code bytes of column c for group g sit at
// g * 64 + c * 4: four 4-bit pairs (k = 8 g + j and 8 g + 4 + j) or four int8 codes (k = 4 g + j).

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

constexpr int kCols = 16;
constexpr int kBlock = 32;
constexpr uint32_t kLow = 0x0F0F0F0Fu;

// The integer GEMM's format codes (quant_formats.FORMAT_CODES) taken from GGUF rows here.
enum Format { kQ4 = 0, kQ8 = 1, kQ6K = 4, kQ4S = 5, kQ4K = 6 };

uint32_t load32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

void copy16(uint8_t* dst, const uint8_t* src) { std::memcpy(dst, src, 2); }

// An fp16 value's bytes as float32 (exact; subnormals, infinities and NaN included): plain
// code, so every build (no F16C on x86-64-v2) converts alike.
float fp16_to_float(const uint8_t* p) {
    const uint32_t h = p[0] | (p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 31, mantissa = h & 0x3FFu;
    float value;
    if (exponent == 0) {
        value = std::ldexp(static_cast<float>(mantissa), -24);
    } else if (exponent == 31) {
        uint32_t bits = 0x7F800000u | (mantissa << 13);
        std::memcpy(&value, &bits, 4);
    } else {
        uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
        std::memcpy(&value, &bits, 4);
    }
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits |= sign;
    std::memcpy(&value, &bits, 4);
    return value;
}

// One column's code bytes of a 4-bit block from words holding its codes as nibbles: lo[g] and
// hi[g] the words of codes 8 g + j and 8 g + 4 + j, each in its byte's low nibble (upper bits
// masked here).
void put_nibbles(uint8_t* rec, int col, const uint32_t lo[4], const uint32_t hi[4]) {
    for (int g = 0; g < 4; ++g) store32(rec + g * 64 + col * 4, (lo[g] & kLow) | ((hi[g] & kLow) << 4));
}

// A legacy 4-bit block's 16 bytes (code j in byte j's low nibble, j + 16 in its high one).
void put_legacy_nibbles(uint8_t* rec, int col, const uint8_t* qs) {
    const uint32_t w0 = load32(qs), w1 = load32(qs + 4), w2 = load32(qs + 8), w3 = load32(qs + 12);
    const uint32_t lo[4] = {w0, w2, w0 >> 4, w2 >> 4};
    const uint32_t hi[4] = {w1, w3, w1 >> 4, w3 >> 4};
    put_nibbles(rec, col, lo, hi);
}

// Q4_K sub-block b of a super-block's 128 code bytes: pair b / 2 of 32 bytes, b's codes in
// the low (even b) or high (odd b) nibbles.
void put_k_nibbles(uint8_t* rec, int col, const uint8_t* qs, int b) {
    const uint8_t* base = qs + 32 * (b / 2);
    const int shift = 4 * (b % 2);
    uint32_t lo[4], hi[4];
    for (int g = 0; g < 4; ++g) {
        lo[g] = load32(base + 8 * g) >> shift;
        hi[g] = load32(base + 8 * g + 4) >> shift;
    }
    put_nibbles(rec, col, lo, hi);
}

// Q4_0 (18 bytes: d, 16 code bytes) -> q4s (256 code bytes, d[16]).
void pack_q4s(uint8_t* rec, int col, const uint8_t* src) {
    put_legacy_nibbles(rec, col, src + 2);
    copy16(rec + 256 + 2 * col, src);
}

// Q4_1 (20 bytes: d, m, 16 code bytes) -> q4 (256 code bytes, d[16], m[16]).
void pack_q4(uint8_t* rec, int col, const uint8_t* src) {
    put_legacy_nibbles(rec, col, src + 4);
    copy16(rec + 256 + 2 * col, src);
    copy16(rec + 288 + 2 * col, src + 2);
}

// Q8_0 (34 bytes: d, 32 int8 codes) -> q8 (512 code bytes as code + 128, d[16]).
void pack_q8(uint8_t* rec, int col, const uint8_t* src) {
    for (int g = 0; g < 8; ++g) store32(rec + g * 64 + col * 4, load32(src + 2 + 4 * g) ^ 0x80808080u);
    copy16(rec + 512 + 2 * col, src);
}

// Q6_K block b (0..7) of a super-block (210 bytes: ql[128], qh[64], int8 scales[16], d) -> its
// 416 bytes of a q6k record (128 bytes of top-bit planes, 256 of low nibbles, int8 sub-scales[2][16]).
// Element i of block b = 32 (4 h + s) + i: low nibble (ql[64 h + 32 (s % 2) + i] >> 4 (s / 2)),
// top bits (qh[32 h + i] >> 2 s) & 3.
void pack_q6k_block(uint8_t* rec, int col, const uint8_t* super, int b) {
    const int h = b / 4, s = b % 4;
    const uint8_t* ql = super + 64 * h + 32 * (s % 2);
    const uint8_t* qh = super + 128 + 32 * h;
    const int low_shift = 4 * (s / 2), top_shift = 2 * s;
    uint32_t lo[4], hi[4];
    for (int g = 0; g < 4; ++g) {
        lo[g] = load32(ql + 8 * g) >> low_shift;
        hi[g] = load32(ql + 8 * g + 4) >> low_shift;
    }
    put_nibbles(rec + 128, col, lo, hi);
    // Plane p, byte j: the top bits of k = 8 (2 p + e) + 4 h' + j at bit 4 e + 2 h'.
    for (int p = 0; p < 2; ++p) {
        uint32_t plane = 0;
        for (int e = 0; e < 2; ++e) {
            for (int hh = 0; hh < 2; ++hh) {
                const uint32_t top = (load32(qh + 8 * (2 * p + e) + 4 * hh) >> top_shift) & 0x03030303u;
                plane |= top << (4 * e + 2 * hh);
            }
        }
        store32(rec + p * 64 + col * 4, plane);
    }
    rec[384 + col] = super[192 + 2 * b];
    rec[384 + 16 + col] = super[192 + 2 * b + 1];
}

// Q6_K super-block -> q6k's 3,360-byte record (8 blocks of 416 bytes, then d[16]).
void pack_q6k(uint8_t* rec, int col, const uint8_t* super) {
    for (int b = 0; b < 8; ++b) pack_q6k_block(rec + 416 * b, col, super, b);
    copy16(rec + 3328 + 2 * col, super + 208);
}

// Q4_K super-block (144 bytes: d, dmin, 12 scale bytes, 128 code bytes) -> q4k's 2304-byte
// record (12 scale planes of 16 bytes, d[16], dmin[16], 8 blocks of 256 code bytes).
void pack_q4k(uint8_t* rec, int col, const uint8_t* super) {
    for (int p = 0; p < 12; ++p) rec[16 * p + col] = super[4 + p];
    copy16(rec + 192 + 2 * col, super);
    copy16(rec + 224 + 2 * col, super + 2);
    for (int b = 0; b < 8; ++b) put_k_nibbles(rec + 256 + 256 * b, col, super + 16, b);
}

struct Layout {
    int record;      // bytes of a packed record
    int src_bytes;   // GGUF bytes a record's column reads
    int per_record;  // weights a record holds along k
};

bool layout_of(int format, Layout* out) {
    switch (format) {
        case kQ4S: *out = {288, 18, kBlock}; return true;
        case kQ4: *out = {320, 20, kBlock}; return true;
        case kQ8: *out = {544, 34, kBlock}; return true;
        case kQ6K: *out = {3360, 210, 256}; return true;
        case kQ4K: *out = {2304, 144, 256}; return true;
        default: return false;
    }
}

// One tile's record r from its columns' rows (null: a zero column; the record starts zeroed).
void pack_record(int format, uint8_t* rec, const uint8_t* const* rows, int64_t r) {
    for (int col = 0; col < kCols; ++col) {
        const uint8_t* row = rows[col];
        if (row == nullptr) {
            if (format == kQ8) {
                for (int g = 0; g < 8; ++g) store32(rec + g * 64 + col * 4, 0x80808080u);
            }
            continue;
        }
        switch (format) {
            case kQ4S: pack_q4s(rec, col, row + 18 * r); break;
            case kQ4: pack_q4(rec, col, row + 20 * r); break;
            case kQ8: pack_q8(rec, col, row + 34 * r); break;
            case kQ6K: pack_q6k(rec, col, row + 210 * r); break;
            case kQ4K: pack_q4k(rec, col, row + 144 * r); break;
        }
    }
}

// ---- dequantizing rows, as gguf-py does (float32, the same operations in the same order) ----

// Q4_0 (d * (q - 8)), Q4_1 (d * q + m), Q8_0 (d * q): one block of 32 from src into out.
void dequant_legacy(int format, const uint8_t* src, float* out) {
    const float d = fp16_to_float(src);
    if (format == kQ8) {
        for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(src[2 + i]));
        return;
    }
    const uint8_t* qs = src + (format == kQ4 ? 4 : 2);
    for (int i = 0; i < kBlock; ++i) {
        const int q = (qs[i % 16] >> (4 * (i / 16))) & 15;
        if (format == kQ4) {
            out[i] = d * static_cast<float>(q) + fp16_to_float(src + 2);
        } else {
            out[i] = d * static_cast<float>(q - 8);
        }
    }
}

// Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K super-block: (d * sc) * q - dmin * m per sub-block.
void dequant_q4k(const uint8_t* super, float* out) {
    const float d = fp16_to_float(super), dmin = fp16_to_float(super + 2);
    for (int b = 0; b < 8; ++b) {
        int sc, m;
        k_scale_min(super + 4, b, &sc, &m);
        const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
        const uint8_t* qs = super + 16 + 32 * (b / 2);
        for (int i = 0; i < kBlock; ++i) out[32 * b + i] = scale * static_cast<float>((qs[i] >> (4 * (b % 2))) & 15) - offset;
    }
}

// Q6_K super-block: (d * scale) * (q - 32), a scale per 16 weights.
void dequant_q6k(const uint8_t* super, float* out) {
    const float d = fp16_to_float(super + 208);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, s = (e % 128) / 32, i = e % 32;
        const int low = (super[64 * h + 32 * (s % 2) + i] >> (4 * (s / 2))) & 15;
        const int top = (super[128 + 32 * h + i] >> (2 * s)) & 3;
        const float scale = d * static_cast<float>(static_cast<int8_t>(super[192 + e / 16]));
        out[e] = scale * static_cast<float>((low | (top << 4)) - 32);
    }
}

void dequant_row(int format, const uint8_t* row, int64_t k, float* out) {
    if (format == kQ4K || format == kQ6K) {
        for (int64_t s = 0; s < k / 256; ++s) {
            if (format == kQ4K) dequant_q4k(row + 144 * s, out + 256 * s);
            else dequant_q6k(row + 210 * s, out + 256 * s);
        }
        return;
    }
    const int bytes = format == kQ4S ? 18 : format == kQ4 ? 20 : 34;
    for (int64_t b = 0; b < k / kBlock; ++b) dequant_legacy(format, row + bytes * b, out + kBlock * b);
}

}  // namespace

extern "C" {

// Pack tiles * 16 GGUF rows of k weights (row_offset: each column's first byte in source, -1
// for a zero column; the caller checked each row lies inside source) into out ([tiles][k / per_record][record] bytes) for format (q4s from Q4_0, q4 from
// Q4_1, q8 from Q8_0, q6k from Q6_K, q4k from Q4_K). Returns 0, or -1 for a format not taken
// here or a k that is not whole records.
int pagellm_pack_gguf(int format, const void* source, const int64_t* row_offset, int64_t tiles, int64_t k, void* out, int num_threads) {
    Layout layout;
    if (!layout_of(format, &layout) || k <= 0 || k % layout.per_record != 0) return -1;
    const int64_t records = k / layout.per_record;
    auto* dst = static_cast<uint8_t*>(out);
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* rows[kCols];
        for (int c = 0; c < kCols; ++c) {
            const int64_t at = row_offset[t * kCols + c];
            rows[c] = at < 0 ? nullptr : static_cast<const uint8_t*>(source) + at;
        }
        uint8_t* tile = dst + t * records * layout.record;
        std::memset(tile, 0, static_cast<size_t>(records) * layout.record);
        for (int64_t r = 0; r < records; ++r) pack_record(format, tile + r * layout.record, rows, r);
    }
    return 0;
}

// Dequantize rows of k weights (row_offset: each row's first byte in source) of format into
// out [rows, k] float32. Returns 0, or -1 for a format not taken here or a k not whole blocks.
int pagellm_dequant_gguf_rows(int format, const void* source, const int64_t* row_offset, int64_t rows, int64_t k,
                              float* out, int num_threads) {
    Layout layout;
    if (!layout_of(format, &layout) || k <= 0 || k % layout.per_record != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        dequant_row(format, static_cast<const uint8_t*>(source) + row_offset[r], k, out + r * k);
    }
    return 0;
}

}  // extern "C"
