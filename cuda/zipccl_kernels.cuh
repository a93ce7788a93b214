// ZipCCL codec kernels for bfloat16 on NVIDIA GPUs.
//
// Byte-for-byte the format of ray_zep/collectives/format.py (and the output of
// the torch reference and the C kernel). One thread block codes one tile of
// 1024 values: 128 threads, eight consecutive values per thread, so each
// thread owns one byte of every bit plane and eight bytes of the raw plane,
// and a warp's stores to a plane are 32 consecutive bytes.
//
// Each block of ZC_BLOCK_VALUES values (a whole number of tiles) has its own
// code table, chosen by the host (ray_zep/collectives/table.py): `code_of` holds
// one 256-entry field -> code lookup per block, `table8` one 8-entry code ->
// field lookup per block (entry 0 unused: code 0 is an escape).
//
// Escapes are written in value order: a first launch counts each tile's
// escapes, the host turns the counts into the tile index (exclusive prefix
// sum, stored in the chunk), and the encoder places a thread's escapes at
// tile index + the exclusive scan of the escape counts of the threads before
// it in the tile. The decoder recomputes the same scan from the codes.
#pragma once
#include <stdint.h>

#ifndef ZC_TILE_VALUES
#define ZC_TILE_VALUES 1024
#endif
#ifndef ZC_BLOCK_VALUES
#define ZC_BLOCK_VALUES 4096
#endif
#define ZC_TILES_PER_BLOCK (ZC_BLOCK_VALUES / ZC_TILE_VALUES)
#define ZC_VALUES_PER_THREAD 8
#define ZC_THREADS (ZC_TILE_VALUES / ZC_VALUES_PER_THREAD)
#define ZC_WARPS (ZC_THREADS / 32)

static_assert(ZC_THREADS % 32 == 0, "a tile must fill whole warps");
static_assert(ZC_BLOCK_VALUES % ZC_TILE_VALUES == 0, "a block must be whole tiles");

// This tile's block's entry of a per-block lookup with `width` entries per block.
__device__ __forceinline__ int64_t zc_block_lookup(int width) {
    return (int64_t)(blockIdx.x / ZC_TILES_PER_BLOCK) * width;
}

// Exclusive prefix sum of `value` over the block's threads; `total` gets the sum.
__device__ __forceinline__ int zc_block_exclusive_scan(int value, int *total) {
    __shared__ int warp_sums[ZC_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < ZC_WARPS; ++w) {
        if (w < warp) before += warp_sums[w];
        sum += warp_sums[w];
    }
    __syncthreads();  // warp_sums may be reused by a later scan
    *total = sum;
    return before + inclusive - value;
}

// Codes of this thread's values (code k in byte k) and how many of them escape.
__device__ __forceinline__ uint64_t zc_codes(const uint16_t *values, int64_t n, int64_t first,
                                             const uint8_t *code_of, int *escapes) {
    uint64_t codes = 0;
    int count = 0;
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const int64_t i = first + k;
        if (i < n) {
            const uint32_t c = code_of[(values[i] >> 7) & 0xFFu];
            codes |= (uint64_t)c << (8 * k);
            count += (c == 0);
        }
    }
    *escapes = count;
    return codes;
}

__device__ __forceinline__ uint8_t zc_plane_byte(uint64_t codes, int bit) {
    return (uint8_t)((((codes >> bit) & 0x0101010101010101ULL) * 0x0102040810204080ULL) >> 56);
}

__global__ void zc_count_escapes_kernel(const uint16_t *values, int64_t n, const uint8_t *code_of,
                                        int64_t *counts) {
    const int64_t first = ((int64_t)blockIdx.x * ZC_THREADS + threadIdx.x) * ZC_VALUES_PER_THREAD;
    int escapes = 0, total = 0;
    zc_codes(values, n, first, code_of + zc_block_lookup(256), &escapes);
    zc_block_exclusive_scan(escapes, &total);
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

__global__ void zc_encode_kernel(const uint16_t *values, int64_t n, const uint8_t *code_of,
                                 const int32_t *tile_index, uint8_t *raw, uint8_t *plane0,
                                 uint8_t *plane1, uint8_t *plane2, uint8_t *escapes_out) {
    const int64_t group = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x;
    const int64_t first = group * ZC_VALUES_PER_THREAD;
    int escapes = 0, total = 0;
    const uint64_t codes = zc_codes(values, n, first, code_of + zc_block_lookup(256), &escapes);
    int slot = tile_index[blockIdx.x] + zc_block_exclusive_scan(escapes, &total);
    if (first >= n) return;
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const int64_t i = first + k;
        if (i < n) {
            const uint32_t v = values[i];
            raw[i] = (uint8_t)((v & 0x7Fu) | ((v >> 8) & 0x80u));
            if (((codes >> (8 * k)) & 7u) == 0) escapes_out[slot++] = (uint8_t)((v >> 7) & 0xFFu);
        }
    }
    plane0[group] = zc_plane_byte(codes, 0);
    plane1[group] = zc_plane_byte(codes, 1);
    plane2[group] = zc_plane_byte(codes, 2);
}

__global__ void zc_decode_kernel(const uint8_t *raw, const uint8_t *plane0, const uint8_t *plane1,
                                 const uint8_t *plane2, const int32_t *tile_index,
                                 const uint8_t *escapes, const uint8_t *table8, int64_t n,
                                 uint16_t *values) {
    const int64_t group = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x;
    const int64_t first = group * ZC_VALUES_PER_THREAD;
    uint32_t b0 = 0, b1 = 0, b2 = 0;
    if (first < n) {
        b0 = plane0[group];
        b1 = plane1[group];
        b2 = plane2[group];
    }
    int escaped = 0, total = 0;
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const uint32_t c = ((b0 >> k) & 1u) | (((b1 >> k) & 1u) << 1) | (((b2 >> k) & 1u) << 2);
        escaped += (first + k < n) && c == 0;
    }
    int slot = tile_index[blockIdx.x] + zc_block_exclusive_scan(escaped, &total);
    if (first >= n) return;
    const uint8_t *fields = table8 + zc_block_lookup(8);
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const int64_t i = first + k;
        if (i < n) {
            const uint32_t c = ((b0 >> k) & 1u) | (((b1 >> k) & 1u) << 1) | (((b2 >> k) & 1u) << 2);
            const uint32_t e = c ? fields[c] : escapes[slot++];
            const uint32_t sm = raw[i];
            values[i] = (uint16_t)(((sm & 0x80u) << 8) | (e << 7) | (sm & 0x7Fu));
        }
    }
}
