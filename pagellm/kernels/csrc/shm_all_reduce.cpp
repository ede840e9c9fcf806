// All-reduce (sum) of float32 vectors between the tensor-parallel ranks of one host, through a
// shared memory region every rank maps (pagellm/distributed/shm_all_reduce.py owns it).
//
// Why: gloo's all-reduce goes through the TCP loopback, ~1.3 ms a call for a [1, 576] vector on a
// 2-core VM (NOTES 44), and a decoder step makes two per layer. Ranks on one host can exchange
// those few KB through memory in microseconds.
//
// Region: per rank a 64-byte header (its sequence number, its pid), then per rank two slots of
// `slot_elems` floats. Call number `seq` (1, 2, ...; the same on every rank) uses slot seq % 2:
// each rank copies its vector into its slot, publishes seq (release), waits until every rank has
// published at least seq (acquire), then sums all slots in rank order, so every rank gets the
// same bits. A slot is written again two calls later, only after every rank has published the
// call in between, which it does after finishing this call's sum: two slots are enough.
//
// A wait gives up, with an error instead of a hang, when a peer's process is gone (or a zombie)
// or after `timeout_s`.

#include <sched.h>
#include <signal.h>
#include <time.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <immintrin.h>

#include "exports.h"

namespace {

constexpr int64_t kHeaderBytes = 64;

struct Header {
    uint64_t seq;
    int64_t pid;
};

Header* header(void* region, int rank) {
    return reinterpret_cast<Header*>(static_cast<char*>(region) + rank * kHeaderBytes);
}

float* slot(void* region, int size, int rank, int which, int64_t slot_elems) {
    char* data = static_cast<char*>(region) + size * kHeaderBytes;
    return reinterpret_cast<float*>(data) + (static_cast<int64_t>(rank) * 2 + which) * slot_elems;
}

double now_s() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Whether process `pid` exists and is not a zombie (a dead child its parent has not reaped).
bool alive(int64_t pid) {
    if (pid <= 0) return true;  // not registered yet
    if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
    char path[64], buf[256];
    std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) return true;  // no /proc: trust kill()
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* state = std::strrchr(buf, ')');  // "pid (comm) S ..."
    return state == nullptr || state[1] == '\0' || (state[2] != 'Z' && state[2] != 'X');
}

// 0 once rank `peer` has published `seq`; -3 on timeout, -4 if its process is gone.
int wait_for(void* region, int peer, uint64_t seq, double deadline) {
    const Header* h = header(region, peer);
    for (uint64_t spins = 0;; ++spins) {
        if (__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE) >= seq) return 0;
        if (spins < 4096) {
            _mm_pause();
            continue;
        }
        sched_yield();  // more ranks than cores: let the peer run
        if (spins % 1024 == 0) {
            if (!alive(__atomic_load_n(&h->pid, __ATOMIC_RELAXED))) return -4;
            if (now_s() > deadline) return -3;
        }
    }
}

}  // namespace

extern "C" {

// Bytes of the region for `size` ranks and slots of `slot_elems` floats.
int64_t pagellm_shm_region_bytes(int size, int64_t slot_elems) {
    return size * kHeaderBytes + static_cast<int64_t>(size) * 2 * slot_elems * static_cast<int64_t>(sizeof(float));
}

// Register this rank's pid in the region (before its first all-reduce).
void pagellm_shm_register(void* region, int rank, int64_t pid) {
    __atomic_store_n(&header(region, rank)->pid, pid, __ATOMIC_RELEASE);
}

// data[0:n] = the sum over ranks of their data[0:n] (n <= slot_elems), call number `seq`.
// Returns 0; -1 on a bad argument, -3 on timeout, -4 if a peer's process is gone.
int pagellm_shm_all_reduce(void* region, int rank, int size, float* data, int64_t n, int64_t slot_elems, uint64_t seq,
                           double timeout_s) {
    if (region == nullptr || rank < 0 || rank >= size || n < 0 || n > slot_elems || seq == 0) return -1;
    const int which = static_cast<int>(seq % 2);
    std::memcpy(slot(region, size, rank, which, slot_elems), data, static_cast<size_t>(n) * sizeof(float));
    __atomic_store_n(&header(region, rank)->seq, seq, __ATOMIC_RELEASE);
    const double deadline = now_s() + timeout_s;
    for (int peer = 0; peer < size; ++peer) {
        if (peer == rank) continue;
        const int rc = wait_for(region, peer, seq, deadline);
        if (rc != 0) return rc;
    }
    const float* first = slot(region, size, 0, which, slot_elems);
    for (int64_t i = 0; i < n; ++i) data[i] = first[i];
    for (int peer = 1; peer < size; ++peer) {
        const float* part = slot(region, size, peer, which, slot_elems);
        for (int64_t i = 0; i < n; ++i) data[i] += part[i];
    }
    return 0;
}

}  // extern "C"
