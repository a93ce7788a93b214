/*
 * ZipCCL codec on the CPU: one pass over a chunk, eight values (one byte of
 * every bit plane) at a time.
 *
 * Produces exactly the bytes of ray_zep/collectives/reference.py (the format is
 * documented in ray_zep/collectives/format.py). The Python side allocates the
 * buffers, writes the 32-byte header and zeroes the padding between sections;
 * these functions fill the tile index, the raw plane, the bit planes and the
 * escape list. Built on first use by ray_zep/collectives/native.py and called
 * through ctypes with raw pointers.
 *
 * `escapes` must hold n_escapes + 1 bytes: the decoder reads one past the last
 * escape instead of branching (table8[0] is 0, so an unescaped value ignores it).
 *
 * Eight 3-bit codes travel as one uint64 with code k in byte k: a multiply
 * gathers bit j of every byte into plane byte j, and a 256-entry table spreads
 * a plane byte back over eight bytes.
 */
#include <stdint.h>

#define TILE_VALUES 1024
#define LOW_BITS 0x0101010101010101ULL
#define GATHER 0x0102040810204080ULL

/* Section pointers of one chunk's static part. */
typedef struct {
    int32_t *tile_index;
    uint8_t *raw;
    uint8_t *planes[6]; /* extra planes first, then the three code planes */
} zc_sections;

static uint64_t spread[256];
static int spread_ready = 0;

static void init_spread(void) {
    if (spread_ready) return;
    for (int b = 0; b < 256; ++b) {
        uint64_t s = 0;
        for (int k = 0; k < 8; ++k) s |= (uint64_t)((b >> k) & 1) << (8 * k);
        spread[b] = s;
    }
    spread_ready = 1;
}

static inline uint8_t gather_plane(uint64_t bytes, int bit) {
    return (uint8_t)((((bytes >> bit) & LOW_BITS) * GATHER) >> 56);
}

static inline int has_zero_byte(uint64_t v) {
    return ((v - LOW_BITS) & ~v & (LOW_BITS << 7)) != 0;
}

#define ZC_DEFINE(NAME, UINT, EXP_BITS, MAN_BITS, RAW_BYTES, EXTRA)                         \
    static inline void encode_group_##NAME(const UINT *values, int count, int64_t group,   \
                                           const uint8_t *code_of, zc_sections *out,       \
                                           uint8_t *escapes, int64_t *n_escapes) {         \
        const uint32_t exp_max = (1u << EXP_BITS) - 1, man_mask = (1u << MAN_BITS) - 1;    \
        uint64_t codes = 0, extra = 0;                                                      \
        int64_t ne = *n_escapes;                                                            \
        uint8_t *raw = out->raw + group * 8 * RAW_BYTES;                                    \
        for (int k = 0; k < count; ++k) {                                                   \
            const uint32_t v = values[k];                                                   \
            const uint32_t e = (v >> MAN_BITS) & exp_max;                                   \
            const uint32_t sm = ((v >> (EXP_BITS + MAN_BITS)) << MAN_BITS) | (v & man_mask); \
            const uint32_t c = code_of[e];                                                  \
            for (int b = 0; b < RAW_BYTES; ++b) raw[k * RAW_BYTES + b] = (uint8_t)(sm >> (8 * b)); \
            if (EXTRA) extra |= (uint64_t)(sm >> (8 * RAW_BYTES)) << (8 * k);               \
            codes |= (uint64_t)c << (8 * k);                                                \
            escapes[ne] = (uint8_t)e;                                                       \
            ne += (c == 0);                                                                 \
        }                                                                                   \
        for (int x = 0; x < EXTRA; ++x) out->planes[x][group] = gather_plane(extra, x);     \
        for (int j = 0; j < 3; ++j) out->planes[EXTRA + j][group] = gather_plane(codes, j); \
        *n_escapes = ne;                                                                    \
    }                                                                                       \
                                                                                            \
    int64_t zc_encode_##NAME(const UINT *values, int64_t n, const uint8_t *code_of,         \
                             zc_sections *out, uint8_t *escapes) {                           \
        int64_t n_escapes = 0, group = 0;                                                   \
        for (; group * 8 + 8 <= n; ++group) {                                               \
            if ((group * 8) % TILE_VALUES == 0)                                             \
                out->tile_index[group * 8 / TILE_VALUES] = (int32_t)n_escapes;              \
            encode_group_##NAME(values + group * 8, 8, group, code_of, out, escapes, &n_escapes); \
        }                                                                                   \
        if (group * 8 < n) {                                                                \
            if ((group * 8) % TILE_VALUES == 0)                                             \
                out->tile_index[group * 8 / TILE_VALUES] = (int32_t)n_escapes;              \
            encode_group_##NAME(values + group * 8, (int)(n - group * 8), group, code_of, out, \
                                escapes, &n_escapes);                                       \
        }                                                                                   \
        return n_escapes;                                                                   \
    }                                                                                       \
                                                                                            \
    static inline void decode_group_##NAME(const zc_sections *in, int count, int64_t group, \
                                           const uint8_t *escapes, int64_t n_escapes,       \
                                           const uint8_t *table8, int64_t *used, UINT *out) { \
        const uint32_t man_mask = (1u << MAN_BITS) - 1;                                     \
        const uint8_t *raw = in->raw + group * 8 * RAW_BYTES;                               \
        uint64_t codes = 0, extra = 0;                                                      \
        int64_t u = *used;                                                                  \
        for (int x = 0; x < EXTRA; ++x) extra |= spread[in->planes[x][group]] << x;         \
        for (int j = 0; j < 3; ++j) codes |= spread[in->planes[EXTRA + j][group]] << j;     \
        const int escaped = has_zero_byte(codes) || count < 8;                              \
        for (int k = 0; k < count; ++k) {                                                   \
            uint32_t sm = 0;                                                                \
            for (int b = 0; b < RAW_BYTES; ++b) sm |= (uint32_t)raw[k * RAW_BYTES + b] << (8 * b); \
            if (EXTRA) sm |= (uint32_t)((extra >> (8 * k)) & 0xFF) << (8 * RAW_BYTES);      \
            out[k] = (UINT)(((sm >> MAN_BITS) << (EXP_BITS + MAN_BITS)) |                   \
                            (table8[(codes >> (8 * k)) & 7u] << MAN_BITS) | (sm & man_mask)); \
        }                                                                                   \
        if (escaped) {                                                                      \
            for (int k = 0; k < count; ++k) {                                               \
                if (((codes >> (8 * k)) & 7u) == 0) {                                       \
                    const uint32_t e = escapes[u < n_escapes ? u : n_escapes];              \
                    u += 1;                                                                 \
                    out[k] = (UINT)(out[k] | (e << MAN_BITS));                              \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        *used = u;                                                                          \
    }                                                                                       \
                                                                                            \
    int zc_decode_##NAME(const zc_sections *in, const uint8_t *escapes, int64_t n_escapes,  \
                         const uint8_t *table8, int64_t n, UINT *values) {                   \
        int64_t used = 0;                                                                   \
        init_spread();                                                                      \
        for (int64_t group = 0; group * 8 < n; ++group) {                                   \
            const int count = n - group * 8 < 8 ? (int)(n - group * 8) : 8;                 \
            if ((group * 8) % TILE_VALUES == 0 &&                                           \
                in->tile_index[group * 8 / TILE_VALUES] != used)                            \
                return -1;                                                                  \
            if (count == 8)                                                                 \
                decode_group_##NAME(in, 8, group, escapes, n_escapes, table8, &used,        \
                                    values + group * 8);                                    \
            else                                                                            \
                decode_group_##NAME(in, count, group, escapes, n_escapes, table8, &used,    \
                                    values + group * 8);                                    \
        }                                                                                   \
        return used == n_escapes ? 0 : -1;                                                  \
    }

ZC_DEFINE(bf16, uint16_t, 8, 7, 1, 0)
ZC_DEFINE(fp16, uint16_t, 5, 10, 1, 3)
ZC_DEFINE(fp32, uint32_t, 8, 23, 3, 0)

/* Checksum of a chunk's values (format.py): sum of bits_i * (2i + 1) modulo 2^32. */
uint32_t zc_checksum_u16(const uint16_t *values, int64_t n) {
    uint32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += (uint32_t)values[i] * (uint32_t)(2 * i + 1);
    return sum;
}

uint32_t zc_checksum_u32(const uint32_t *values, int64_t n) {
    uint32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += values[i] * (uint32_t)(2 * i + 1);
    return sum;
}
