"""Adaptive switcher: per call, the plain or the zipped path, whichever is modelled faster.

At start-up every rank of a group runs the same profile: each plain collective
at two sizes (α–β fit, T = α + β·bytes, ZipCCL eqs. 6–7), each zipped
collective at a small size (its fixed cost: extra size exchange, kernel calls),
and the codec and float32 reduction rates on Gaussian BF16. Timings are
maximised over ranks, so every rank holds the same profile.

Per call the zipped path costs its fixed cost, the plain link's β times the
compressed bytes (bytes / measured ratio), and the codec time. The measured
ratio is a running estimate per stream of calls ("gradients", "moe dispatch"),
updated only from sizes that every rank sees, so every rank makes the same
choice; a stream goes zipped on its first call and every `refresh_calls`-th
call after, to measure its ratio again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from ray_zep.collectives import ops
from ray_zep.collectives.codec import compress, decompress
from ray_zep.collectives.ops import AllToAllDesign, Sizes
from ray_zep.config import Compression
from ray_zep.distributed.group import Group

PROFILE_BYTES = (1 << 14, 1 << 20)
"""Sizes (bytes per rank) of the plain-collective fit."""
PROFILE_REPEATS = 3
STATIC_SHARE = 11 / 16
"""Bytes of BF16's static part per raw byte (8 raw + 3 code bits of 16)."""
RATIO_SMOOTHING = 0.5
"""Weight of the newest measurement in a stream's ratio estimate."""


class Kind(Enum):
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


@dataclass(frozen=True)
class LinearCost:
    """T(bytes) = alpha_s + beta_s_per_byte · bytes."""

    alpha_s: float
    beta_s_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @classmethod
    def through(cls, small: tuple[int, float], large: tuple[int, float]) -> LinearCost:
        beta = max((large[1] - small[1]) / (large[0] - small[0]), 0.0)
        return cls(max(small[1] - beta * small[0], 0.0), beta)


@dataclass(frozen=True)
class Profile:
    """Measured costs of one group (seconds; bytes are per rank)."""

    plain: dict[str, LinearCost]
    zipped_fixed_s: dict[str, float]
    compress_s_per_byte: float
    decompress_s_per_byte: float
    reduce_s_per_byte: float
    world: int

    def plain_seconds(self, kind: Kind, nbytes: int) -> float:
        return self.plain[kind.value].seconds(nbytes)

    def zipped_seconds(self, kind: Kind, nbytes: int, ratio: float) -> float:
        """Modelled time of the zipped path for `nbytes` per rank at compression `ratio`."""
        if kind is Kind.ALL_REDUCE:
            shard = nbytes / self.world
            return self.zipped_seconds(Kind.REDUCE_SCATTER, nbytes, ratio) + self.zipped_seconds(
                Kind.ALL_GATHER, int(shard), ratio
            )
        link = Kind.ALL_GATHER if kind is Kind.ALL_GATHER else Kind.ALL_TO_ALL
        decoded = nbytes * (self.world if kind is Kind.ALL_GATHER else 1)
        seconds = self.zipped_fixed_s[kind.value]
        seconds += self.plain[link.value].beta_s_per_byte * nbytes / ratio
        seconds += self.compress_s_per_byte * nbytes + self.decompress_s_per_byte * decoded
        if kind is Kind.REDUCE_SCATTER:
            seconds += self.reduce_s_per_byte * nbytes
        return seconds

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Switcher:
    """Chooses plain or zipped per call; identical state and choices on every rank."""

    mode: Compression
    profile: Profile | None = None
    refresh_calls: int = 32
    ratios: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def use_zipped(self, kind: Kind, stream: str, nbytes: int) -> bool:
        """Whether this call goes zipped. `nbytes` must be the same on every rank."""
        if self.mode is Compression.OFF:
            return False
        count = self.calls.get(stream, 0)
        self.calls[stream] = count + 1
        if self.mode is Compression.ALWAYS or self.profile is None:
            return True
        if stream not in self.ratios or count % self.refresh_calls == 0:
            return True
        plain = self.profile.plain_seconds(kind, nbytes)
        return self.profile.zipped_seconds(kind, nbytes, self.ratios[stream]) < plain

    def all_to_all_design(self, nbytes: int, stream: str) -> AllToAllDesign:
        """The zipped all-to-all design modelled faster for `nbytes` per rank.

        Size-first exchanges the sizes, then all bytes: T = α_ag + α_a2a + β·B.
        Static-first sends the static parts (known sizes, S bytes) while the sizes
        are exchanged, then the dynamic parts (D): T = max(α_a2a + β·S, α_ag) +
        α_a2a + β·D. Without a profile (`always`), static-first.
        """
        if self.profile is None:
            return AllToAllDesign.STATIC_FIRST
        ratio = self.ratios.get(stream, 1.0)
        a2a, ag = (
            self.profile.plain[Kind.ALL_TO_ALL.value],
            self.profile.plain[Kind.ALL_GATHER.value],
        )
        wire = nbytes / ratio
        static = min(wire, nbytes * STATIC_SHARE)
        size_first = ag.alpha_s + a2a.alpha_s + a2a.beta_s_per_byte * wire
        static_first = max(a2a.seconds(static), ag.alpha_s) + a2a.seconds(wire - static)
        if static_first <= size_first:
            return AllToAllDesign.STATIC_FIRST
        return AllToAllDesign.SIZE_FIRST

    def observe(self, stream: str, sizes: Sizes) -> None:
        """Record a zipped call's global sizes (the same on every rank)."""
        if sizes.wire_bytes <= 0:
            return
        measured = sizes.raw_bytes / sizes.wire_bytes
        old = self.ratios.get(stream)
        self.ratios[stream] = (
            measured if old is None else RATIO_SMOOTHING * measured + (1 - RATIO_SMOOTHING) * old
        )


def profile_group(g: Group, dtype: torch.dtype = torch.bfloat16) -> Profile:
    """Measure the costs of `g` (collective: every rank of the group calls it)."""
    element = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(g.rank)

    def data(nbytes: int) -> torch.Tensor:
        rows = max(g.size, nbytes // element // 64 // g.size * g.size)
        return (torch.randn(rows, 64, generator=gen) * 0.02).to(dtype)

    plain, fixed = {}, {}
    for kind, run_plain, run_zipped in _runners(g):
        points = [(n, _median_seconds(run_plain, data(n))) for n in PROFILE_BYTES]
        plain[kind.value] = LinearCost.through(*points)
        small = data(PROFILE_BYTES[0])
        link_s = plain[kind.value].beta_s_per_byte * PROFILE_BYTES[0] / compress(small).ratio
        fixed[kind.value] = max(_median_seconds(run_zipped, small) - link_s, 0.0)
    plain[Kind.ALL_REDUCE.value] = _all_reduce_cost(g, data)
    fixed[Kind.ALL_REDUCE.value] = fixed[Kind.REDUCE_SCATTER.value] + fixed[Kind.ALL_GATHER.value]
    sample = data(PROFILE_BYTES[1])
    nbytes = sample.numel() * element
    compressed = compress(sample)
    rates = [
        _median_seconds(compress, sample) / nbytes,
        _median_seconds(decompress, compressed) / nbytes,
        _median_seconds(torch.add, sample.float(), sample.float()) / nbytes,
    ]
    return _agreed(g, plain, fixed, rates)


def _runners(g: Group) -> list[tuple[Kind, Callable, Callable]]:
    def rows(x):
        return [x.shape[0] // g.size] * g.size

    return [
        (
            Kind.ALL_GATHER,
            lambda x: ops.all_gather_v(x, g),
            lambda x: ops.zipped_all_gather(x, g),
        ),
        (
            Kind.ALL_TO_ALL,
            lambda x: ops.all_to_all_v(x, rows(x), rows(x), g),
            lambda x: ops.zipped_all_to_all(x, rows(x), rows(x), g),
        ),
        (
            Kind.REDUCE_SCATTER,
            lambda x: ops.native_reduce_scatter(x, g),
            lambda x: ops.zipped_reduce_scatter(x, g),
        ),
    ]


def _all_reduce_cost(g: Group, data) -> LinearCost:
    def run(x):
        work = dist.all_reduce(x, group=g.group, async_op=True)
        g.wait([work], "profile all-reduce")

    return LinearCost.through(*[(n, _median_seconds(run, data(n).view(-1))) for n in PROFILE_BYTES])


def _median_seconds(fn: Callable[..., object], *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(PROFILE_REPEATS):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _agreed(g: Group, plain: dict, fixed: dict, rates: list[float]) -> Profile:
    """The slowest rank's figures, on every rank."""
    keys = sorted(plain)
    flat = [v for k in keys for v in (plain[k].alpha_s, plain[k].beta_s_per_byte)]
    flat += [fixed[k] for k in keys] + rates
    values = torch.tensor(flat, dtype=torch.float64)
    work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=g.group, async_op=True)
    g.wait([work], "switcher profile")
    v = values.tolist()
    n = len(keys)
    return Profile(
        plain={k: LinearCost(v[2 * i], v[2 * i + 1]) for i, k in enumerate(keys)},
        zipped_fixed_s={k: v[2 * n + i] for i, k in enumerate(keys)},
        compress_s_per_byte=v[3 * n],
        decompress_s_per_byte=v[3 * n + 1],
        reduce_s_per_byte=v[3 * n + 2],
        world=g.size,
    )
