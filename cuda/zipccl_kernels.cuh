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
// Compressing takes two launches. The first (zc_tables_kernel, one thread block
// per block of ZC_BLOCK_VALUES values, one warp per tile) counts the block's
// exponent fields (a histogram per warp in shared memory, then their sum), picks
// its table (the seven most frequent fields, ties to the smaller field:
// ray_zep/collectives/table.py), writes the field -> code lookup and the table
// bytes, counts each tile's escapes and adds up the block's share of the checksum
// (sum of bits_i x (2i + 1) modulo 2^32, format.py). The host turns the escape
// counts into the tile index (exclusive prefix sum, stored in the chunk) and the
// encoder places a thread's escapes at tile index + the exclusive scan of the
// escape counts of the threads before it in the tile. The decoder recomputes the
// same scan from the codes and adds up each tile's share of the checksum of what
// it decoded.
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
#define ZC_FIELDS 256
#define ZC_TABLE 7
#define ZC_TABLE_BYTES 8

static_assert(ZC_THREADS % 32 == 0, "a tile must fill whole warps");
static_assert(ZC_BLOCK_VALUES % ZC_TILE_VALUES == 0, "a block must be whole tiles");
static_assert(ZC_BLOCK_VALUES / ZC_TILE_VALUES == ZC_WARPS, "zc_tables_kernel: a warp per tile");
static_assert(ZC_FIELDS % ZC_THREADS == 0, "zc_tables_kernel: whole lookups per thread");

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

// Sum of `value` over the warp, modulo 2^32, in every lane.
__device__ __forceinline__ uint32_t zc_warp_sum(uint32_t value) {
    for (int mask = 16; mask > 0; mask >>= 1)
        value += (uint32_t)__shfl_xor_sync(0xffffffffu, (int)value, mask);
    return value;
}

// Largest `value` of the warp, in every lane.
__device__ __forceinline__ int zc_warp_max(int value) {
    for (int mask = 16; mask > 0; mask >>= 1) {
        const int other = __shfl_xor_sync(0xffffffffu, value, mask);
        value = other > value ? other : value;
    }
    return value;
}

// Sum of `value` over the block's threads, modulo 2^32, in every thread.
__device__ __forceinline__ uint32_t zc_block_sum(uint32_t value) {
    __shared__ uint32_t warp_totals[ZC_WARPS];
    value = zc_warp_sum(value);
    if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = value;
    __syncthreads();
    uint32_t sum = 0;
    for (int w = 0; w < ZC_WARPS; ++w) sum += warp_totals[w];
    __syncthreads();  // warp_totals may be reused by a later sum
    return sum;
}

// Value i's term of the checksum: its bits times 2i + 1, modulo 2^32.
__device__ __forceinline__ uint32_t zc_checksum_term(uint32_t bits, int64_t i) {
    return bits * (2u * (uint32_t)i + 1u);  // the same modulo 2^32
}

// Eight values from `first` on (past `n`: field 255, which is never coded), 16-byte
// loads where the eight are whole and aligned.
__device__ __forceinline__ void zc_load8(const uint16_t *values, int64_t n, int64_t first,
                                         uint16_t out[ZC_VALUES_PER_THREAD]) {
    if (first + ZC_VALUES_PER_THREAD <= n && ((uintptr_t)(values + first) & 15) == 0) {
        const uint4 word = *reinterpret_cast<const uint4 *>(values + first);
        const uint32_t parts[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            out[2 * k] = (uint16_t)(parts[k] & 0xFFFFu);
            out[2 * k + 1] = (uint16_t)(parts[k] >> 16);
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k)
        out[k] = first + k < n ? values[first + k] : (uint16_t)0x7F80u;
}

// Round r of a warp reading `tile`: this lane's eight values (`zc_load8`); returns the
// index of the first.
__device__ __forceinline__ int64_t zc_load_round(const uint16_t *values, int64_t n, int64_t tile,
                                                 int r, uint16_t out[ZC_VALUES_PER_THREAD]) {
    const int lane = threadIdx.x & 31;
    const int64_t first = tile * ZC_TILE_VALUES + (r * 32 + lane) * ZC_VALUES_PER_THREAD;
    zc_load8(values, n, first, out);
    return first;
}

__device__ __forceinline__ uint8_t zc_plane_byte(uint64_t codes, int bit) {
    return (uint8_t)((((codes >> bit) & 0x0101010101010101ULL) * 0x0102040810204080ULL) >> 56);
}

// One thread block per block of ZC_BLOCK_VALUES values, warp w reading tile w of it:
// the block's table (`table_bytes`: fields coded 1..7, then a zero byte) and its
// field -> code lookup (`code_of`, 256 entries), the escapes of each of its tiles
// (`counts`, `tiles` in all) and its share of the checksum (`sums`).
__global__ void zc_tables_kernel(const uint16_t *values, int64_t n, int64_t tiles,
                                 uint8_t *code_of, uint8_t *table_bytes, int64_t *counts,
                                 int64_t *sums) {
    __shared__ int histogram[ZC_FIELDS];
    __shared__ int per_warp[ZC_WARPS][ZC_FIELDS];  // each warp counts its own tile
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int f = lane; f < ZC_FIELDS; f += 32) per_warp[warp][f] = 0;
    __syncthreads();
    const int64_t tile = (int64_t)blockIdx.x * ZC_TILES_PER_BLOCK + warp;
    const int rounds = ZC_TILE_VALUES / (32 * ZC_VALUES_PER_THREAD);
    uint32_t checksum = 0;
    for (int r = 0; r < rounds; ++r) {
        uint16_t eight[ZC_VALUES_PER_THREAD];
        const int64_t first = zc_load_round(values, n, tile, r, eight);
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
        uint16_t eight[ZC_VALUES_PER_THREAD];
        const int64_t first = zc_load_round(values, n, tile, r, eight);
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

__global__ void zc_encode_kernel(const uint16_t *values, int64_t n, const uint8_t *code_of,
                                 const int32_t *tile_index, uint8_t *raw, uint8_t *plane0,
                                 uint8_t *plane1, uint8_t *plane2, uint8_t *escapes_out) {
    __shared__ uint8_t lookup[ZC_FIELDS];  // this block's field -> code
    const uint8_t *block_codes = code_of + zc_block_lookup(ZC_FIELDS);
    for (int f = threadIdx.x; f < ZC_FIELDS; f += ZC_THREADS) lookup[f] = block_codes[f];
    __syncthreads();
    const int64_t group = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x;
    const int64_t first = group * ZC_VALUES_PER_THREAD;
    uint16_t eight[ZC_VALUES_PER_THREAD];
    zc_load8(values, n, first, eight);
    uint64_t codes = 0, raw8 = 0;
    int escapes = 0, total = 0;
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        if (first + k < n) {
            const uint32_t v = eight[k], c = lookup[(v >> 7) & 0xFFu];
            codes |= (uint64_t)c << (8 * k);
            escapes += (c == 0);
            raw8 |= (uint64_t)((v & 0x7Fu) | ((v >> 8) & 0x80u)) << (8 * k);
        }
    }
    int slot = tile_index[blockIdx.x] + zc_block_exclusive_scan(escapes, &total);
    if (first >= n) return;
    if (first + ZC_VALUES_PER_THREAD <= n && ((uintptr_t)(raw + first) & 7) == 0) {
        *reinterpret_cast<uint64_t *>(raw + first) = raw8;  // little-endian: byte k is value k
    } else {
        for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k)
            raw[first + k] = (uint8_t)(raw8 >> (8 * k));
    }
    if (escapes) {
        for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k)
            if (((codes >> (8 * k)) & 7u) == 0) escapes_out[slot++] = (uint8_t)(eight[k] >> 7);
    }
    plane0[group] = zc_plane_byte(codes, 0);
    plane1[group] = zc_plane_byte(codes, 1);
    plane2[group] = zc_plane_byte(codes, 2);
}

__global__ void zc_decode_kernel(const uint8_t *raw, const uint8_t *plane0, const uint8_t *plane1,
                                 const uint8_t *plane2, const int32_t *tile_index,
                                 const uint8_t *escapes, const uint8_t *table8, int64_t n,
                                 uint16_t *values, int64_t *sums) {
    const int64_t group = (int64_t)blockIdx.x * ZC_THREADS + threadIdx.x;
    const int64_t first = group * ZC_VALUES_PER_THREAD;
    const bool whole = first + ZC_VALUES_PER_THREAD <= n;
    uint32_t b0 = 0, b1 = 0, b2 = 0;
    uint64_t raw8 = 0;
    if (first < n) {
        b0 = plane0[group];
        b1 = plane1[group];
        b2 = plane2[group];
        if (whole && ((uintptr_t)(raw + first) & 7) == 0) {
            raw8 = *reinterpret_cast<const uint64_t *>(raw + first);
        } else {
            for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k)
                raw8 |= (uint64_t)raw[first + k] << (8 * k);
        }
    }
    int escaped = 0, total = 0;
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const uint32_t c = ((b0 >> k) & 1u) | (((b1 >> k) & 1u) << 1) | (((b2 >> k) & 1u) << 2);
        escaped += (first + k < n) && c == 0;
    }
    int slot = tile_index[blockIdx.x] + zc_block_exclusive_scan(escaped, &total);
    const uint8_t *fields = table8 + zc_block_lookup(8);
    uint32_t checksum = 0;
    uint16_t eight[ZC_VALUES_PER_THREAD];
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const int64_t i = first + k;
        eight[k] = 0;
        if (i < n) {
            const uint32_t c = ((b0 >> k) & 1u) | (((b1 >> k) & 1u) << 1) | (((b2 >> k) & 1u) << 2);
            const uint32_t e = c ? fields[c] : escapes[slot++];
            const uint32_t sm = (uint32_t)(raw8 >> (8 * k)) & 0xFFu;
            const uint32_t bits = ((sm & 0x80u) << 8) | (e << 7) | (sm & 0x7Fu);
            eight[k] = (uint16_t)bits;
            checksum += zc_checksum_term(bits, i);
        }
    }
    if (whole && ((uintptr_t)(values + first) & 15) == 0) {
        uint4 word;
        word.x = (uint32_t)eight[0] | ((uint32_t)eight[1] << 16);
        word.y = (uint32_t)eight[2] | ((uint32_t)eight[3] << 16);
        word.z = (uint32_t)eight[4] | ((uint32_t)eight[5] << 16);
        word.w = (uint32_t)eight[6] | ((uint32_t)eight[7] << 16);
        *reinterpret_cast<uint4 *>(values + first) = word;
    } else {
        for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k) values[first + k] = eight[k];
    }
    checksum = zc_block_sum(checksum);
    if (threadIdx.x == 0) sums[blockIdx.x] = checksum;
}
