// The integer GEMM's packed weights (gemm_int8.cpp, included inside its anonymous namespace):
// the format codes, each format's record and where a block's record and codes start in a tile.
//
// Packed weight: tiles of 16 columns, each tile's blocks in k order, one record per block:
//   q4: 256 bytes of codes, 4 groups (k = 8g .. 8g + 7) x 16 columns x 4 bytes, byte j of a
//       column holding k = 8g + j in its low nibble and k = 8g + 4 + j in its high one; then
//       d[16] and m[16] as fp16: 320 bytes per 512 weights (Q4_1's 20 bytes per 32).
//   q4s: q4's codes, then d[16] fp16: 288 bytes per 512 weights (Q4_0's 18 bytes per 32).
//   q4k: per 8 blocks (a super-block of 256 k) one record of 2304 bytes: Q4_K's 12 bytes of 6-bit
//        scales and mins as 12 planes of 16 columns, d[16] and dmin[16] fp16, then the 8 blocks'
//        q4 codes (256 bytes each) (GGUF Q4_K as stored: 4.5 bits a weight). Its activations
//        take one scale per super-block and the 6-bit scales and mins apply as integers
//        (gemm_int8_q4k.h).
//   q4f: q4 with d[16] and m[16] as fp32: 384 bytes (a q4k weight widened, exact).
//   q8: 512 bytes of codes, 8 groups (k = 4g .. 4g + 3) x 16 columns x 4 bytes; then d[16]
//       fp16: 544 bytes per 512 weights.
//   q5f: q4f's nibbles, then 64 bytes of fifth bits (byte i as a group's byte i: bit 2g the low
//        nibble's of group g, bit 2g + 1 the high one's), then d[16], m[16] fp32: 448 bytes (GGUF
//        Q5_K: fp16 x 6-bit scales; Q5_0 / Q5_1, exact).
//   q6k: per 8 blocks (a super-block of 256 k) one record of 3,360 bytes: for each block two
//        64-byte planes of the top two bits (plane p, byte i: bits 4e .. 4e + 1 the low nibble's of
//        group 2p + e, bits 4e + 2 .. 4e + 3 the high one's), q4's nibbles and s[2][16] int8 (half,
//        column), 416 bytes; then d[16] fp16 (GGUF Q6_K as stored: 6.5625 bits a weight).
// Each record's bytes lie in the order the kernel reads them: a decode step streams the weights
// from memory, and with a jump back inside every record (q4k's scales after its codes, q6k's
// planes after its nibbles) it ran 13-23% slower (NOTES 56).
#pragma once

constexpr int kTileCols = 16;
constexpr int kBlock = 32;
// Weight formats (w_format): q4 (fp16 scale and offset), q8 (fp16 scale), q4f (q4 with fp32
// scale and offset: a q4k weight widened), q5f (5-bit codes, fp32 scale and offset), q6k (6-bit
// codes, int8 scales per 16 under an fp16 scale), q4s (q4's codes centred on 8, fp16 scale: GGUF's
// Q4_0), q4k (GGUF's Q4_K as stored).
constexpr int kQ4 = 0, kQ8 = 1, kQ4F = 2, kQ5F = 3, kQ6K = 4, kQ4S = 5, kQ4K = 6;
constexpr int kFormats = 7;
// Bytes per block of a 16-column tile (q4k, q6k: their super-block's record over 8 blocks).
constexpr int kRecordBytes[kFormats] = {256 + 64, 512 + 32, 256 + 128, 256 + 64 + 128, (8 * (128 + 256 + 32) + 32) / 8,
                                        256 + 32, 256 + 32};
constexpr int kSuperBlocks = 8;                         // q4k, q6k: blocks per super-block
constexpr int64_t kSuperRecord = kSuperBlocks * kRecordBytes[kQ4K];  // q4k: one super-block of a tile
// q4k: where a super-block record's d[16] and dmin[16] (fp16) and its 8 blocks' codes start (its
// 12 scale planes of 16 bytes first).
constexpr int64_t kQ4KD = 192, kQ4KDmin = 224, kQ4KCodes = 256;
constexpr int64_t kQ6KBlock = 128 + 256 + 32;  // q6k: one block's planes, nibbles and sub-scales
constexpr int64_t kQ6KSuper = kSuperBlocks * kRecordBytes[kQ6K];  // q6k: 8 blocks, then d[16]
// Where block b's record starts in a tile (q6k: inside its super-block's record; not q4k).
template <int kFmt>
inline const uint8_t* block_record(const uint8_t* tile, int64_t b) {
    if constexpr (kFmt == kQ6K) return tile + (b / kSuperBlocks) * kQ6KSuper + (b % kSuperBlocks) * kQ6KBlock;
    return tile + b * kRecordBytes[kFmt];
}
// Where block b's codes start in a tile (q4k: inside its super-block's record).
template <int kFmt>
inline const uint8_t* block_codes(const uint8_t* tile, int64_t b) {
    if constexpr (kFmt == kQ4K) return tile + (b / kSuperBlocks) * kSuperRecord + kQ4KCodes + (b % kSuperBlocks) * 256;
    if constexpr (kFmt == kQ6K) return block_record<kFmt>(tile, b) + 128;
    return block_record<kFmt>(tile, b);
}

// Where plane p (64 bytes) of a q5f or q6k block's top bits starts in its record: q6k's two
// before its nibbles, q5f's one after them.
constexpr int64_t top_bits_plane(int fmt, int p) { return (fmt == kQ6K ? 0 : 256) + 64 * p; }

// Formats whose activations take one scale per super-block of 256 (QuantizedA::super_scale).
constexpr bool super_scaled(int fmt) { return fmt == kQ4K || fmt == kQ6K; }

// The integer offset folded into a block's isum before scaling: q8's codes are q_w + 128, q4s's
// weights code - 8 (times the block's sum(q)); 0 for the formats with a float offset.
constexpr int32_t code_zero(int fmt) { return fmt == kQ8 ? 128 : fmt == kQ4S ? 8 : 0; }
