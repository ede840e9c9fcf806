// 16-bit weights packed into the GEMMs' pair panels at model load: [P][K / 2][cols][2], each
// (k, k + 1) pair of a column one 32-bit word (the layout of packing.py's torch packing, bit for
// bit; that packing stays the reference). Plain C++: every build has it, whatever the ISA. In
// torch the panels took three copies of the weight (pad, concatenate, transpose): ~4 s of a
// 1B bf16 model's start on two threads.

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "exports.h"

namespace {

constexpr int64_t kPairsPerStep = 64;  // k pairs a column contributes per pass (256 source bytes)

// The 32-bit pair kp of a source row (rows may sit at any 2-byte alignment).
inline uint32_t pair_at(const uint16_t* row, int64_t kp) {
    uint32_t v;
    std::memcpy(&v, row + 2 * kp, sizeof v);
    return v;
}

}  // namespace

extern "C" {

// dst[p][kp][c] (32-bit words) = pair kp of panel p's column c: row p * cols + c of `first`
// (zero past n); with `second`, the first cols / 2 columns are rows p * cols / 2 + c of
// `first` and the rest the same rows of `second` (a fused MLP's gate and up). first, second:
// contiguous [n, k] 16-bit rows. Returns 0, or -1 on a bad argument.
int pagellm_pack_pairs(const void* first, const void* second, int64_t n, int64_t k, int64_t cols, void* dst,
                       int num_threads) {
    if (first == nullptr || dst == nullptr || n <= 0 || k <= 0 || k % 2 != 0 || cols <= 0 ||
        (second != nullptr && cols % 2 != 0))
        return -1;
    if (num_threads < 1) num_threads = 1;
    const auto* a = static_cast<const uint16_t*>(first);
    const auto* b = static_cast<const uint16_t*>(second);
    auto* out = static_cast<uint32_t*>(dst);
    const int64_t kpairs = k / 2;
    const int64_t width = b != nullptr ? cols / 2 : cols;  // rows of one source a panel
    const int64_t panels = (n + width - 1) / width;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        uint32_t* panel = out + p * kpairs * cols;
        for (int64_t k0 = 0; k0 < kpairs; k0 += kPairsPerStep) {
            const int64_t k1 = k0 + kPairsPerStep < kpairs ? k0 + kPairsPerStep : kpairs;
            for (int64_t c = 0; c < cols; ++c) {
                const int64_t row = p * width + c % width;
                const uint16_t* source = c < width ? a : b;
                if (row >= n) {
                    for (int64_t kp = k0; kp < k1; ++kp) panel[kp * cols + c] = 0;
                    continue;
                }
                const uint16_t* src = source + row * k;
                for (int64_t kp = k0; kp < k1; ++kp) panel[kp * cols + c] = pair_at(src, kp);
            }
        }
    }
    return 0;
}

}  // extern "C"
