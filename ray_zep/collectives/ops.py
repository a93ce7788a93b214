"""Zipped collectives and their plain counterparts, over any torch.distributed group.

Each zipped collective returns exactly what its plain counterpart returns
(bit for bit), moving compressed bytes instead:

- all-gather: compress, all-gather the compressed sizes, all-gather the bytes
  (padded to the largest), decompress every rank's block.
- all-to-all, size first: compress one chunk per destination, all-gather every
  rank's row of chunk sizes, all-to-all the bytes, decompress.
- all-to-all, static first: the static parts, whose sizes follow from the row
  counts, leave at once (so ranks that finish their computation early start
  moving data); then the rows of dynamic-part sizes are all-gathered and the
  dynamic parts follow.
- reduce-scatter: a zipped all-to-all, then a local sum in float32 in rank order.

The size exchanges are all-gathers, so after any zipped call every rank knows
every chunk's compressed size; the switcher's ratio estimates are updated from
those, and stay identical on all ranks. Rows split along dim 0; every rank's
tensor has the same trailing dims and dtype. Every wait has a timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ray_zep.collectives.codec import (
    Compressed,
    blamed_on,
    compress,
    decode_exactly,
    offsets,
    split_packed,
)
from ray_zep.collectives.format import static_bytes
from ray_zep.distributed.group import Group, all_gather_single, reduce_scatter_single
from ray_zep.errors import CodecError


class AllToAllDesign(Enum):
    SIZE_FIRST = "size_first"
    STATIC_FIRST = "static_first"


@dataclass
class Traffic:
    """Bytes a rank handed to collectives: as tensors (raw) and as sent (wire)."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, raw: int, wire: int) -> None:
        self.raw_bytes += raw
        self.wire_bytes += wire
        self.calls[what] = self.calls.get(what, 0) + 1

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


@dataclass(frozen=True)
class Sizes:
    """Every rank's compressed sizes from a zipped call's size exchange: raw and wire bytes."""

    raw_bytes: int
    wire_bytes: int

    def __add__(self, other: Sizes) -> Sizes:
        return Sizes(self.raw_bytes + other.raw_bytes, self.wire_bytes + other.wire_bytes)


def all_gather_v(tensor: torch.Tensor, g: Group) -> list[torch.Tensor]:
    """Plain all-gather of tensors whose dim 0 may differ by rank: one tensor per rank."""
    _check_rows_dim(tensor)
    rows = all_gather_ints([tensor.shape[0]], g, "all-gather sizes")
    row_shape, longest = tensor.shape[1:], max(r[0] for r in rows)
    padded = tensor.new_zeros((longest, *row_shape))
    padded[: tensor.shape[0]] = tensor
    out = tensor.new_empty((g.size * longest, *row_shape))
    work = all_gather_single(out, padded.contiguous(), group=g.group, async_op=True)
    g.wait([work], "all-gather")
    blocks = out.view(g.size, longest, *row_shape)
    return [blocks[r, : rows[r][0]] for r in range(g.size)]


def zipped_all_gather(
    tensor: torch.Tensor, g: Group, traffic: Traffic | None = None, what: str = "all-gather"
) -> tuple[list[torch.Tensor], Sizes]:
    """Same result as `all_gather_v`, moving compressed bytes.

    Raises:
        CodecError: a rank's compressed block is corrupt or truncated (names `what`
            and the rank).
    """
    _check_rows_dim(tensor)
    packed = compress(tensor).packed()
    meta = all_gather_ints([tensor.shape[0], packed.numel()], g, "zipped all-gather sizes")
    longest = max(m[1] for m in meta)
    padded = packed.new_zeros(longest)
    padded[: packed.numel()] = packed
    out = packed.new_empty(g.size * longest)
    work = all_gather_single(out, padded, group=g.group, async_op=True)
    g.wait([work], f"zipped {what}")
    blocks = out.view(g.size, longest)
    gathered = []
    for r, (rows, size) in enumerate(meta):
        flat = _decode_from(r, g, what, rows * _row_numel(tensor), blocks[r, :size])
        gathered.append(_rows(flat, rows, tensor))
    sizes = Sizes(sum(_nbytes_rows(m[0], tensor) for m in meta), sum(m[1] for m in meta))
    if traffic is not None:
        traffic.add("all_gather", _nbytes(tensor), packed.numel())
    return gathered, sizes


def all_to_all_v(
    tensor: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    g: Group,
    what: str = "all-to-all",
) -> torch.Tensor:
    """Plain all-to-all: send_rows[r] rows to rank r, receive recv_rows[r] from r, by rank."""
    return post_plain_all_to_all(tensor, send_rows, recv_rows, g, what).wait()


@dataclass
class PlainAllToAll:
    """A plain all-to-all in flight; `wait` gives the received rows (`out`)."""

    out: torch.Tensor
    work: object
    g: Group
    what: str

    def wait(self) -> torch.Tensor:
        self.g.wait([self.work], self.what)
        return self.out


def post_plain_all_to_all(
    tensor: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    g: Group,
    what: str = "all-to-all",
) -> PlainAllToAll:
    """Start a plain all-to-all of rows (send_rows[r] to rank r, recv_rows[r] from r)."""
    row = _row_numel(tensor)
    flat = tensor.contiguous().view(-1)
    out, work = post_all_to_all(flat, [r * row for r in send_rows], [r * row for r in recv_rows], g)
    return PlainAllToAll(out.view(sum(recv_rows), *tensor.shape[1:]), work, g, what)


def gradients_or_zeros(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Every parameter's gradient, zeros where it has none (untouched by this rank's
    tokens), so every rank sums the same tensors."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def reduce_in_one_buffer_(
    tensors: list[torch.Tensor], reduce_: Callable[[torch.Tensor], object]
) -> int:
    """Apply the in-place collective `reduce_` to `tensors` packed in one flat buffer.

    Returns:
        Bytes of the buffer.
    """
    flat = _flatten_dense_tensors(tensors)
    reduce_(flat)
    for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(synced)
    return flat.numel() * flat.element_size()


def all_reduce_sum_(tensor: torch.Tensor, g: Group, what: str) -> torch.Tensor:
    """Sum `tensor` over `g` in place, within the group's timeout."""
    work = dist.all_reduce(tensor, group=g.group, async_op=True)
    g.wait([work], f"all-reduce of {what}")
    return tensor


def zipped_all_to_all(
    tensor: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    g: Group,
    design: AllToAllDesign = AllToAllDesign.STATIC_FIRST,
    traffic: Traffic | None = None,
    what: str = "all-to-all",
) -> tuple[torch.Tensor, Sizes]:
    """Same result as `all_to_all_v`, moving compressed bytes (either of the two designs).

    Raises:
        CodecError: a chunk received from a rank is corrupt or truncated (names
            `what` and the rank).
    """
    posted = post_zipped_all_to_all(tensor, send_rows, recv_rows, g, design, what)
    out = posted.wait()
    if traffic is not None:
        traffic.add(f"all_to_all_{design.value}", _nbytes(tensor), posted.wire_bytes)
    return out, posted.sizes


@dataclass
class ZippedAllToAll:
    """A zipped all-to-all in flight: `wait` finishes it and decodes what arrived.

    Attributes:
        sizes: every rank's raw and compressed bytes (known once posted).
        wire_bytes: the compressed bytes this rank sent.
    """

    works: list
    chunks: list
    recv_rows: list[int]
    like: torch.Tensor
    g: Group
    what: str
    sizes: Sizes
    wire_bytes: int
    out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The received rows (in `out` when given), by source rank."""
        self.g.wait(self.works, f"zipped {self.what}")
        row = _row_numel(self.like)
        parts = [
            _rows(_decode_from(src, self.g, self.what, rows * row, chunk()), rows, self.like)
            for src, (chunk, rows) in enumerate(zip(self.chunks, self.recv_rows, strict=True))
        ]
        shape = (sum(self.recv_rows), *self.like.shape[1:])
        if self.out is None:
            return torch.cat(parts) if parts else self.like.new_empty(shape)
        if parts:
            torch.cat(parts, out=self.out.view(shape))
        return self.out


def post_zipped_all_to_all(
    tensor: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    g: Group,
    design: AllToAllDesign = AllToAllDesign.STATIC_FIRST,
    what: str = "all-to-all",
    out: torch.Tensor | None = None,
) -> ZippedAllToAll:
    """Compress and start a zipped all-to-all; the size exchange blocks, the data
    transfers stay in flight until `wait` (which fills `out` when given)."""
    _check_rows(send_rows, tensor, g)
    row = _row_numel(tensor)
    zipped = compress(tensor, [r * row for r in send_rows])
    raw = _nbytes(tensor)
    if design is AllToAllDesign.SIZE_FIRST:
        works, chunks, matrix = _size_first(zipped, raw, g, what)
    else:
        recv_values = [r * row for r in recv_rows]
        works, chunks, matrix = _static_first(zipped, raw, recv_values, tensor.dtype, g, what)
    sizes = Sizes(sum(r[-1] for r in matrix), sum(sum(r[:-1]) for r in matrix))
    return ZippedAllToAll(
        works, chunks, list(recv_rows), tensor, g, what, sizes, zipped.nbytes, out
    )


def _size_first(zipped: Compressed, raw: int, g: Group, what: str):
    """Exchange every rank's row of chunk sizes, then post the packed chunks."""
    sizes = zipped.packed_sizes()
    matrix = all_gather_ints([*sizes, raw], g, f"zipped {what} sizes")
    incoming = [matrix[src][g.rank] for src in range(g.size)]
    out, work = post_all_to_all(zipped.packed(), sizes, incoming, g)
    chunks = [_slice(out, o, n) for o, n in zip(offsets(incoming), incoming, strict=True)]
    return [work], chunks, matrix


def _static_first(zipped: Compressed, raw: int, recv_values: list[int], dtype, g: Group, what: str):
    """Static parts at once (their sizes follow from the rows), then sizes, then dynamic parts."""
    in_static = [static_bytes(n, dtype) for n in recv_values]
    static_out, static_work = post_all_to_all(zipped.static, zipped.static_sizes, in_static, g)
    matrix = all_gather_ints([*zipped.packed_sizes(), raw], g, f"zipped {what} dynamic sizes")
    in_dynamic = [matrix[src][g.rank] - in_static[src] for src in range(g.size)]
    if any(n < 0 for n in in_dynamic):
        g.wait([static_work], f"zipped {what}")
        src = min(s for s in range(g.size) if in_dynamic[s] < 0)
        raise CodecError(
            f"{what}: rank {_global(g, src)} announced a chunk shorter than its static part"
        )
    dynamic_out, dynamic_work = post_all_to_all(zipped.dynamic, zipped.dynamic_sizes, in_dynamic, g)
    chunks = [
        _pair(static_out, s, ns, dynamic_out, d, nd)
        for s, ns, d, nd in zip(
            offsets(in_static), in_static, offsets(in_dynamic), in_dynamic, strict=True
        )
    ]
    return [static_work, dynamic_work], chunks, matrix


def _slice(buffer: torch.Tensor, offset: int, size: int):
    """A view of the buffer's bytes, taken once the transfer has landed."""
    return lambda: buffer[offset : offset + size]


def _pair(static: torch.Tensor, s: int, ns: int, dynamic: torch.Tensor, d: int, nd: int):
    return lambda: (static[s : s + ns], dynamic[d : d + nd])


def reduce_scatter_local(received: torch.Tensor, g: Group, dtype: torch.dtype) -> torch.Tensor:
    """Sum the world blocks of `received` (rank order) in float32; cast to `dtype`."""
    blocks = received.view(g.size, -1, *received.shape[1:])
    total = blocks[0].to(torch.float32)
    for block in blocks[1:]:
        total += block.to(torch.float32)
    return total.to(dtype)


def reduce_scatter_via_all_to_all(tensor: torch.Tensor, g: Group) -> torch.Tensor:
    """Plain counterpart of `zipped_reduce_scatter`: all-to-all, then the same local sum."""
    rows = _equal_rows(tensor, g)
    received = all_to_all_v(tensor, [rows] * g.size, [rows] * g.size, g)
    return reduce_scatter_local(received, g, tensor.dtype)


def zipped_reduce_scatter(
    tensor: torch.Tensor, g: Group, traffic: Traffic | None = None, what: str = "reduce-scatter"
) -> tuple[torch.Tensor, Sizes]:
    """Rank r gets the sum over ranks of rows [r·m, (r+1)·m) of `tensor` (m = rows / world)."""
    rows = _equal_rows(tensor, g)
    received, sizes = zipped_all_to_all(
        tensor, [rows] * g.size, [rows] * g.size, g, traffic=traffic, what=what
    )
    return reduce_scatter_local(received, g, tensor.dtype), sizes


def native_reduce_scatter(tensor: torch.Tensor, g: Group) -> torch.Tensor:
    """The backend's own reduce-scatter (its summation order)."""
    rows = _equal_rows(tensor, g)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    work = reduce_scatter_single(out, tensor.contiguous(), group=g.group, async_op=True)
    g.wait([work], "reduce-scatter")
    return out


def post_all_to_all(
    send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], g: Group
) -> tuple[torch.Tensor, dist.Work]:
    """Post an all-to-all of the 1-D `send` cut into `send_sizes`; (output, its work handle)."""
    out = send.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(
        out, send, list(recv_sizes), list(send_sizes), group=g.group, async_op=True
    )
    return out, work


def all_gather_ints(values: list[int], g: Group, what: str) -> list[list[int]]:
    """Every rank's list of ints (all the same length), by rank."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = torch.empty(g.size * len(values), dtype=torch.int64)
    work = all_gather_single(out, mine, group=g.group, async_op=True)
    g.wait([work], what)
    return out.view(g.size, len(values)).tolist()


def _decode_from(
    src: int, g: Group, what: str, values: int, part: torch.Tensor | tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """Decode what rank `src` of `g` sent (a (static, dynamic) chunk or one packed
    chunk): exactly `values` values, or a CodecError naming `what` and the rank."""
    with blamed_on(f"{what}: the compressed data from rank {_global(g, src)}"):
        static, dynamic = part if isinstance(part, tuple) else split_packed(part, 1)[0]
        return decode_exactly(static, dynamic, values)


def _global(g: Group, rank: int) -> int:
    """The world rank of rank `rank` of `g`."""
    return dist.get_global_rank(g.group, rank)


def _rows(flat: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    return flat.view(rows, *like.shape[1:])


def _check_rows_dim(tensor: torch.Tensor) -> None:
    if tensor.dim() == 0:
        raise CodecError("collectives split tensors along dim 0; got a 0-dim tensor")


def _row_numel(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _nbytes_rows(rows: int, like: torch.Tensor) -> int:
    return rows * _row_numel(like) * like.element_size()


def _check_rows(send_rows: Sequence[int], tensor: torch.Tensor, g: Group) -> None:
    _check_rows_dim(tensor)
    if len(send_rows) != g.size or sum(send_rows) != tensor.shape[0]:
        raise CodecError(
            f"send_rows {list(send_rows)} must have {g.size} entries summing to the "
            f"tensor's {tensor.shape[0]} rows"
        )


def _equal_rows(tensor: torch.Tensor, g: Group) -> int:
    if tensor.dim() == 0 or tensor.shape[0] % g.size:
        raise CodecError(
            f"reduce-scatter needs dim 0 divisible by the group size {g.size}, "
            f"got shape {tuple(tensor.shape)}"
        )
    return tensor.shape[0] // g.size


def zipped_all_reduce(
    flat: torch.Tensor, g: Group, traffic: Traffic | None = None, what: str = "all-reduce"
) -> tuple[torch.Tensor, Sizes]:
    """Sum of a 1-D tensor over ranks, as zipped reduce-scatter then zipped all-gather.

    The sum is taken in float32 in rank order, so it differs from a backend
    all-reduce only by summation order; every rank gets the same bits.
    """
    n = flat.numel()
    shard = -(-n // g.size)
    padded = flat.new_zeros(shard * g.size)
    padded[:n] = flat
    reduced, rs_sizes = zipped_reduce_scatter(padded.view(g.size * shard, 1), g, traffic, what)
    gathered, ag_sizes = zipped_all_gather(reduced, g, traffic, what)
    total = torch.cat(gathered).view(-1)[:n]
    return total, rs_sizes + ag_sizes
