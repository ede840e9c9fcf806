// Work splitting shared by the GEMMs (gemm_bf16.cpp, gemm_avx2.cpp, gemm_int8.cpp). Header-only,
// internal linkage in each source.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace {

// The work items of a product, (chunk of rows of A, weight panel), split into one range per
// thread: each thread's panels over every chunk, chunk by chunk. A thread takes its own items
// from the front and, once they run out, another range's from the back. A static split left one
// thread waiting at the end of every product: this host's vCPUs do not run at equal speed
// (steal time): 30 layers' linears at 64 rows took 20.9-27.6 ms (medians of two runs) against
// 22.1-31.5 with the static split, the two alternating in one process (benchmarks/NOTES.md, 26).
class WorkRanges {
  public:
    struct Item {
        int64_t chunk = 0, panel = 0;
        bool next_is_own = false;  // this thread's next item is panel + 1 of the same chunk
    };

    WorkRanges(int64_t panels, int64_t chunks, int ranges) : count_(ranges < 1 ? 1 : ranges) {
        slots_ = std::make_unique<Slot[]>(static_cast<size_t>(count_));
        for (int r = 0; r < count_; ++r) {
            Slot& slot = slots_[r];
            slot.p0 = panels * r / count_;
            slot.p1 = panels * (r + 1) / count_;
            slot.state.store(static_cast<uint64_t>(chunks * (slot.p1 - slot.p0)) << 32, std::memory_order_relaxed);
        }
    }

    // The next item for thread t; false when every range is empty.
    bool next(int t, Item& item) {
        const int own = t % count_;
        int64_t j = take(slots_[own], true);
        if (j >= 0) return locate(own, j, true, item);
        for (int i = 1; i < count_; ++i) {
            const int r = (own + i) % count_;
            j = take(slots_[r], false);
            if (j >= 0) return locate(r, j, false, item);
        }
        return false;
    }

  private:
    struct alignas(64) Slot {
        std::atomic<uint64_t> state{0};  // next front item (low 32 bits), end of the range (high 32)
        int64_t p0 = 0, p1 = 0;
    };

    static int64_t take(Slot& slot, bool front) {
        uint64_t state = slot.state.load(std::memory_order_relaxed);
        for (;;) {
            const uint64_t head = state & 0xffffffffu, tail = state >> 32;
            if (head >= tail) return -1;
            const uint64_t next = front ? (tail << 32) | (head + 1) : ((tail - 1) << 32) | head;
            if (slot.state.compare_exchange_weak(state, next, std::memory_order_relaxed))
                return static_cast<int64_t>(front ? head : tail - 1);
        }
    }

    bool locate(int r, int64_t j, bool own, Item& item) const {
        const Slot& slot = slots_[r];
        const int64_t width = slot.p1 - slot.p0;
        item.chunk = j / width;
        item.panel = slot.p0 + j % width;
        item.next_is_own = own && item.panel + 1 < slot.p1;
        return true;
    }

    int count_;
    std::unique_ptr<Slot[]> slots_;
};

}  // namespace
