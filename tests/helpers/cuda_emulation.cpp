// Runs the ZipCCL CUDA kernels (cuda/zipccl_kernels.cuh) on the CPU, one
// std::thread per CUDA thread, so their logic can be checked byte for byte
// against the torch reference on machines without a GPU. Only what the
// kernels use is emulated: thread and block indices, __syncthreads (a barrier
// of the block's threads), the warp shuffles (through a block-wide exchange
// array; the kernels call them with every thread of the block), atomicAdd
// (std::atomic_ref), __shared__ (function-static storage, shared by the block's
// threads as one block runs at a time).
#include <atomic>
#include <barrier>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

struct Dim { unsigned x; };
static thread_local Dim threadIdx;
static thread_local Dim blockIdx;
static std::barrier<> *block_barrier = nullptr;
static int exchange[1024];

#define __global__
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

#include "zipccl_kernels.cuh"

static void launch(int64_t blocks, const std::function<void()> &kernel) {
    for (int64_t b = 0; b < blocks; ++b) {
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

void emu_tables(const uint16_t *values, int64_t n, int64_t tiles, uint8_t *code_of,
                uint8_t *table_bytes, int64_t *counts, int64_t *sums, int64_t blocks) {
    launch(blocks, [&] { zc_tables_kernel(values, n, tiles, code_of, table_bytes, counts, sums); });
}

void emu_encode(const uint16_t *values, int64_t n, const uint8_t *code_of,
                const int32_t *tile_index, uint8_t *raw, uint8_t *p0, uint8_t *p1, uint8_t *p2,
                uint8_t *escapes, int64_t tiles) {
    launch(tiles, [&] { zc_encode_kernel(values, n, code_of, tile_index, raw, p0, p1, p2, escapes); });
}

void emu_decode(const uint8_t *raw, const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                const int32_t *tile_index, const uint8_t *escapes, const uint8_t *table8, int64_t n,
                uint16_t *values, int64_t *sums, int64_t tiles) {
    launch(tiles, [&] {
        zc_decode_kernel(raw, p0, p1, p2, tile_index, escapes, table8, n, values, sums);
    });
}
}
