"""Lossless compression of float tensors: `compress`, `decompress` and chunk handling.

A tensor is cut into chunks (one per destination of a collective, or one for
the whole tensor); each chunk is coded as described in `format.py`, with a
code table per block of 4096 values inside it (`table.py`). Two backends
produce the same bytes: the torch reference (`reference.py`, any device) and
the native kernels (`native.py`: C on the CPU, one call for all of a tensor's
chunks each way; CUDA on a GPU, `cuda_kernels.py`, two launches per chunk each
way and no wait for the device until a length or a verdict is needed), chosen
by `backend`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import cast

import torch

from ray_zep.collectives import cuda_kernels, native, reference
from ray_zep.collectives.format import (
    HEADER_BYTES,
    FloatFormat,
    Header,
    dynamic_bytes,
    float_format,
)
from ray_zep.errors import CodecError

BACKENDS = ("auto", "torch", "native")
log = logging.getLogger(__name__)


class Compressed:
    """A compressed tensor: the static parts of its chunks back to back, then the dynamic parts.

    On a GPU `compress` returns before the dynamic parts' lengths reach the host: each
    chunk's dynamic part then starts a room of `room_sizes[i]` bytes in `dynamic`. The
    first use of `dynamic`, `dynamic_sizes` or of what follows from them (`nbytes`,
    `ratio`, `chunk`, `packed`, `packed_sizes`) reads every chunk's escape count from its
    header (one device -> host copy, `resolve`) and cuts the parts out of their rooms;
    `static`, `static_sizes` and `decompress` never wait for it.

    Attributes:
        static: uint8, chunk i's static part at `static_offsets[i]`.
        dynamic: uint8, chunk i's dynamic part at `dynamic_offsets[i]`.
        static_sizes: bytes of each chunk's static part (known from its length).
        dynamic_sizes: bytes of each chunk's dynamic part (data dependent).
        chunk_values: values in each chunk.
        dtype: dtype of the original tensor.
        shape: shape of the original tensor.
    """

    def __init__(
        self,
        static: torch.Tensor,
        dynamic: torch.Tensor,
        static_sizes: tuple[int, ...],
        dynamic_sizes: tuple[int, ...] | None,
        chunk_values: tuple[int, ...],
        dtype: torch.dtype,
        shape: torch.Size,
        room_sizes: tuple[int, ...] | None = None,
    ) -> None:
        """`dynamic_sizes` None: `dynamic` holds the rooms of `room_sizes` bytes (see above)."""
        if (dynamic_sizes is None) == (room_sizes is None):
            raise CodecError("Compressed takes either the dynamic sizes or the room sizes")
        self.static, self.static_sizes = static, static_sizes
        self.chunk_values, self.dtype, self.shape = chunk_values, dtype, shape
        self._dynamic, self._dynamic_sizes, self._room_sizes = dynamic, dynamic_sizes, room_sizes

    @property
    def sizes_known(self) -> bool:
        """Whether the dynamic parts' lengths are on the host (no wait to ask)."""
        return self._room_sizes is None

    def resolve(self) -> Compressed:
        """Read the dynamic parts' lengths (once) and cut the parts out of their rooms."""
        if self._room_sizes is None:
            return self
        counts = cuda_kernels.escape_counts(self.static, self.static_sizes).tolist()
        sizes = tuple(dynamic_bytes(c) for c in counts)
        rooms = self._dynamic.split(list(self._room_sizes)) if sizes else []
        parts = [room[:size] for room, size in zip(rooms, sizes, strict=True)]
        self._dynamic = torch.cat(parts) if parts else self._dynamic[:0]  # frees the rooms
        self._dynamic_sizes, self._room_sizes = sizes, None
        return self

    @property
    def dynamic(self) -> torch.Tensor:
        return self.resolve()._dynamic

    @property
    def dynamic_sizes(self) -> tuple[int, ...]:
        return cast(tuple[int, ...], self.resolve()._dynamic_sizes)  # resolve sets them

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire."""
        return self.static.numel() + self.dynamic.numel()

    @property
    def original_bytes(self) -> int:
        return math.prod(self.shape) * float_format(self.dtype).value_bytes

    @property
    def ratio(self) -> float:
        """Original bytes over compressed bytes."""
        return self.original_bytes / self.nbytes

    @property
    def static_offsets(self) -> list[int]:
        return offsets(self.static_sizes)

    @property
    def dynamic_offsets(self) -> list[int]:
        return offsets(self.dynamic_sizes)

    def chunk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(static, dynamic) part of chunk i, as views."""
        s, d = self.static_offsets[i], self.dynamic_offsets[i]
        return (
            self.static[s : s + self.static_sizes[i]],
            self.dynamic[d : d + self.dynamic_sizes[i]],
        )

    def decodable(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(static part, dynamic part or the room it starts) of every chunk, without waiting."""
        if self._room_sizes is None:
            return [self.chunk(i) for i in range(len(self.chunk_values))]
        if len(self.chunk_values) == 1:
            return [(self.static, self._dynamic)]
        statics = self.static.split(list(self.static_sizes))
        return list(zip(statics, self._dynamic.split(list(self._room_sizes)), strict=True))

    def packed(self) -> torch.Tensor:
        """Every chunk as static part then dynamic part, chunk after chunk (one buffer)."""
        parts = [part for i in range(len(self.chunk_values)) for part in self.chunk(i)]
        return torch.cat(parts) if parts else self.static.new_empty(0)

    def packed_sizes(self) -> list[int]:
        return [s + d for s, d in zip(self.static_sizes, self.dynamic_sizes, strict=True)]


def compress(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, backend: str = "auto"
) -> Compressed:
    """Compress a bfloat16, float16 or float32 tensor losslessly.

    Args:
        tensor: any shape, contiguous or not, on any device.
        splits: values per chunk in flattened order (sum = numel); one chunk if None.
        backend: "auto" (native kernel where one is built for the device, else
            torch), "torch" (the reference) or "native" (error if unavailable).

    Returns:
        The compressed tensor; `decompress` gives back the same bits. On a GPU with the
        CUDA kernel: two launches per chunk and no wait for the device; the dynamic
        parts' lengths are read when first used (see `Compressed`).

    Raises:
        CodecError: unsupported dtype, bad splits, or an unavailable backend.
    """
    fmt = float_format(tensor.dtype)
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    chunk_values = _check_splits(splits, flat.numel())
    kernels = _kernels(backend, flat.device, fmt)
    if _cuda_kernel(kernels, flat.device):
        static, rooms, static_sizes, room_sizes = cuda_kernels.encode_chunks(
            flat, fmt, chunk_values
        )
        return Compressed(
            static, rooms, static_sizes, None, chunk_values, tensor.dtype, tensor.shape, room_sizes
        )
    static, dynamic, static_sizes, dynamic_sizes = kernels.encode_chunks(flat, fmt, chunk_values)
    return Compressed(
        static, dynamic, static_sizes, dynamic_sizes, chunk_values, tensor.dtype, tensor.shape
    )


def decompress(compressed: Compressed, backend: str = "auto") -> torch.Tensor:
    """The original tensor: same dtype, shape and bits (contiguous).

    On a GPU with the CUDA kernel: two launches per chunk, then one device -> host read
    of every chunk's verdict, so the values are never returned unchecked.

    Raises:
        CodecError: a chunk is damaged (see `decode_chunk`).
    """
    fmt = float_format(compressed.dtype)
    device = compressed.static.device
    kernels = _kernels(backend, device, fmt)
    if _cuda_kernel(kernels, device):
        chunks = compressed.decodable()
        values, _ = cuda_kernels.decode_chunks(chunks, compressed.chunk_values, device)
        return values.view(compressed.shape)
    chunks = [compressed.chunk(i) for i in range(len(compressed.chunk_values))]
    return kernels.decode_chunks(chunks, compressed.chunk_values, fmt).view(compressed.shape)


def read_header(static: torch.Tensor) -> Header:
    """Header of the chunk whose static part starts `static`."""
    return Header.unpack(static[:HEADER_BYTES].cpu().numpy().tobytes())


def decode_chunk(
    static: torch.Tensor, dynamic: torch.Tensor, backend: str = "auto", header: Header | None = None
) -> torch.Tensor:
    """Decompress one chunk (as cut from a `Compressed` or received) into 1-D values.

    Raises:
        CodecError: the bytes are not a valid chunk: a bad header, parts shorter
            than it announces, escape codes that do not match it, or decoded
            values whose checksum differs from its own.
    """
    header = header or read_header(static)
    reference.check_whole(static, dynamic, header)  # before trusting its count of values
    kernels = _kernels(backend, static.device, header.fmt)
    if _cuda_kernel(kernels, static.device):
        return cuda_kernels.decode_chunk(static, dynamic, header)
    return kernels.decode_chunks([(static, dynamic)], (header.n_values,), header.fmt)


def decode_exactly(
    static: torch.Tensor, dynamic: torch.Tensor, values: int, header: Header | None = None
) -> torch.Tensor:
    """`decode_chunk`, and a CodecError unless the chunk holds exactly `values` values."""
    header = header or read_header(static)
    if header.n_values != values:
        raise CodecError(f"{header.n_values} values where {values} were expected")
    return decode_chunk(static, dynamic, header=header)


@contextlib.contextmanager
def blamed_on(source: str) -> Iterator[None]:
    """Prefix a CodecError raised inside with `source` (the stream and the sender)."""
    try:
        yield
    except CodecError as exc:
        raise CodecError(f"{source}: {exc}") from exc


def split_packed(buffer: torch.Tensor, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a `Compressed.packed()` buffer into (static, dynamic) per chunk, by its headers."""
    out, offset = [], 0
    for _ in range(chunks):
        header = read_header(buffer[offset:])
        static_end = offset + header.layout.static_bytes
        out.append((buffer[offset:static_end], buffer[static_end:]))
        offset = static_end + header.dynamic_bytes
    return out


def _kernels(backend: str, device: torch.device, fmt: FloatFormat) -> ModuleType:
    """The module whose `encode_chunk` / `decode_chunk` serve this call."""
    return native if _use_native(backend, device, fmt) else reference


def _cuda_kernel(kernels: ModuleType, device: torch.device) -> bool:
    """Whether the CUDA kernel serves this call (it keeps the lengths on the device)."""
    return kernels is native and device.type == "cuda"


def _use_native(backend: str, device: torch.device, fmt: FloatFormat) -> bool:
    if backend not in BACKENDS:
        raise CodecError(f"codec backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    reason = native.unavailable_reason(device, fmt)
    if backend == "native" and reason:
        raise CodecError(f"native codec unavailable: {reason}")
    if reason is not None:
        _note_reference_use(reason)
    return reason is None


@functools.cache
def _note_reference_use(reason: str) -> None:
    log.info("codec: using the torch reference (slower, same bytes): %s", reason)


def _check_splits(splits: Sequence[int] | None, numel: int) -> tuple[int, ...]:
    if splits is None:
        return (numel,)
    values = tuple(int(s) for s in splits)
    if any(s < 0 for s in values) or sum(values) != numel:
        raise CodecError(f"splits {list(values)} must be >= 0 and sum to the {numel} values")
    return values


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive parts of `sizes` starts."""
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out
