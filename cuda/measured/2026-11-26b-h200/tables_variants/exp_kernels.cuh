#include "zipccl_kernels.cuh"

__global__ void zc_tables_kernel_b(const uint16_t *values, int64_t n, int64_t tiles,
                                 uint8_t *code_of, uint8_t *table_bytes, int64_t *counts,
                                 int64_t *sums) {
    __shared__ int histogram[ZC_FIELDS];
    __shared__ int per_warp[ZC_WARPS][ZC_FIELDS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int f = lane; f < ZC_FIELDS; f += 32) per_warp[warp][f] = 0;
    __syncthreads();
    const int64_t tile = (int64_t)blockIdx.x * ZC_TILES_PER_BLOCK + warp;
    const int rounds = ZC_TILE_VALUES / (32 * ZC_VALUES_PER_THREAD);
    uint32_t checksum = 0;
    for (int r = 0; r < rounds; ++r) {
        const int64_t first = tile * ZC_TILE_VALUES + (r * 32 + lane) * ZC_VALUES_PER_THREAD;
        uint16_t eight[ZC_VALUES_PER_THREAD];
        zc_load8(values, n, first, eight);
#pragma unroll
        for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
            const int field = (eight[k] >> 7) & 0xFF;
            if (first + k < n) checksum += zc_checksum_term(eight[k], first + k);
            atomicAdd(&per_warp[warp][field], 1);
        }
    }
    __syncthreads();
    for (int f = threadIdx.x; f < ZC_FIELDS; f += ZC_THREADS) {
        int total = 0;
        for (int w = 0; w < ZC_WARPS; ++w) total += per_warp[w][f];
        histogram[f] = total;
    }
    __syncthreads();
    // Every warp picks the same table: key = count x 255 + (254 - field) is unique per
    // field, so the seven largest keys give the fields by decreasing count, ties to
    // the smaller field. Field 255 (Inf, NaN and the padding) is never coded.
    int keys[ZC_FIELDS / 32];
#pragma unroll
    for (int j = 0; j < ZC_FIELDS / 32; ++j) {
        const int f = lane + 32 * j;
        keys[j] = f < ZC_FIELDS - 1 ? histogram[f] * (ZC_FIELDS - 1) + (ZC_FIELDS - 2 - f) : -1;
    }
    int table[ZC_TABLE];
#pragma unroll
    for (int c = 0; c < ZC_TABLE; ++c) {
        int best = -1;
#pragma unroll
        for (int j = 0; j < ZC_FIELDS / 32; ++j) best = keys[j] > best ? keys[j] : best;
        best = zc_warp_max(best);
        table[c] = ZC_FIELDS - 2 - best % (ZC_FIELDS - 1);
#pragma unroll
        for (int j = 0; j < ZC_FIELDS / 32; ++j) keys[j] = keys[j] == best ? -1 : keys[j];
    }
    for (int f = threadIdx.x; f < ZC_FIELDS; f += ZC_THREADS) {
        uint8_t code = 0;
#pragma unroll
        for (int c = 0; c < ZC_TABLE; ++c) code = table[c] == f ? (uint8_t)(c + 1) : code;
        code_of[(int64_t)blockIdx.x * ZC_FIELDS + f] = code;
    }
    if (threadIdx.x < ZC_TABLE_BYTES)
        table_bytes[(int64_t)blockIdx.x * ZC_TABLE_BYTES + threadIdx.x] =
            threadIdx.x < ZC_TABLE ? (uint8_t)table[threadIdx.x] : 0;
    uint32_t escaped = 0;
    for (int r = 0; r < rounds; ++r) {  // the tile again, from the cache
        const int64_t first = tile * ZC_TILE_VALUES + (r * 32 + lane) * ZC_VALUES_PER_THREAD;
        uint16_t eight[ZC_VALUES_PER_THREAD];
        zc_load8(values, n, first, eight);
#pragma unroll
        for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
            const int field = (eight[k] >> 7) & 0xFF;
            bool coded = false;
#pragma unroll
            for (int c = 0; c < ZC_TABLE; ++c) coded = coded || table[c] == field;
            escaped += (first + k < n) && !coded;
        }
    }
    escaped = zc_warp_sum(escaped);
    if (lane == 0 && tile < tiles) counts[tile] = escaped;
    checksum = zc_block_sum(checksum);
    if (threadIdx.x == 0) sums[blockIdx.x] = checksum;
}

