"""The codec in vectorised torch: the reference every other backend must match byte for byte.

Runs wherever torch runs (CPU or GPU). Codes one chunk at a time
(`encode_chunks` / `decode_chunks` take all of a tensor's chunks, as the
native backend does); `codec.py` picks the backend. The byte format is in
`format.py`, the choice of each block's table in `table.py`.

Legend: N values of the chunk, P = ceil(N / 8) bytes of a bit plane, T tiles,
K blocks (each with its own table), E exponent fields.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ray_zep.collectives.format import (
    BLOCK_VALUES,
    HEADER_BYTES,
    TABLE_BYTES,
    TABLE_SIZE,
    TILE_VALUES,
    FloatFormat,
    Header,
    Layout,
    dynamic_bytes,
)
from ray_zep.collectives.table import block_tables
from ray_zep.errors import CodecError

CHECKSUM_MASK = (1 << 32) - 1
"""Checksums are sums modulo 2^32 (`format.py`)."""


def split_fields(flat_N: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent field, sm = sign << man_bits | mantissa) of each value, as int64."""
    bits_N = flat_N.view(fmt.int_dtype).to(torch.int64) & ((1 << (8 * fmt.value_bytes)) - 1)
    exp_N = (bits_N >> fmt.man_bits) & fmt.exp_max
    sign_N = bits_N >> (fmt.exp_bits + fmt.man_bits)
    sm_N = (sign_N << fmt.man_bits) | (bits_N & ((1 << fmt.man_bits) - 1))
    return exp_N, sm_N


def join_fields(exp_N: torch.Tensor, sm_N: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Inverse of `split_fields`: values of `fmt.dtype`."""
    sign_N = sm_N >> fmt.man_bits
    bits_N = (sign_N << (fmt.exp_bits + fmt.man_bits)) | (exp_N << fmt.man_bits)
    bits_N |= sm_N & ((1 << fmt.man_bits) - 1)
    width = 8 * fmt.value_bytes
    bits_N = torch.where(bits_N >= (1 << (width - 1)), bits_N - (1 << width), bits_N)
    return bits_N.to(fmt.int_dtype).view(fmt.dtype)


def pack_bits(bit_N: torch.Tensor) -> torch.Tensor:
    """0/1 values -> bytes, value i at bit (i mod 8) of byte (i div 8)."""
    n = bit_N.numel()
    padded = bit_N.new_zeros(-(-n // 8) * 8)
    padded[:n] = bit_N
    weights = 1 << torch.arange(8, device=bit_N.device, dtype=torch.int64)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_bits(plane_P: torch.Tensor, n: int) -> torch.Tensor:
    """Bytes -> n values 0/1 (int64), the inverse of `pack_bits`."""
    shifts = torch.arange(8, device=plane_P.device, dtype=torch.int64)
    return ((plane_P.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:n]


def code_lookup(tables_K7: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """(K, E) int64: exponent field -> code in each block (0 for fields outside its table)."""
    blocks = tables_K7.shape[0]
    lookup_KE = tables_K7.new_zeros((blocks, fmt.exponents))
    codes = torch.arange(1, TABLE_SIZE + 1, device=tables_K7.device).expand(blocks, -1)
    return lookup_KE.scatter_(1, tables_K7, codes)


def table_bytes(tables_K7: torch.Tensor) -> torch.Tensor:
    """The block tables section: each table's seven fields, then a zero byte (uint8, 8K)."""
    rows_K8 = tables_K7.new_zeros((tables_K7.shape[0], TABLE_BYTES))
    rows_K8[:, :TABLE_SIZE] = tables_K7
    return rows_K8.to(torch.uint8).reshape(-1)


def codes_of(exp_N: torch.Tensor, tables_K7: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Each value's code under its block's table (int64, N)."""
    block_N = torch.arange(exp_N.numel(), device=exp_N.device) // BLOCK_VALUES
    return code_lookup(tables_K7, fmt).view(-1)[block_N * fmt.exponents + exp_N]


def encode_chunk(flat_N: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress one chunk.

    Args:
        flat_N: contiguous 1-D values of `fmt.dtype`.
        fmt: their layout.

    Returns:
        (static part, dynamic part): uint8 tensors on the values' device.
    """
    n, device = flat_N.numel(), flat_N.device
    layout = Layout.of(n, fmt)
    exp_N, sm_N = split_fields(flat_N, fmt)
    tables_K7 = block_tables(exp_N, fmt)
    code_N = codes_of(exp_N, tables_K7, fmt)
    escaped_N = code_N == 0
    escapes = exp_N[escaped_N].to(torch.uint8)
    static = torch.zeros(layout.static_bytes, dtype=torch.uint8, device=device)
    header = Header(fmt, n, escapes.numel(), checksum(flat_N, fmt)).pack()
    static[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    _put(static, layout.tables, table_bytes(tables_K7))
    _put(static, layout.tile_index, _tile_index(escaped_N, layout).view(torch.uint8))
    raw_NR = torch.stack([(sm_N >> (8 * b)) & 0xFF for b in range(fmt.raw_bytes)], dim=1)
    _put(static, layout.raw, raw_NR.to(torch.uint8).reshape(-1))
    for e, offset in enumerate(layout.extra):
        _put(static, offset, pack_bits((sm_N >> (8 * fmt.raw_bytes + e)) & 1))
    for j, offset in enumerate(layout.codes):
        _put(static, offset, pack_bits((code_N >> j) & 1))
    dynamic = torch.zeros(dynamic_bytes(escapes.numel()), dtype=torch.uint8, device=device)
    dynamic[: escapes.numel()] = escapes
    return static, dynamic


def decode_chunk(static: torch.Tensor, dynamic: torch.Tensor, header: Header) -> torch.Tensor:
    """Decompress one chunk into a 1-D tensor of the header's dtype."""
    layout, fmt, n = header.layout, header.fmt, header.n_values
    raw_NR = _get(static, layout.raw, fmt.raw_bytes * n).to(torch.int64).view(n, fmt.raw_bytes)
    sm_N = raw_NR[:, 0].clone()
    for b in range(1, fmt.raw_bytes):
        sm_N |= raw_NR[:, b] << (8 * b)
    for e, offset in enumerate(layout.extra):
        sm_N |= unpack_bits(_get(static, offset, layout.plane_bytes), n) << (8 * fmt.raw_bytes + e)
    code_N = torch.zeros_like(sm_N)
    for j, offset in enumerate(layout.codes):
        code_N |= unpack_bits(_get(static, offset, layout.plane_bytes), n) << j
    tables_K8 = _get(static, layout.tables, TABLE_BYTES * layout.blocks).view(-1, TABLE_BYTES)
    exponents_K8 = torch.cat([tables_K8[:, :1] * 0, tables_K8[:, :TABLE_SIZE]], dim=1)  # 0: escape
    block_N = torch.arange(n, device=static.device) // BLOCK_VALUES
    exp_N = exponents_K8.to(torch.int64).view(-1)[block_N * TABLE_BYTES + code_N]
    escaped_N = code_N == 0
    index = _get(static, layout.tile_index, 4 * layout.tiles).clone().view(torch.int32)
    if int(escaped_N.sum()) != header.n_escapes or not torch.equal(
        index, _tile_index(escaped_N, layout)
    ):
        raise CodecError(
            f"corrupt chunk: escape codes do not match the {header.n_escapes} escapes "
            "and the tile index of its header"
        )
    exp_N[escaped_N] = dynamic[: header.n_escapes].to(torch.int64)
    return join_fields(exp_N, sm_N, fmt)


EncodeChunk = Callable[[torch.Tensor, FloatFormat], tuple[torch.Tensor, torch.Tensor]]
DecodeChunk = Callable[[torch.Tensor, torch.Tensor, Header], torch.Tensor]


def encode_chunks(
    flat_N: torch.Tensor, fmt: FloatFormat, chunk_values: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Compress consecutive chunks of `flat_N` (`chunk_values` values each).

    Returns:
        (static parts back to back, dynamic parts back to back, their sizes, their sizes).
    """
    return encode_each(flat_N, fmt, chunk_values, encode_chunk)


def encode_each(
    flat_N: torch.Tensor, fmt: FloatFormat, chunk_values: tuple[int, ...], encode: EncodeChunk
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """`encode_chunks` with `encode` coding one chunk at a time."""
    parts = [encode(piece, fmt) for piece in flat_N.split(list(chunk_values))]
    statics, dynamics = [s for s, _ in parts], [d for _, d in parts]
    return (
        _cat(statics, flat_N.device),
        _cat(dynamics, flat_N.device),
        tuple(s.numel() for s in statics),
        tuple(d.numel() for d in dynamics),
    )


def decode_chunks(
    chunks: list[tuple[torch.Tensor, torch.Tensor]], chunk_values: tuple[int, ...], fmt: FloatFormat
) -> torch.Tensor:
    """Decode (static, dynamic) chunks holding `chunk_values` values of `fmt` each, back to back.

    Raises:
        CodecError: a chunk is not a valid chunk of that many values of `fmt`.
    """
    return decode_each(chunks, chunk_values, fmt, _checked_decode)


def decode_each(
    chunks: list[tuple[torch.Tensor, torch.Tensor]],
    chunk_values: tuple[int, ...],
    fmt: FloatFormat,
    decode: DecodeChunk,
) -> torch.Tensor:
    """`decode_chunks` with `decode` decoding (and checking) one chunk whose header is valid."""
    parts = []
    for (static, dynamic), values in zip(chunks, chunk_values, strict=True):
        header = checked_header(static, dynamic, values, fmt)
        parts.append(decode(static, dynamic, header))
    if not parts:
        return torch.empty(0, dtype=fmt.dtype)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def checked_header(
    static: torch.Tensor, dynamic: torch.Tensor, values: int, fmt: FloatFormat
) -> Header:
    """The chunk's header, if it is one of `values` values of `fmt` and its parts are whole.

    Raises:
        CodecError: otherwise.
    """
    header = Header.unpack(static[:HEADER_BYTES].cpu().numpy().tobytes())
    if header.fmt != fmt:
        raise CodecError(f"a chunk of {header.fmt.dtype} where {fmt.dtype} was expected")
    if header.n_values != values:
        raise CodecError(f"{header.n_values} values where {values} were expected")
    check_whole(static, dynamic, header)
    return header


def check_whole(static: torch.Tensor, dynamic: torch.Tensor, header: Header) -> None:
    """Raise a CodecError unless the parts hold at least the bytes `header` announces."""
    if static.numel() < header.layout.static_bytes or dynamic.numel() < header.n_escapes:
        raise CodecError(
            f"truncated chunk: {static.numel()} + {dynamic.numel()} bytes for "
            f"{header.n_values} values and {header.n_escapes} escapes"
        )


def check_sum(values_N: torch.Tensor, header: Header) -> None:
    """Raise a CodecError unless the decoded values have the header's checksum."""
    check_total(checksum(values_N, header.fmt), header)


def check_total(total: int, header: Header) -> None:
    """Raise a CodecError unless `total` (modulo 2^32) is the header's checksum."""
    if total & CHECKSUM_MASK != header.checksum:
        raise CodecError(
            f"corrupt chunk: the checksum of its {header.n_values} decoded values does not "
            "match its header"
        )


def _checked_decode(static: torch.Tensor, dynamic: torch.Tensor, header: Header) -> torch.Tensor:
    values_N = decode_chunk(static, dynamic, header)
    check_sum(values_N, header)
    return values_N


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def checksum(flat_N: torch.Tensor, fmt: FloatFormat) -> int:
    """The values' checksum (`format.py`): sum of bits_i x (2i + 1) modulo 2^32.

    Computed in int64 without overflow: each product is split into 16-bit halves
    of the bits and reduced modulo 2^32 before the sum (chunks hold < 2^31 values).
    """
    mask32 = CHECKSUM_MASK
    bits_N = flat_N.view(fmt.int_dtype).to(torch.int64) & ((1 << (8 * fmt.value_bytes)) - 1)
    weight_N = (2 * torch.arange(bits_N.numel(), device=bits_N.device) + 1) & mask32
    low_N = ((bits_N & 0xFFFF) * weight_N) & mask32
    high_N = ((((bits_N >> 16) * weight_N) & 0xFFFF) << 16) & mask32
    return int((low_N + high_N).sum()) & mask32


def _tile_index(escaped_N: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Escapes before each tile (exclusive prefix), int32 (T,)."""
    padded = escaped_N.new_zeros(layout.tiles * TILE_VALUES, dtype=torch.int64)
    padded[: escaped_N.numel()] = escaped_N
    counts_T = padded.view(layout.tiles, TILE_VALUES).sum(1)
    return (torch.cumsum(counts_T, 0) - counts_T).to(torch.int32)


def _put(static: torch.Tensor, offset: int, data: torch.Tensor) -> None:
    static[offset : offset + data.numel()] = data


def _get(static: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    return static[offset : offset + size]
