"""The CUDA codec kernel (`cuda/zipccl.cu`), JIT-built with torch's extension loader.

Built on first use when torch sees a GPU and nvcc is found; BF16 only (FP16 and
FP32 tensors on a GPU use the torch reference, which `unavailable_reason` says).

Encoding a chunk is two launches and no wait for the device (`encode_into`): the
first picks each block's table (the rule of `table.py`) and writes it, the header
and the padding into the static part, and counts each tile's escapes; the second
finds each tile's first escape by a look-back over those counts, writes the tile
index, the planes and the escapes, the escape count and the checksum into the
header. The dynamic part is written at the start of room for its largest size
(`room_bytes`); its length is in the header, which `escape_counts` gathers for one
device -> host read when the caller needs it (to send the part or cut it out).

Decoding a chunk is two launches and no wait (`decode_into`): the decoder, which
also checks the tile index and adds up each tile's share of the checksum, then one
block that writes the chunk's verdict into a status word. `Verdict.check` reads the
words of all chunks at once and raises the CodecError; `decode_chunks` calls it
before returning unless told not to, and then the values must not be used before it.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ray_zep.collectives.format import (
    BF16,
    BLOCK_VALUES,
    CHUNK_ALIGN,
    TILE_VALUES,
    FloatFormat,
    Header,
    Layout,
    align,
)
from ray_zep.errors import CodecError

SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "zipccl.cu"
ESCAPES_AT = 24
"""Byte offset of the header's escape count (int64, format.py)."""
VERDICTS = {
    1: "not a ZipCCL v3 chunk of bfloat16 (magic, version, format or header fields)",
    2: "the chunk's header holds a different number of values than the {values} expected",
    3: "truncated chunk: its {dynamic} dynamic bytes are fewer than its header announces",
    4: "corrupt chunk: escape codes do not match the escapes and the tile index of its header",
    5: "corrupt chunk: the checksum of its {values} decoded values does not match its header",
}
"""zc_check_kernel's status word -> CodecError message (the codes of cuda/zipccl_cpu.c)."""


def unavailable_reason(fmt: FloatFormat) -> str | None:
    """None when the CUDA kernel can code `fmt` here, else why not."""
    if fmt.dtype is not torch.bfloat16:
        return f"the CUDA kernel codes bfloat16 only, not {fmt.dtype}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if shutil.which("nvcc") is None and not _cuda_home_nvcc():
        return "nvcc is not on PATH (set CUDA_HOME) to build the CUDA codec kernel"
    try:
        _extension()
    except Exception as exc:  # the loader raises several types; report any
        return f"building the CUDA codec kernel failed: {exc}"
    return None


def room_bytes(n_values: int) -> int:
    """Bytes of room for the dynamic part of `n_values` values: every value escaped, padded."""
    return align(n_values, CHUNK_ALIGN)


def encode_into(
    flat_N: torch.Tensor, static: torch.Tensor, room: torch.Tensor, kernels=None
) -> None:
    """Write one chunk of bfloat16 values on a GPU: two launches, no wait for the device.

    Args:
        flat_N: contiguous 1-D bfloat16 values (any alignment).
        static: uint8, exactly the chunk's static bytes, starting on an 8-byte boundary;
            every byte is written (it may come from torch.empty).
        room: uint8, at least `room_bytes(n)`; the dynamic part is written at its start
            (the escapes, then zeros to a multiple of 128 bytes), the rest is left as is.
        kernels: replaces the built extension (tests run the kernels' logic elsewhere).
    """
    (kernels or _extension()).encode(flat_N.view(torch.int16), static, room)


def encode_chunks(
    flat_N: torch.Tensor, fmt: FloatFormat, chunk_values: tuple[int, ...], kernels=None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Every chunk of `flat_N`, two launches each and no wait for the device.

    Returns:
        (static parts back to back, rooms back to back, static sizes, room sizes): chunk
        i's dynamic part starts its room; `escape_counts` gives the lengths.
    """
    static_sizes = tuple(Layout.of(n, fmt).static_bytes for n in chunk_values)
    room_sizes = tuple(room_bytes(n) for n in chunk_values)
    static = torch.empty(sum(static_sizes), dtype=torch.uint8, device=flat_N.device)
    room = torch.empty(sum(room_sizes), dtype=torch.uint8, device=flat_N.device)
    if len(chunk_values) == 1:  # no views to cut: each split is host time a small message feels
        encode_into(flat_N, static, room, kernels)
        return static, room, static_sizes, room_sizes
    pieces = flat_N.split(list(chunk_values))
    spans = zip(pieces, _cut(static, static_sizes), _cut(room, room_sizes), strict=True)
    for piece, static_part, room_part in spans:
        encode_into(piece, static_part, room_part, kernels)
    return static, room, static_sizes, room_sizes


def escape_counts(static: torch.Tensor, static_sizes: Sequence[int]) -> torch.Tensor:
    """The escape count in the header of each chunk, int64 on the static parts' device
    (one gather, no wait: `.tolist()` on it is the caller's one device -> host read)."""
    fields = [part[ESCAPES_AT : ESCAPES_AT + 8] for part in _cut(static, static_sizes)]
    if not fields:
        return torch.empty(0, dtype=torch.int64, device=static.device)
    return torch.stack(fields).view(torch.int64).reshape(-1)


def encode_chunk(
    flat_N: torch.Tensor, fmt: FloatFormat, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.encode_chunk`, for a bfloat16 tensor on a GPU: the
    launches of `encode_chunks` and one device -> host read of the escape count, to cut
    the dynamic part out of its room."""
    n = flat_N.numel()
    static, room, sizes, _ = encode_chunks(flat_N, fmt, (n,), kernels)
    (escapes,) = escape_counts(static, sizes).tolist()
    return static, room[: align(escapes, CHUNK_ALIGN)].clone()


@dataclass(frozen=True)
class Verdict:
    """The status words of decoded chunks, on the device, until `check` reads them."""

    status: torch.Tensor
    """int64 per chunk: 0 or a key of `VERDICTS`."""
    chunk_values: tuple[int, ...]
    dynamic_bytes: tuple[int, ...]

    def check(self) -> None:
        """One device -> host read of every chunk's status word.

        Raises:
            CodecError: the first bad chunk's fault, as `VERDICTS` words it.
        """
        for i, code in enumerate(self.status.tolist()):
            if code:
                values, dynamic = self.chunk_values[i], self.dynamic_bytes[i]
                raise CodecError(VERDICTS[code].format(values=values, dynamic=dynamic))


def decode_into(
    static: torch.Tensor,
    dynamic: torch.Tensor,
    out_N: torch.Tensor,
    status: torch.Tensor,
    kernels=None,
) -> None:
    """Decode one chunk of `out_N.numel()` bfloat16 values on a GPU: two launches, no wait.

    Args:
        static: uint8, at least the static bytes of that many values.
        dynamic: uint8, the dynamic part or a room that starts with it (never read past).
        out_N: bfloat16, the decoded values (not to be used before the status is read).
        status: int64, one element: the chunk's verdict (0, or a key of `VERDICTS`).

    Raises:
        CodecError: `static` is shorter than the layout of `out_N.numel()` values.
    """
    n = out_N.numel()
    if static.numel() < Layout.of(n, BF16).static_bytes:
        raise CodecError(f"truncated chunk: {static.numel()} static bytes for {n} values")
    (kernels or _extension()).decode(
        static.contiguous(), dynamic.contiguous(), out_N.view(torch.int16), status
    )


def decode_chunks(
    chunks: list[tuple[torch.Tensor, torch.Tensor]],
    chunk_values: tuple[int, ...],
    device: torch.device,
    kernels=None,
    checked: bool = True,
) -> tuple[torch.Tensor, Verdict]:
    """Decode (static, dynamic or room) chunks of `chunk_values` bfloat16 values each, back
    to back: two launches per chunk, then (`checked`) one read of all their verdicts.

    Returns:
        (values, verdict): with `checked` False the verdict is unread, and the caller must
        call `verdict.check()` before it uses the values.

    Raises:
        CodecError: a chunk is not a valid chunk of that many bfloat16 values.
    """
    out = torch.empty(sum(chunk_values), dtype=torch.bfloat16, device=device)
    status = torch.empty(len(chunks), dtype=torch.int64, device=device)
    if len(chunks) == 1:  # the whole buffers, no views cut
        spans = [(chunks[0], out, status)]
    else:
        words = [status[i : i + 1] for i in range(len(chunks))]
        spans = zip(chunks, _cut(out, chunk_values), words, strict=True)
    for (static, dynamic), out_N, word in spans:
        decode_into(static, dynamic, out_N, word, kernels)
    verdict = Verdict(status, chunk_values, tuple(d.numel() for _, d in chunks))
    if checked:
        verdict.check()
    return out, verdict


def decode_chunk(
    static: torch.Tensor, dynamic: torch.Tensor, header: Header, kernels=None
) -> torch.Tensor:
    """Same contract as `reference.decode_chunk`, on the GPU that holds `static`, and the
    chunk checked (one device -> host read of its verdict).

    Raises:
        CodecError: the chunk is not a valid chunk of `header.n_values` values.
    """
    values, _ = decode_chunks([(static, dynamic)], (header.n_values,), static.device, kernels)
    return values


def _cut(buffer: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of `buffer`, `sizes` elements each."""
    return list(buffer.split(list(sizes))) if sizes else []


def _cuda_home_nvcc() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").is_file()


@functools.cache
def _extension() -> ModuleType:
    from torch.utils.cpp_extension import load

    if not SOURCE.is_file():
        raise CodecError(f"CUDA kernel source {SOURCE} is missing from this installation")
    return load(
        name="ray_zep_zipccl",
        sources=[str(SOURCE)],
        extra_cuda_cflags=[
            "-O3",
            f"-DZC_TILE_VALUES={TILE_VALUES}",
            f"-DZC_BLOCK_VALUES={BLOCK_VALUES}",
        ],
        verbose=False,
    )
