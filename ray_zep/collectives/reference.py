"""The codec in vectorised torch: the reference every other backend must match byte for byte.

Runs wherever torch runs (CPU or GPU). Works on one chunk; `codec.py` cuts a
tensor into chunks and picks the backend. The byte format is in `format.py`.

Legend: N values of the chunk, P = ceil(N / 8) bytes of a bit plane, T tiles.
"""

from __future__ import annotations

import torch

from ray_zep.collectives.format import (
    HEADER_BYTES,
    TABLE_SIZE,
    TILE_VALUES,
    FloatFormat,
    Header,
    Layout,
    dynamic_bytes,
)
from ray_zep.errors import CodecError


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


def code_lookup(table: tuple[int, ...], fmt: FloatFormat, device: torch.device) -> torch.Tensor:
    """Exponent field -> code (0 for exponents outside the table)."""
    lookup = torch.zeros(fmt.exp_max + 1, dtype=torch.int64, device=device)
    lookup[torch.tensor(table, device=device)] = torch.arange(1, TABLE_SIZE + 1, device=device)
    return lookup


def encode_chunk(
    flat_N: torch.Tensor, fmt: FloatFormat, table: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress one chunk.

    Args:
        flat_N: contiguous 1-D values of `fmt.dtype`.
        fmt: their layout.
        table: the seven coded exponent fields.

    Returns:
        (static part, dynamic part): uint8 tensors on the values' device.
    """
    n, device = flat_N.numel(), flat_N.device
    layout = Layout.of(n, fmt)
    exp_N, sm_N = split_fields(flat_N, fmt)
    code_N = code_lookup(table, fmt, device)[exp_N]
    escaped_N = code_N == 0
    escapes = exp_N[escaped_N].to(torch.uint8)
    static = torch.zeros(layout.static_bytes, dtype=torch.uint8, device=device)
    header = Header(fmt, table, n, escapes.numel(), checksum(flat_N, fmt)).pack()
    static[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
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
    exponents = torch.tensor((0, *header.table), dtype=torch.int64, device=static.device)
    exp_N = exponents[code_N]
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


def checksum(flat_N: torch.Tensor, fmt: FloatFormat) -> int:
    """The values' checksum (`format.py`): sum of bits_i x (2i + 1) modulo 2^32.

    Computed in int64 without overflow: each product is split into 16-bit halves
    of the bits and reduced modulo 2^32 before the sum (chunks hold < 2^31 values).
    """
    mask32 = (1 << 32) - 1
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
