// ZipCCL codec kernels for bfloat16 on NVIDIA GPUs.
//
// Byte-for-byte the format of ray_zep/collectives/format.py (and the output of
// the torch reference and the C kernel). One thread block codes one tile of
// 1024 values: 128 threads, eight consecutive values per thread, so each
// thread owns one byte of every bit plane and eight bytes of the raw plane,
// and a warp's stores to a plane are 32 consecutive bytes. Each block of
// ZC_BLOCK_VALUES values (a whole number of tiles) has its own code table.
//
// Compressing is two launches and the host never waits:
//  1. zc_tables_kernel, one thread block per block of values, one warp per tile:
//     counts the block's exponent fields (a histogram per warp in shared memory),
//     picks its table (the seven most frequent fields, ties to the smaller field:
//     ray_zep/collectives/table.py), writes the field -> code lookup and the table
//     bytes, publishes each tile's escape count in `status` (an aggregate) and the
//     block's share of the checksum in `sums`. Block 0 also writes the header
//     (escape count and checksum zero until launch 2) and the zero padding between
//     sections, so the static part needs no fill before.
//  2. zc_encode_kernel, one thread block per tile: writes its planes, finds the
//     escapes before its tile by looking back over `status` (every entry is already
//     published, an aggregate by launch 1 or an inclusive prefix by a tile of this
//     launch that got its own, so no tile ever waits for another), publishes its
//     inclusive prefix, writes its tile index entry and its escapes at the tile index +
//     the exclusive scan of the escape counts of the threads before it. The first
//     tile of each block adds the block's checksum share into the header (modulo
//     2^32, so the order of the adds does not matter); the last tile writes the
//     escape count into the header and zeroes the dynamic part's padding.
// The dynamic part is written into room for its largest size (zc_room_bytes); its
// length is in the header, which the caller reads when it needs it.
//
// Decompressing is two launches: zc_decode_kernel (one thread block per tile)
// reads its block's table and its tile index entry from the static part,
// recomputes the scan from the codes, checks that its escapes end where the next
// tile's begin (the last tile: at the header's escape count), never reads past the
// dynamic part, and writes its share of the checksum with a flag for a bad tile;
// zc_check_kernel (one thread block) adds the shares, checks the header and writes
// one status word (ZC_OK or the first error, the codes of cuda/zipccl_cpu.c) for the
// host to read when it needs the verdict.
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
#define ZC_HEADER 32
#define ZC_VERSION 3
#define ZC_FORMAT_BF16 1
#define ZC_CHECKSUM_AT 12
#define ZC_ESCAPES_AT 24
#define ZC_SECTION_ALIGN 16
#define ZC_CHUNK_ALIGN 128
// A tile's entry of `status`: a flag in the high half, a count of escapes in the low.
#define ZC_AGGREGATE (1ULL << 32)  // the tile's own escapes
#define ZC_PREFIX (2ULL << 32)     // the escapes of the tile and of every tile before it
#define ZC_FLAGS 0xFFFFFFFF00000000ULL

enum { ZC_OK = 0, ZC_BAD_HEADER = 1, ZC_WRONG_COUNT = 2, ZC_TRUNCATED = 3, ZC_BAD_ESCAPES = 4,
       ZC_BAD_CHECKSUM = 5 };

static_assert(ZC_THREADS % 32 == 0, "a tile must fill whole warps");
static_assert(ZC_BLOCK_VALUES % ZC_TILE_VALUES == 0, "a block must be whole tiles");
static_assert(ZC_BLOCK_VALUES / ZC_TILE_VALUES == ZC_WARPS, "zc_tables_kernel: a warp per tile");
static_assert(ZC_FIELDS % ZC_THREADS == 0, "zc_tables_kernel: whole lookups per thread");
static_assert(ZC_THREADS >= ZC_HEADER, "one thread per header byte");

__host__ __device__ inline int64_t zc_align(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Byte offsets of a chunk's static part (format.py's Layout for BF16).
struct ZcLayout {
    int64_t n, blocks, tiles, plane_bytes, tile_index, raw, codes[3], static_bytes;
};

__host__ __device__ inline ZcLayout zc_layout(int64_t n) {
    ZcLayout l;
    l.n = n;
    l.blocks = (n + ZC_BLOCK_VALUES - 1) / ZC_BLOCK_VALUES;
    l.tiles = (n + ZC_TILE_VALUES - 1) / ZC_TILE_VALUES;
    l.plane_bytes = (n + 7) / 8;
    l.tile_index = zc_align(ZC_HEADER + ZC_TABLE_BYTES * l.blocks, ZC_SECTION_ALIGN);
    l.raw = zc_align(l.tile_index + 4 * l.tiles, ZC_SECTION_ALIGN);
    int64_t offset = zc_align(l.raw + n, ZC_SECTION_ALIGN);  // one raw byte per value
    for (int j = 0; j < 3; ++j) {
        l.codes[j] = offset;
        offset = zc_align(offset + l.plane_bytes, ZC_SECTION_ALIGN);
    }
    l.static_bytes = zc_align(offset, ZC_CHUNK_ALIGN);
    return l;
}

// Room for the dynamic part of n values: every value escaped, padded.
__host__ __device__ inline int64_t zc_room_bytes(int64_t n) { return zc_align(n, ZC_CHUNK_ALIGN); }

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


// Little-endian unsigned integer of `bytes` bytes at `p` (any alignment).
__device__ __forceinline__ uint64_t zc_read_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int k = 0; k < bytes; ++k) v |= (uint64_t)p[k] << (8 * k);
    return v;
}

__device__ __forceinline__ void zc_zero(uint8_t *base, int64_t from, int64_t to) {
    for (int64_t i = from + threadIdx.x; i < to; i += ZC_THREADS) base[i] = 0;
}

// Byte i of the header of n values, its escape count and checksum zero (launch 2 fills them).
__device__ __forceinline__ uint8_t zc_header_byte(int i, int64_t n) {
    if (i < 4) return i == 0 ? 'Z' : i == 1 ? 'C' : i == 2 ? ZC_VERSION : ZC_FORMAT_BF16;
    if (i >= 16 && i < 24) return (uint8_t)((uint64_t)n >> (8 * (i - 16)));
    return 0;
}

// The header and every padding byte of the static part: the bytes no tile writes.
__device__ inline void zc_write_frame(uint8_t *chunk, const ZcLayout &l) {
    if (threadIdx.x < ZC_HEADER) chunk[threadIdx.x] = zc_header_byte((int)threadIdx.x, l.n);
    zc_zero(chunk, ZC_HEADER + ZC_TABLE_BYTES * l.blocks, l.tile_index);
    zc_zero(chunk, l.tile_index + 4 * l.tiles, l.raw);
    zc_zero(chunk, l.raw + l.n, l.codes[0]);
    zc_zero(chunk, l.codes[0] + l.plane_bytes, l.codes[1]);
    zc_zero(chunk, l.codes[1] + l.plane_bytes, l.codes[2]);
    zc_zero(chunk, l.codes[2] + l.plane_bytes, l.static_bytes);
}

// Tile t's entry of `status`, read past the (incoherent) L1 cache: another block writes it.
__device__ __forceinline__ unsigned long long zc_read_status(const unsigned long long *status,
                                                             int64_t t) {
    return *reinterpret_cast<const volatile unsigned long long *>(status + t);
}

// Largest `value` of the block's threads, in every thread.
__device__ __forceinline__ int zc_block_max(int value) {
    __shared__ int warp_best[ZC_WARPS];
    value = zc_warp_max(value);
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = value;
    __syncthreads();
    int best = warp_best[0];
    for (int w = 1; w < ZC_WARPS; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    __syncthreads();  // warp_best may be reused by a later max
    return best;
}

#define ZC_LOOK_BACK (2 * ZC_THREADS)  // entries of `status` a block reads per round

// Escapes before `tile`, in every thread: the block reads the ZC_LOOK_BACK entries before
// the ones it has read, adding aggregates until the nearest inclusive prefix. Every entry
// is published before this launch starts, so the loop never waits; a prefix only ends it
// sooner. A round covers more tiles than start while it lasts, so a tile usually finds
// the prefix of one that started before it in its first round.
__device__ __forceinline__ int64_t zc_look_back(const unsigned long long *status, int64_t tile) {
    int64_t prefix = 0;
    for (int64_t end = tile; end > 0; end -= ZC_LOOK_BACK) {
        unsigned long long s[2];
        int known = -1;  // ZC_LOOK_BACK - 1 - this thread's nearest entry with a prefix
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int back = k * ZC_THREADS + (int)threadIdx.x;  // 0: tile end - 1
            const int64_t t = end - 1 - back;
            s[k] = t >= 0 ? zc_read_status(status, t) : ZC_PREFIX;  // before tile 0: none
            const int mine = ZC_LOOK_BACK - 1 - back;
            if ((s[k] & ZC_FLAGS) == ZC_PREFIX && mine > known) known = mine;
        }
        const int nearest = ZC_LOOK_BACK - 1 - zc_block_max(known);  // ZC_LOOK_BACK: none
        uint32_t sum = 0;
#pragma unroll
        for (int k = 0; k < 2; ++k)
            if (k * ZC_THREADS + (int)threadIdx.x <= nearest) sum += (uint32_t)s[k];
        prefix += zc_block_sum(sum);
        if (nearest < ZC_LOOK_BACK) break;
    }
    return prefix;
}

// One thread block per block of ZC_BLOCK_VALUES values, warp w reading tile w of it:
// the block's table (in the static part `chunk`) and its field -> code lookup
// (`code_of`, 256 entries), the escapes of each of its tiles (`status`, aggregates)
// and its share of the checksum (`sums`). Block 0 writes the header and the padding;
// with no values it is the only block.
__global__ void zc_tables_kernel(const uint16_t *values, ZcLayout l, uint8_t *chunk,
                                 uint8_t *code_of, unsigned long long *status, int64_t *sums) {
    __shared__ int histogram[ZC_FIELDS];
    __shared__ int per_warp[ZC_WARPS][ZC_FIELDS];  // each warp counts its own tile
    if (blockIdx.x == 0) zc_write_frame(chunk, l);
    if (l.n == 0) return;
    const int64_t n = l.n;
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
        chunk[ZC_HEADER + (int64_t)blockIdx.x * ZC_TABLE_BYTES + threadIdx.x] =
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
    if (lane == 0 && tile < l.tiles) status[tile] = ZC_AGGREGATE | escaped;
    checksum = zc_block_sum(checksum);
    if (threadIdx.x == 0) sums[blockIdx.x] = checksum;
}

// One thread block per tile, after zc_tables_kernel on the same `status` and `sums`.
__global__ void zc_encode_kernel(const uint16_t *values, ZcLayout l, const uint8_t *code_of,
                                 const int64_t *sums, unsigned long long *status, uint8_t *chunk,
                                 uint8_t *escapes_out) {
    __shared__ uint8_t lookup[ZC_FIELDS];  // this block's field -> code
    const int64_t n = l.n, tile = blockIdx.x;
    const uint8_t *block_codes = code_of + zc_block_lookup(ZC_FIELDS);
    for (int f = threadIdx.x; f < ZC_FIELDS; f += ZC_THREADS) lookup[f] = block_codes[f];
    __syncthreads();
    const int64_t group = tile * ZC_THREADS + threadIdx.x;
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
    if (first < n) {  // the planes first: their stores need no prefix
        uint8_t *raw = chunk + l.raw;
        if (first + ZC_VALUES_PER_THREAD <= n && ((uintptr_t)(raw + first) & 7) == 0) {
            *reinterpret_cast<uint64_t *>(raw + first) = raw8;  // little-endian: byte k is value k
        } else {
            for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k)
                raw[first + k] = (uint8_t)(raw8 >> (8 * k));
        }
#pragma unroll
        for (int j = 0; j < 3; ++j) chunk[l.codes[j] + group] = zc_plane_byte(codes, j);
    }
    const int before = zc_block_exclusive_scan(escapes, &total);
    const int64_t prefix = zc_look_back(status, tile), through = prefix + total;
    if (threadIdx.x == 0) {
        *reinterpret_cast<volatile unsigned long long *>(status + tile) =
            ZC_PREFIX | (unsigned long long)through;
        *reinterpret_cast<int32_t *>(chunk + l.tile_index + 4 * tile) = (int32_t)prefix;
        if (tile % ZC_TILES_PER_BLOCK == 0)  // header bytes 12..15, zeroed by launch 1
            atomicAdd(reinterpret_cast<unsigned int *>(chunk + ZC_CHECKSUM_AT),
                      (unsigned int)sums[tile / ZC_TILES_PER_BLOCK]);
        if (tile == l.tiles - 1) *reinterpret_cast<int64_t *>(chunk + ZC_ESCAPES_AT) = through;
    }
    if (tile == l.tiles - 1) zc_zero(escapes_out, through, zc_align(through, ZC_CHUNK_ALIGN));
    if (escapes) {
        int64_t slot = prefix + before;
        for (int k = 0; k < ZC_VALUES_PER_THREAD && first + k < n; ++k)
            if (((codes >> (8 * k)) & 7u) == 0) escapes_out[slot++] = (uint8_t)(eight[k] >> 7);
    }
}

// One thread block per tile: its values into `values`, and into `shares[tile]` its share
// of their checksum with bit 32 set where its escapes do not fit the tile index, the
// header's escape count or the `escape_room` bytes of the dynamic part.
__global__ void zc_decode_kernel(const uint8_t *chunk, ZcLayout l, const uint8_t *escapes,
                                 int64_t escape_room, uint16_t *values,
                                 unsigned long long *shares) {
    __shared__ uint8_t fields[ZC_TABLE_BYTES];  // code -> field; code 0 is an escape
    const int64_t n = l.n, tile = blockIdx.x;
    const uint8_t *table = chunk + ZC_HEADER + zc_block_lookup(ZC_TABLE_BYTES);
    if (threadIdx.x < ZC_TABLE_BYTES) fields[threadIdx.x] = threadIdx.x ? table[threadIdx.x - 1] : 0;
    const uint8_t *index = chunk + l.tile_index + 4 * tile;
    const int64_t start = (int32_t)zc_read_le(index, 4);
    const int64_t end = tile + 1 < l.tiles ? (int64_t)(int32_t)zc_read_le(index + 4, 4)
                                           : (int64_t)zc_read_le(chunk + ZC_ESCAPES_AT, 8);
    __syncthreads();
    const int64_t group = tile * ZC_THREADS + threadIdx.x;
    const int64_t first = group * ZC_VALUES_PER_THREAD;
    const bool whole = first + ZC_VALUES_PER_THREAD <= n;
    const uint8_t *raw = chunk + l.raw;
    uint32_t b0 = 0, b1 = 0, b2 = 0;
    uint64_t raw8 = 0;
    if (first < n) {
        b0 = chunk[l.codes[0] + group];
        b1 = chunk[l.codes[1] + group];
        b2 = chunk[l.codes[2] + group];
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
    int64_t slot = start + zc_block_exclusive_scan(escaped, &total);
    uint32_t checksum = 0, outside = 0;
    uint16_t eight[ZC_VALUES_PER_THREAD];
#pragma unroll
    for (int k = 0; k < ZC_VALUES_PER_THREAD; ++k) {
        const int64_t i = first + k;
        eight[k] = 0;
        if (i < n) {
            const uint32_t c = ((b0 >> k) & 1u) | (((b1 >> k) & 1u) << 1) | (((b2 >> k) & 1u) << 2);
            uint32_t e = fields[c];
            if (c == 0) {
                const bool inside = slot >= 0 && slot < escape_room;
                outside += !inside;
                e = inside ? escapes[slot] : 0u;
                ++slot;
            }
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
    outside = zc_block_sum(outside);
    const bool bad = outside != 0 || start + total != end || (tile == 0 && start != 0);
    if (threadIdx.x == 0) shares[tile] = ((unsigned long long)bad << 32) | checksum;
}

// The verdict on a chunk of `n` values whose tiles' shares add up to `checksum`, `bad`
// of them flagged: the header first, then the escapes, then the checksum.
__device__ __forceinline__ int64_t zc_verdict(const uint8_t *chunk, int64_t n, int64_t escape_room,
                                              uint32_t bad, uint32_t checksum) {
    bool header = chunk[0] == 'Z' && chunk[1] == 'C' && chunk[2] == ZC_VERSION &&
                  chunk[3] == ZC_FORMAT_BF16 && zc_read_le(chunk + 4, 8) == 0;
    const int64_t values = (int64_t)zc_read_le(chunk + 16, 8);
    const int64_t escapes = (int64_t)zc_read_le(chunk + ZC_ESCAPES_AT, 8);
    if (!header || values < 0 || escapes < 0 || escapes > values) return ZC_BAD_HEADER;
    if (values != n) return ZC_WRONG_COUNT;
    if (escapes > escape_room) return ZC_TRUNCATED;
    if (bad) return ZC_BAD_ESCAPES;
    if (checksum != (uint32_t)zc_read_le(chunk + ZC_CHECKSUM_AT, 4)) return ZC_BAD_CHECKSUM;
    return ZC_OK;
}

// One thread block, after zc_decode_kernel: the chunk's verdict into `*status`.
__global__ void zc_check_kernel(const uint8_t *chunk, int64_t n, int64_t escape_room,
                                const unsigned long long *shares, int64_t tiles, int64_t *status) {
    uint32_t checksum = 0, bad = 0;
    for (int64_t t = threadIdx.x; t < tiles; t += ZC_THREADS) {
        const unsigned long long share = shares[t];
        checksum += (uint32_t)share;
        bad += (share >> 32) != 0;
    }
    checksum = zc_block_sum(checksum);
    bad = zc_block_sum(bad);
    if (threadIdx.x == 0) *status = zc_verdict(chunk, n, escape_room, bad, checksum);
}
