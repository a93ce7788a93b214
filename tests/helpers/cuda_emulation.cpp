// Runs the ZipCCL CUDA kernels (cuda/zipccl_kernels.cuh) on the CPU, one
// std::thread per CUDA thread, so their logic can be checked byte for byte
// against the torch reference on machines without a GPU. Only what the
// kernels use is emulated: thread and block indices, __syncthreads (a barrier
// of the block's threads), the warp shuffles (through a block-wide exchange
// array; the kernels call them with every thread of the block), atomicAdd
// (std::atomic_ref), __shared__ (function-static storage, shared by the block's
// threads as one block runs at a time). Blocks run one after another, in index
// order or (emu_set_order) in a shuffled order, where a tile's look-back meets
// aggregates and prefixes mixed as on a GPU.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

struct Dim { unsigned x; };
static thread_local Dim threadIdx;
static thread_local Dim blockIdx;
static std::barrier<> *block_barrier = nullptr;
static int exchange[1024];

#define __global__
#define __host__
#define __device__
#define __forceinline__ inline
#define __shared__ static

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }

struct uint4 { unsigned x, y, z, w; };

static inline int __shfl_up_sync(unsigned, int value, int delta) {
    const int me = (int)threadIdx.x, lane = me & 31;
    exchange[me] = value;
    __syncthreads();
    const int out = lane >= delta ? exchange[me - delta] : value;
    __syncthreads();
    return out;
}

static inline int __shfl_xor_sync(unsigned, int value, int mask) {
    const int me = (int)threadIdx.x;
    exchange[me] = value;
    __syncthreads();
    const int out = exchange[(me & ~31) | ((me & 31) ^ mask)];
    __syncthreads();
    return out;
}

static inline int atomicAdd(int *address, int value) {
    return std::atomic_ref<int>(*address).fetch_add(value);
}

static inline unsigned atomicAdd(unsigned *address, unsigned value) {
    return std::atomic_ref<unsigned>(*address).fetch_add(value);
}

#include "zipccl_kernels.cuh"

static unsigned order_seed = 0;  // 0: index order

static void launch(int64_t blocks, const std::function<void()> &kernel) {
    std::vector<int64_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    if (order_seed) std::shuffle(order.begin(), order.end(), std::mt19937(order_seed));
    for (int64_t b : order) {
        std::barrier<> barrier(ZC_THREADS);
        block_barrier = &barrier;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < ZC_THREADS; ++t) {
            threads.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = (unsigned)b;
                kernel();
            });
        }
        for (auto &thread : threads) thread.join();
    }
}

extern "C" {

void emu_set_order(unsigned seed) { order_seed = seed; }

// The two launches of `encode` in cuda/zipccl.cu, with its scratch from the caller.
void emu_encode(const uint16_t *values, int64_t n, uint8_t *chunk, uint8_t *room,
                uint8_t *code_of, unsigned long long *status, int64_t *sums) {
    const ZcLayout l = zc_layout(n);
    launch(l.blocks > 0 ? l.blocks : 1,
           [&] { zc_tables_kernel(values, l, chunk, code_of, status, sums); });
    launch(l.tiles, [&] { zc_encode_kernel(values, l, code_of, sums, status, chunk, room); });
}

// The two launches of `decode` in cuda/zipccl.cu.
void emu_decode(const uint8_t *chunk, const uint8_t *escapes, int64_t escape_room, int64_t n,
                uint16_t *values, unsigned long long *shares, int64_t *status) {
    const ZcLayout l = zc_layout(n);
    launch(l.tiles, [&] { zc_decode_kernel(chunk, l, escapes, escape_room, values, shares); });
    launch(1, [&] { zc_check_kernel(chunk, n, escape_room, shares, l.tiles, status); });
}
}
