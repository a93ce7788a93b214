/*
 * ZipCCL codec on the CPU: whole chunks in one call each way.
 *
 * Produces exactly the bytes of ray_zep/collectives/reference.py (the format is
 * documented in ray_zep/collectives/format.py, the table rule in table.py).
 * zc_compress_* codes every chunk of a tensor: header, block tables, tile
 * index, planes, escapes and all padding; zc_decompress_* checks the headers,
 * decodes and verifies the checksums. Built on first use by
 * ray_zep/collectives/native.py and called through ctypes with raw pointers.
 *
 * A block (4096 values) is coded in passes over small arrays that stay in the
 * L1 cache, so that the compiler can vectorise the splitting, the code
 * lookup and the joining: split the values into exponent fields and raw sm
 * bytes, count the fields, pick the table, turn fields into codes, then write
 * the planes eight values (one byte of every plane) at a time. Eight 3-bit
 * codes travel as one uint64 with code k in byte k: a multiply gathers bit j
 * of every byte into plane byte j, and shifts spread a plane byte back.
 *
 * Integers in the header are written in the host's byte order: little-endian
 * hosts only (x86-64, arm64), checked at compile time.
 */
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ZipCCL format is little-endian; this kernel writes host-order integers"
#endif

#define ZC_VERSION 3
#define ZC_HEADER 32
#define ZC_TILE_VALUES 1024
#define ZC_BLOCK_VALUES 4096
#define ZC_TABLE 7
#define ZC_TABLE_BYTES 8
#define ZC_SECTION_ALIGN 16
#define ZC_CHUNK_ALIGN 128
#define LOW_BITS 0x0101010101010101ULL

/* Error codes of zc_decompress_* (native.py turns them into CodecErrors). */
enum { ZC_OK = 0, ZC_BAD_HEADER = 1, ZC_WRONG_COUNT = 2, ZC_TRUNCATED = 3, ZC_BAD_ESCAPES = 4,
       ZC_BAD_CHECKSUM = 5 };

/* Byte offsets of one chunk's sections (format.py's Layout). */
typedef struct {
    int64_t blocks, tables, tiles, tile_index, raw, plane_bytes, static_bytes;
    int64_t planes[6]; /* extra planes first, then the three code planes */
} zc_layout;

static int64_t align_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static zc_layout layout_of(int64_t n, int raw_bytes, int extra) {
    zc_layout l;
    l.blocks = (n + ZC_BLOCK_VALUES - 1) / ZC_BLOCK_VALUES;
    l.tiles = (n + ZC_TILE_VALUES - 1) / ZC_TILE_VALUES;
    l.plane_bytes = (n + 7) / 8;
    l.tables = ZC_HEADER;
    l.tile_index = align_up(l.tables + ZC_TABLE_BYTES * l.blocks, ZC_SECTION_ALIGN);
    l.raw = align_up(l.tile_index + 4 * l.tiles, ZC_SECTION_ALIGN);
    int64_t offset = align_up(l.raw + raw_bytes * n, ZC_SECTION_ALIGN);
    for (int p = 0; p < extra + 3; ++p) {
        l.planes[p] = offset;
        offset = align_up(offset + l.plane_bytes, ZC_SECTION_ALIGN);
    }
    l.static_bytes = align_up(offset, ZC_CHUNK_ALIGN);
    return l;
}

/* Zero the padding after each section (the encoder writes only the sections). */
static void zero_gaps(uint8_t *s, const zc_layout *l, int64_t n, int raw_bytes, int extra) {
    memset(s + 4, 0, 8);
    int64_t ends[9], starts[9]; /* tables, tile index, raw, up to six planes */
    int k = 0;
    ends[k] = l->tables + ZC_TABLE_BYTES * l->blocks, starts[k++] = l->tile_index;
    ends[k] = l->tile_index + 4 * l->tiles, starts[k++] = l->raw;
    ends[k] = l->raw + raw_bytes * n, starts[k++] = l->planes[0];
    for (int p = 0; p < extra + 3; ++p) {
        ends[k] = l->planes[p] + l->plane_bytes;
        starts[k++] = p + 1 < extra + 3 ? l->planes[p + 1] : l->static_bytes;
    }
    for (int i = 0; i < k; ++i) memset(s + ends[i], 0, (size_t)(starts[i] - ends[i]));
}

static void write_header(uint8_t *s, int code, uint32_t checksum, int64_t n, int64_t n_escapes) {
    s[0] = 'Z', s[1] = 'C', s[2] = ZC_VERSION, s[3] = (uint8_t)code;
    memcpy(s + 12, &checksum, 4);
    memcpy(s + 16, &n, 8);
    memcpy(s + 24, &n_escapes, 8);
}

/*
 * The block's table (table.py): the 7 most frequent of fields 0..fields-1 (Inf and NaN's
 * field is left out by the caller), by count, ties to the smaller.
 */
static void choose_table(const uint32_t *counts, int fields, uint8_t table[ZC_TABLE_BYTES]) {
    int found[256], m = 0;
    for (int e = 0; e < fields; ++e)
        if (counts[e]) found[m++] = e;
    int t = 0;
    for (; t < ZC_TABLE && t < m; ++t) {
        int best = t;
        for (int i = t + 1; i < m; ++i)
            if (counts[found[i]] > counts[found[best]]) best = i;
        const int chosen = found[best];
        memmove(found + t + 1, found + t, (size_t)(best - t) * sizeof(int));
        found[t] = chosen;
        table[t] = (uint8_t)chosen;
    }
    for (int e = 0; t < ZC_TABLE; ++e)
        if (!counts[e]) table[t++] = (uint8_t)e;
    table[ZC_TABLE] = 0;
}

static void count_fields(const uint8_t *ex, int count, int fields, uint32_t *counts) {
    uint32_t part[4][256];
    memset(part, 0, sizeof part);
    int k = 0;
    for (; k + 4 <= count; k += 4) {
        part[0][ex[k]]++, part[1][ex[k + 1]]++, part[2][ex[k + 2]]++, part[3][ex[k + 3]]++;
    }
    for (; k < count; ++k) part[0][ex[k]]++;
    for (int e = 0; e < fields; ++e) counts[e] = part[0][e] + part[1][e] + part[2][e] + part[3][e];
}

/* code = j + 1 where ex == table[j], else 0: compares rather than a lookup, so it vectorises. */
static void fields_to_codes(const uint8_t *ex, int count, const uint8_t *table, uint8_t *code) {
    const uint8_t t0 = table[0], t1 = table[1], t2 = table[2], t3 = table[3], t4 = table[4],
                  t5 = table[5], t6 = table[6];
    for (int k = 0; k < count; ++k) {
        const uint8_t e = ex[k];
        code[k] = (uint8_t)((e == t0) * 1 | (e == t1) * 2 | (e == t2) * 3 | (e == t3) * 4 |
                            (e == t4) * 5 | (e == t5) * 6 | (e == t6) * 7);
    }
}

/* The inverse (code 0 gives field 0, replaced by its escape afterwards); vectorises too. */
static void codes_to_fields(const uint8_t *code, int count, const uint8_t *table, uint8_t *ex) {
    const uint8_t t0 = table[0], t1 = table[1], t2 = table[2], t3 = table[3], t4 = table[4],
                  t5 = table[5], t6 = table[6];
    for (int k = 0; k < count; ++k) {
        const uint8_t c = code[k];
        ex[k] = (uint8_t)((-(c == 1) & t0) | (-(c == 2) & t1) | (-(c == 3) & t2) |
                          (-(c == 4) & t3) | (-(c == 5) & t4) | (-(c == 6) & t5) | (-(c == 7) & t6));
    }
}

static inline uint64_t load8(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

/*
 * Sixteen values at a time: bit x of 16 bytes to the two bytes of plane x at
 * `at`, and back. ZC_PORTABLE (or a compiler without SSE2) selects plain C
 * that writes the same bytes.
 */
#if defined(__SSE2__) && !defined(ZC_PORTABLE)
#include <emmintrin.h>

/* Writes the planes of bits 0..bits-1 of 16 bytes; returns the mask of zero bytes. */
static inline uint32_t to_planes16(const uint8_t *src, int bits, uint8_t *const *planes,
                                   int64_t at) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    for (int x = 0; x < bits; ++x) {
        const uint16_t m = (uint16_t)_mm_movemask_epi8(_mm_sll_epi16(b, _mm_cvtsi32_si128(7 - x)));
        memcpy(planes[x] + at, &m, 2);
    }
    return (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(b, _mm_setzero_si128()));
}

/* Reads 16 bytes from the planes of bits 0..bits-1; returns the mask of zero bytes. */
static inline uint32_t from_planes16(const uint8_t *const *planes, int bits, int64_t at,
                                     uint8_t *dst) {
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    __m128i acc = _mm_setzero_si128();
    for (int x = 0; x < bits; ++x) {
        const __m128i spread = _mm_set_epi64x((long long)(LOW_BITS * planes[x][at + 1]),
                                              (long long)(LOW_BITS * planes[x][at]));
        const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, select), select);
        acc = _mm_or_si128(acc, _mm_and_si128(set, _mm_set1_epi8((char)(1 << x))));
    }
    _mm_storeu_si128((__m128i *)dst, acc);
    return (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128()));
}

/* sum of v[k] and of k * v[k] (mod 2^32) over count values, count a multiple of 8. */
static inline void sums16(const uint16_t *v, int count, uint32_t *s0, uint32_t *s1) {
    const __m128i low = _mm_set1_epi16(0xFF), ones = _mm_set1_epi16(1), step = _mm_set1_epi16(8);
    __m128i k = _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7), sum_l = _mm_setzero_si128();
    __m128i sum_h = sum_l, dot_l = sum_l, dot_h = sum_l;
    for (int i = 0; i < count; i += 8) { /* bytes of v, so pmaddwd's signed products are exact */
        const __m128i x = _mm_loadu_si128((const __m128i *)(v + i));
        const __m128i xl = _mm_and_si128(x, low), xh = _mm_srli_epi16(x, 8);
        sum_l = _mm_add_epi32(sum_l, _mm_madd_epi16(xl, ones));
        sum_h = _mm_add_epi32(sum_h, _mm_madd_epi16(xh, ones));
        dot_l = _mm_add_epi32(dot_l, _mm_madd_epi16(xl, k));
        dot_h = _mm_add_epi32(dot_h, _mm_madd_epi16(xh, k));
        k = _mm_add_epi16(k, step);
    }
    uint32_t lanes[4][4];
    memcpy(lanes[0], &sum_l, 16), memcpy(lanes[1], &sum_h, 16);
    memcpy(lanes[2], &dot_l, 16), memcpy(lanes[3], &dot_h, 16);
    *s0 = *s1 = 0;
    for (int j = 0; j < 4; ++j) {
        *s0 += lanes[0][j] + 256u * lanes[1][j];
        *s1 += lanes[2][j] + 256u * lanes[3][j];
    }
}
#else
#define GATHER 0x0102040810204080ULL

static inline uint32_t to_planes16(const uint8_t *src, int bits, uint8_t *const *planes,
                                   int64_t at) {
    for (int half = 0; half < 2; ++half) {
        const uint64_t bytes = load8(src + 8 * half);
        for (int x = 0; x < bits; ++x)
            planes[x][at + half] = (uint8_t)((((bytes >> x) & LOW_BITS) * GATHER) >> 56);
    }
    uint32_t zeros = 0;
    for (int k = 0; k < 16; ++k) zeros |= (uint32_t)(src[k] == 0) << k;
    return zeros;
}

/* Bit k of `b` to the low bit of byte k. */
static inline uint64_t spread(uint64_t b) {
    b = (b | b << 28) & 0x0000000F0000000FULL;
    b = (b | b << 14) & 0x0003000300030003ULL;
    return (b | b << 7) & LOW_BITS;
}

static inline uint32_t from_planes16(const uint8_t *const *planes, int bits, int64_t at,
                                     uint8_t *dst) {
    for (int half = 0; half < 2; ++half) {
        uint64_t bytes = 0;
        for (int x = 0; x < bits; ++x) bytes |= spread(planes[x][at + half]) << x;
        memcpy(dst + 8 * half, &bytes, 8);
    }
    uint32_t zeros = 0;
    for (int k = 0; k < 16; ++k) zeros |= (uint32_t)(dst[k] == 0) << k;
    return zeros;
}

static inline void sums16(const uint16_t *v, int count, uint32_t *s0, uint32_t *s1) {
    *s0 = *s1 = 0;
    for (int k = 0; k < count; ++k) *s0 += v[k], *s1 += (uint32_t)k * v[k];
}
#endif

/* Pointers to one chunk's bit planes: extra planes first, then the three code planes. */
static void plane_pointers(uint8_t *s, const zc_layout *l, int extra, uint8_t *planes[6]) {
    for (int p = 0; p < extra + 3; ++p) planes[p] = s + l->planes[p];
}

/*
 * Planes and escapes of one block: `code` and `hi` (the sm bits above the raw
 * bytes) hold `count` values, padded with zeros to a multiple of 16; `first` is
 * the block's first value. Returns the escapes written so far.
 */
static int64_t encode_planes(const uint8_t *code, const uint8_t *hi, const uint8_t *ex, int count,
                             int64_t first, int extra, const zc_layout *l, uint8_t *s,
                             uint8_t *escapes, int64_t n_escapes) {
    uint8_t *planes[6];
    plane_pointers(s, l, extra, planes);
    for (int k = 0; k < count; k += 16) {
        const int64_t i = first + k;
        if (i % ZC_TILE_VALUES == 0) {
            const int32_t before = (int32_t)n_escapes;
            memcpy(s + l->tile_index + 4 * (i / ZC_TILE_VALUES), &before, 4);
        }
        if (extra) to_planes16(hi + k, extra, planes, i / 8);
        uint32_t zeros = to_planes16(code + k, 3, planes + extra, i / 8);
        if (count - k < 16) zeros &= (1u << (count - k)) - 1;
        for (; zeros; zeros &= zeros - 1) escapes[n_escapes++] = ex[k + __builtin_ctz(zeros)];
    }
    return n_escapes;
}

/*
 * Codes and exponent fields of one block from its planes and escapes (`code`,
 * `hi` and `ex` have room for `count` rounded up to 16); returns the escapes
 * used so far, or -1 when the codes do not match the escapes and the tile index.
 */
static int64_t decode_codes(const uint8_t *s, const zc_layout *l, int count, int64_t first,
                            int extra, const uint8_t *escapes, int64_t n_escapes, int64_t used,
                            uint8_t *code, uint8_t *hi, uint8_t *ex) {
    uint8_t *planes[6];
    uint32_t zeros[ZC_BLOCK_VALUES / 16];
    plane_pointers((uint8_t *)s, l, extra, planes);
    for (int k = 0; k < count; k += 16) {
        if (extra) from_planes16((const uint8_t *const *)planes, extra, (first + k) / 8, hi + k);
        zeros[k / 16] = from_planes16((const uint8_t *const *)planes + extra, 3, (first + k) / 8,
                                      code + k);
    }
    codes_to_fields(code, count, s + l->tables + ZC_TABLE_BYTES * (first / ZC_BLOCK_VALUES), ex);
    for (int k = 0; k < count; k += 16) {
        const int64_t i = first + k;
        if (i % ZC_TILE_VALUES == 0) {
            int32_t before;
            memcpy(&before, s + l->tile_index + 4 * (i / ZC_TILE_VALUES), 4);
            if (before != used) return -1;
        }
        uint32_t z = zeros[k / 16];
        if (count - k < 16) z &= (1u << (count - k)) - 1;
        for (; z; z &= z - 1) {
            if (used >= n_escapes) return -1;
            ex[k + __builtin_ctz(z)] = escapes[used++];
        }
    }
    return used;
}

/*
 * One instance per float format: UINT its bits, EXP_BITS / MAN_BITS its
 * fields, RAW_BYTES whole sm bytes per value, EXTRA sm bits in bit planes.
 */
#define ZC_DEFINE(NAME, UINT, CODE, EXP_BITS, MAN_BITS, RAW_BYTES, EXTRA)                          \
    static void split_##NAME(const UINT *v, int count, uint8_t *raw, uint8_t *ex, uint8_t *hi) {   \
        for (int k = 0; k < count; ++k) {                                                         \
            const uint32_t x = v[k];                                                              \
            const uint32_t sm = ((x >> (EXP_BITS + MAN_BITS)) << MAN_BITS) |                      \
                                (x & ((1u << MAN_BITS) - 1));                                     \
            ex[k] = (uint8_t)((x >> MAN_BITS) & ((1u << EXP_BITS) - 1));                          \
            for (int b = 0; b < RAW_BYTES; ++b) raw[k * RAW_BYTES + b] = (uint8_t)(sm >> (8 * b)); \
            if (EXTRA) hi[k] = (uint8_t)(sm >> (8 * RAW_BYTES));                                  \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static void join_##NAME(const uint8_t *raw, const uint8_t *ex, const uint8_t *hi, int count,  \
                            UINT *v) {                                                            \
        for (int k = 0; k < count; ++k) {                                                         \
            uint32_t sm = 0;                                                                      \
            for (int b = 0; b < RAW_BYTES; ++b) sm |= (uint32_t)raw[k * RAW_BYTES + b] << (8 * b); \
            if (EXTRA) sm |= (uint32_t)hi[k] << (8 * RAW_BYTES);                                  \
            v[k] = (UINT)(((sm >> MAN_BITS) << (EXP_BITS + MAN_BITS)) |                          \
                          ((uint32_t)ex[k] << MAN_BITS) | (sm & ((1u << MAN_BITS) - 1)));         \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* sum of v[k] * (2 (first + k) + 1), the 16-bit formats' bulk as (2 first + 1) s0 + 2 s1. */ \
    static uint32_t checksum_##NAME(const UINT *v, int count, int64_t first) {                    \
        const uint32_t weight = (uint32_t)(2 * first + 1);                                        \
        uint32_t sum = 0, s0, s1;                                                                 \
        int k = 0;                                                                                \
        if (sizeof(UINT) == 2) {                                                                  \
            k = count & ~7;                                                                       \
            sums16((const uint16_t *)v, k, &s0, &s1);                                             \
            sum = weight * s0 + 2u * s1;                                                          \
        }                                                                                         \
        for (; k < count; ++k) sum += (uint32_t)v[k] * (weight + 2u * (uint32_t)k);               \
        return sum;                                                                               \
    }                                                                                             \
                                                                                                  \
    /* Codes one chunk into `s` (its static part) and `escapes`; returns the escape count. */     \
    static int64_t encode_chunk_##NAME(const UINT *values, int64_t n, uint8_t *s,                 \
                                       uint8_t *escapes) {                                        \
        const zc_layout l = layout_of(n, RAW_BYTES, EXTRA);                                       \
        uint8_t ex[ZC_BLOCK_VALUES], code[ZC_BLOCK_VALUES], hi[ZC_BLOCK_VALUES];                  \
        uint32_t counts[1 << EXP_BITS], checksum = 0;                                             \
        int64_t n_escapes = 0;                                                                    \
        for (int64_t first = 0; first < n; first += ZC_BLOCK_VALUES) {                            \
            const int count = n - first < ZC_BLOCK_VALUES ? (int)(n - first) : ZC_BLOCK_VALUES;   \
            uint8_t *table = s + l.tables + ZC_TABLE_BYTES * (first / ZC_BLOCK_VALUES);           \
            split_##NAME(values + first, count, s + l.raw + RAW_BYTES * first, ex, hi);           \
            count_fields(ex, count, 1 << EXP_BITS, counts);                                       \
            choose_table(counts, (1 << EXP_BITS) - 1, table);                                           \
            fields_to_codes(ex, count, table, code);                                              \
            memset(code + count, 0, (size_t)((16 - count % 16) % 16));                             \
            memset(hi + count, 0, (size_t)((16 - count % 16) % 16));                               \
            n_escapes = encode_planes(code, hi, ex, count, first, EXTRA, &l, s, escapes,          \
                                      n_escapes);                                                 \
            checksum += checksum_##NAME(values + first, count, first);                            \
        }                                                                                         \
        write_header(s, CODE, checksum, n, n_escapes);                                            \
        zero_gaps(s, &l, n, RAW_BYTES, EXTRA);                                                    \
        return n_escapes;                                                                         \
    }                                                                                             \
                                                                                                  \
    static int decode_chunk_##NAME(const uint8_t *s, int64_t s_len, const uint8_t *escapes,       \
                                   int64_t d_len, int64_t n, UINT *values) {                      \
        const zc_layout l = layout_of(n, RAW_BYTES, EXTRA);                                       \
        uint8_t ex[ZC_BLOCK_VALUES], code[ZC_BLOCK_VALUES], hi[ZC_BLOCK_VALUES];                  \
        int64_t n_escapes, used = 0, stored_n;                                                    \
        uint32_t checksum = 0, stored;                                                            \
        if (s_len < ZC_HEADER || s[0] != 'Z' || s[1] != 'C' || s[2] != ZC_VERSION ||              \
            s[3] != CODE || load8(s + 4) != 0)                                                    \
            return ZC_BAD_HEADER;                                                                 \
        memcpy(&stored, s + 12, 4);                                                               \
        memcpy(&stored_n, s + 16, 8);                                                             \
        memcpy(&n_escapes, s + 24, 8);                                                            \
        if (stored_n != n) return ZC_WRONG_COUNT;                                                 \
        if (n_escapes < 0 || n_escapes > n) return ZC_BAD_HEADER;                                 \
        if (s_len < l.static_bytes || d_len < n_escapes) return ZC_TRUNCATED;                     \
        for (int64_t first = 0; first < n; first += ZC_BLOCK_VALUES) {                            \
            const int count = n - first < ZC_BLOCK_VALUES ? (int)(n - first) : ZC_BLOCK_VALUES;   \
            used = decode_codes(s, &l, count, first, EXTRA, escapes, n_escapes, used, code, hi,   \
                                ex);                                                              \
            if (used < 0) return ZC_BAD_ESCAPES;                                                  \
            join_##NAME(s + l.raw + RAW_BYTES * first, ex, hi, count, values + first);            \
            checksum += checksum_##NAME(values + first, count, first);                            \
        }                                                                                         \
        if (used != n_escapes) return ZC_BAD_ESCAPES;                                             \
        return checksum == stored ? ZC_OK : ZC_BAD_CHECKSUM;                                      \
    }                                                                                             \
                                                                                                  \
    /*                                                                                            \
     * Compress `n_chunks` chunks of consecutive values: static parts back to back into           \
     * `static_out` (sizes by layout_of), dynamic parts back to back into `dynamic_out` (room      \
     * for sum(align(chunk_values[i], 128)) bytes), their sizes into `dynamic_sizes`. Returns      \
     * the dynamic bytes written.                                                                 \
     */                                                                                           \
    int64_t zc_compress_##NAME(const UINT *values, const int64_t *chunk_values, int64_t n_chunks, \
                               uint8_t *static_out, uint8_t *dynamic_out,                         \
                               int64_t *dynamic_sizes) {                                          \
        int64_t done = 0, s_off = 0, d_off = 0;                                                   \
        for (int64_t c = 0; c < n_chunks; ++c) {                                                  \
            const int64_t n = chunk_values[c];                                                    \
            const int64_t ne = encode_chunk_##NAME(values + done, n, static_out + s_off,          \
                                                   dynamic_out + d_off);                          \
            dynamic_sizes[c] = align_up(ne, ZC_CHUNK_ALIGN);                                      \
            memset(dynamic_out + d_off + ne, 0, (size_t)(dynamic_sizes[c] - ne));                 \
            s_off += layout_of(n, RAW_BYTES, EXTRA).static_bytes;                                 \
            d_off += dynamic_sizes[c];                                                            \
            done += n;                                                                            \
        }                                                                                         \
        return d_off;                                                                             \
    }                                                                                             \
                                                                                                  \
    /*                                                                                            \
     * Decode `n_chunks` chunks (chunk c: `static_sizes[c]` bytes at `statics[c]`,                \
     * `dynamic_sizes[c]` at `dynamics[c]`, holding `chunk_values[c]` values) into `values`,      \
     * back to back. Returns ZC_OK, or an error code with the chunk's index in `*failed`.         \
     */                                                                                           \
    int zc_decompress_##NAME(const uint8_t *const *statics, const int64_t *static_sizes,          \
                             const uint8_t *const *dynamics, const int64_t *dynamic_sizes,        \
                             const int64_t *chunk_values, int64_t n_chunks, UINT *values,         \
                             int64_t *failed) {                                                   \
        int64_t done = 0;                                                                         \
        for (int64_t c = 0; c < n_chunks; ++c) {                                                  \
            const int status = decode_chunk_##NAME(statics[c], static_sizes[c], dynamics[c],      \
                                                   dynamic_sizes[c], chunk_values[c],             \
                                                   values + done);                                \
            if (status != ZC_OK) {                                                                \
                *failed = c;                                                                      \
                return status;                                                                    \
            }                                                                                     \
            done += chunk_values[c];                                                              \
        }                                                                                         \
        return ZC_OK;                                                                             \
    }

ZC_DEFINE(bf16, uint16_t, 1, 8, 7, 1, 0)
ZC_DEFINE(fp16, uint16_t, 2, 5, 10, 1, 3)
ZC_DEFINE(fp32, uint32_t, 3, 8, 23, 3, 0)
