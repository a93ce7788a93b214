"""Byte format of a ZipCCL chunk: float layouts, header, section sizes.

A tensor is compressed as one or more chunks (one per destination of a
collective). A chunk has a *static part*, whose size depends only on the
number of values and the dtype, and a *dynamic part*, whose size depends on
the data. Both are padded to 128 bytes, so chunks can be cut out of a
compressed buffer, sent and received without re-layout.

Every value is split into its exponent field and the rest (sign and mantissa,
"sm", kept raw). The exponent becomes a 3-bit code: codes 1..7 stand for the
seven exponents of the value's block table, code 0 ("escape") means the
exponent is stored in full in the dynamic part.

A chunk is cut into blocks of 4096 values (the last may be shorter), each
with its own table (`table.py` says how it is chosen; never the field of Inf
and NaN, which always escape): the tensors of a whole model mix very
different scales, and one table per chunk fits them badly.

Static part (all integers little-endian; sections start on 16-byte boundaries)::

    offset  size              field
    0       2                 magic b"ZC"
    2       1                 version (3)
    3       1                 float format code (1 bf16, 2 fp16, 3 fp32)
    4       8                 zero
    12      4   uint32        checksum of the values (`checksum` below)
    16      8   int64         n_values
    24      8   int64         n_escapes
    32      8 x K             block tables: exponent fields of codes 1..7, then a zero
                              byte, for each block (K = ceil(n / 4096))
    ...     4 x T  int32      tile index: escapes before tile t (T = ceil(n / 1024))
    ...     R x n             raw plane: the low 8R bits of each value's sm, value by value
    ...     E x ceil(n / 8)   extra planes: bit 8R + e of the sm (fp16's top 3 sm bits)
    ...     3 x ceil(n / 8)   code planes: bit j of each value's code
    ...                       zero padding to a multiple of 128 bytes

In a bit plane, value i sits at bit (i mod 8) of byte (i div 8); unused bits
of the last byte are zero. sm = sign << mantissa_bits | mantissa.

Dynamic part: n_escapes bytes, the full exponent field of every escaped value
in value order, then zero padding to a multiple of 128 bytes (so a chunk
without escapes has an empty dynamic part). The tile index lets a parallel
decoder find the first escape of any tile without scanning the ones before.

Sizes for BF16: 8 raw + 3 code bits per value, plus 8 bits per escape and
64 bits per block.

Checksum: the sum over the chunk's values of bits_i x (2i + 1), modulo 2^32,
where bits_i is value i's bit pattern read as an unsigned integer. The decoder
recomputes it over what it decoded, so a corrupted byte anywhere in the chunk
is an error, never a wrong value: a change of one value always changes the
sum (2i + 1 is odd, hence invertible modulo 2^32).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch

from ray_zep.errors import CodecError

MAGIC = b"ZC"
VERSION = 3
HEADER_BYTES = 32
CHUNK_ALIGN = 128
SECTION_ALIGN = 16
TILE_VALUES = 1024
BLOCK_VALUES = 4096
"""Values per block table: a multiple of `TILE_VALUES`."""
TABLE_BYTES = 8
CODE_PLANES = 3
TABLE_SIZE = 7
_HEADER = struct.Struct("<2sBB8sIqq")
_RESERVED = bytes(8)


@dataclass(frozen=True)
class FloatFormat:
    """Bit layout of a floating-point dtype as the codec sees it."""

    dtype: torch.dtype
    int_dtype: torch.dtype
    code: int
    exp_bits: int
    man_bits: int

    @property
    def sm_bits(self) -> int:
        return 1 + self.man_bits

    @property
    def raw_bytes(self) -> int:
        """Bytes of the raw plane per value (the low bits of sm)."""
        return self.sm_bits // 8

    @property
    def extra_planes(self) -> int:
        """Bit planes holding the sm bits that do not fill a whole byte."""
        return self.sm_bits - 8 * self.raw_bytes

    @property
    def exponents(self) -> int:
        """Distinct exponent fields, Inf and NaN's included."""
        return 1 << self.exp_bits

    @property
    def exp_max(self) -> int:
        """Exponent field of Inf and NaN."""
        return (1 << self.exp_bits) - 1

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def value_bytes(self) -> int:
        return (1 + self.exp_bits + self.man_bits) // 8


BF16 = FloatFormat(torch.bfloat16, torch.int16, 1, 8, 7)
FP16 = FloatFormat(torch.float16, torch.int16, 2, 5, 10)
FP32 = FloatFormat(torch.float32, torch.int32, 3, 8, 23)
FORMATS = {f.dtype: f for f in (BF16, FP16, FP32)}
_BY_CODE = {f.code: f for f in FORMATS.values()}


def float_format(dtype: torch.dtype) -> FloatFormat:
    """The codec's layout of `dtype`.

    Raises:
        CodecError: the dtype is not bfloat16, float16 or float32.
    """
    try:
        return FORMATS[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in FORMATS)
        raise CodecError(f"cannot compress dtype {dtype}; supported: {names}") from None


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the sections of one chunk's static part."""

    n_values: int
    fmt: FloatFormat
    blocks: int
    tables: int
    tiles: int
    tile_index: int
    raw: int
    extra: tuple[int, ...]
    codes: tuple[int, ...]
    plane_bytes: int
    static_bytes: int

    @classmethod
    @functools.lru_cache(maxsize=4096)
    def of(cls, n_values: int, fmt: FloatFormat) -> Layout:
        blocks = -(-n_values // BLOCK_VALUES)
        tiles = -(-n_values // TILE_VALUES)
        plane = -(-n_values // 8)
        tables = HEADER_BYTES
        offset = align(tables + TABLE_BYTES * blocks, SECTION_ALIGN)
        tile_index = offset
        offset = align(offset + 4 * tiles, SECTION_ALIGN)
        raw = offset
        offset = align(offset + fmt.raw_bytes * n_values, SECTION_ALIGN)
        planes = []
        for _ in range(fmt.extra_planes + CODE_PLANES):
            planes.append(offset)
            offset = align(offset + plane, SECTION_ALIGN)
        extra, codes = tuple(planes[: fmt.extra_planes]), tuple(planes[fmt.extra_planes :])
        return cls(
            n_values,
            fmt,
            blocks,
            tables,
            tiles,
            tile_index,
            raw,
            extra,
            codes,
            plane,
            align(offset, CHUNK_ALIGN),
        )


def static_bytes(n_values: int, dtype: torch.dtype) -> int:
    """Size of a chunk's static part: known before compressing."""
    return Layout.of(n_values, float_format(dtype)).static_bytes


def dynamic_bytes(n_escapes: int) -> int:
    """Size of a chunk's dynamic part."""
    return align(n_escapes, CHUNK_ALIGN)


@dataclass(frozen=True)
class Header:
    fmt: FloatFormat
    n_values: int
    n_escapes: int
    checksum: int
    """Of the values (see the module docstring)."""

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            VERSION,
            self.fmt.code,
            _RESERVED,
            self.checksum,
            self.n_values,
            self.n_escapes,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        """Parse the first 32 bytes of a static part.

        Raises:
            CodecError: not a ZipCCL chunk of a version this build reads.
        """
        if len(data) < HEADER_BYTES:
            raise CodecError(f"chunk of {len(data)} bytes is shorter than its header")
        fields = _HEADER.unpack(data[:HEADER_BYTES])
        magic, version, code, reserved, checksum, n_values, n_escapes = fields
        if magic != MAGIC or version != VERSION or code not in _BY_CODE or reserved != _RESERVED:
            raise CodecError(
                f"not a ZipCCL v{VERSION} chunk (magic {magic!r}, version {version}, format {code})"
            )
        if n_values < 0 or not 0 <= n_escapes <= n_values:
            raise CodecError(f"corrupt chunk header: {n_values} values, {n_escapes} escapes")
        return cls(_BY_CODE[code], n_values, n_escapes, checksum)

    @property
    def layout(self) -> Layout:
        return Layout.of(self.n_values, self.fmt)

    @property
    def dynamic_bytes(self) -> int:
        return dynamic_bytes(self.n_escapes)
