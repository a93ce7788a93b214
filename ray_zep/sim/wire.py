"""ZipCCL on the simulated wire: which calls travel zipped, and what they then cost.

A call of a stream that `comm.compression_streams` names travels zipped as the
switcher would send it (`ray_zep.collectives.switcher.Profile`'s cost rule, on the
link or group it crosses): its bytes shrink by the codec's ratio for its dtype
(`ZIP_RATIOS`), and its encode and decode run serial with the transfer, inside the
call's time (ZipCCL fuses them with the collective; `ray_zep.bench.zipccl_model`
models them the same way), at the device's codec rate (`codec_bytes_s`). `auto`
zips a call only where that is modelled faster, `always` every one; off, nothing.

Users: the layer graph's messages (`ray_zep.sim.program`), the weights' collectives
(`ray_zep.sim.weights`), the expert all-to-alls (`ray_zep.sim.step`) and the shards
and gradient sums of weight passing (`ray_zep.sim.weight_passing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ray_zep.collectives.switcher import Kind, LinearCost, Profile
from ray_zep.config import CommConfig, Compression
from ray_zep.costmodel import (
    CODEC_DRAM_FRACTION,
    ComputeRates,
    CostModel,
    codec_rule_bytes_s,
    preset_gpu,
)
from ray_zep.topology import LinkKind

ZIP_RATIOS = {(2, False): 1.425, (2, True): 1.378, (4, False): 1.16, (4, True): 1.16}
"""Original over wire bytes of ZipCCL's exponent coding, by (bytes per value, gradients):
bf16 weights and activations 1.425 and bf16 gradients 1.378, the ratios `ray-zep bench
zipccl` measures with our codec and feeds its model (BENCHMARKS.md, "ZipCCL's paper
setups, modelled"); float32 1.16: the codec codes float32 too (8 exponent bits to 3,
the 24 sign and mantissa bits raw), 1.159 on model gradients (`ray-zep bench codec`)
and 1.15-1.17 on every stream of CPU training (`bench train --compare compression`).
A dtype missing here is one the codec does not code: it travels plain."""
GPU_DRAM_BYTES_S = {"A800": 2.039e12, "H800": 3.35e12, "H200": 4.8e12, "A10G": 0.6e12}
"""Memory bandwidth of the preset GPUs (NVIDIA datasheets: A100 80GB SXM, H100 SXM,
H200 SXM, A10G), which the codec's kernels are bound by."""
CPU_CODEC_BYTES_S = 1.0e9
"""The codec's C kernel on one CPU process of a virtual cluster, compress and decompress
alike: the switcher's start-up profiles of CPU training measured 0.54-1.59 GB/s
(BENCHMARKS.md, "ZipCCL in training"); one thread alone reaches 1.9 / 2.3 GB/s
(`ray-zep bench codec`)."""


def codec_bytes_s(rates: ComputeRates, gpu_model: str, on_gpu: bool) -> float:
    """Original bytes/s the codec compresses (and decompresses) on one device: the
    calibration's `codec_bytes_s`, else on a GPU the `ray_zep.bench.zipccl_model`
    rule at our codec's measured share (`CODEC_DRAM_FRACTION` of the memory bandwidth
    over 1 + 1 / ratio, at the bf16 ratio), else `CPU_CODEC_BYTES_S`."""
    if rates.codec_bytes_s < 0:
        raise ValueError(f"codec_bytes_s={rates.codec_bytes_s} must be >= 0 (0: the default)")
    if rates.codec_bytes_s > 0:
        return rates.codec_bytes_s
    if not on_gpu:
        return CPU_CODEC_BYTES_S
    dram = GPU_DRAM_BYTES_S[preset_gpu(gpu_model)]
    return codec_rule_bytes_s(dram, ZIP_RATIOS[(2, False)], CODEC_DRAM_FRACTION)


class Stream(NamedTuple):
    """What a message carries, as the codec sees it.

    Attributes:
        name: its `comm.compression_streams` name.
        value_bytes: bytes per value (2: bf16, 4: float32).
        gradient: gradients (they compress a little less than weights and activations).
        encodes, decodes: its sender compresses it, its receiver decompresses it; false
            on the hops of a routed transfer where a proxy passes the bytes on as they
            came (the source codes a piece once, the destination decodes it).
    """

    name: str
    value_bytes: int
    gradient: bool = False
    encodes: bool = True
    decodes: bool = True


@dataclass(frozen=True)
class WireCodec:
    """ZipCCL on the simulated wire: which calls travel zipped and what they then cost.

    A call's zipped time is the switcher's (`Profile.zipped_seconds`: a fixed cost of
    two latencies, for the sizes or the dynamic part that follow the static part; the
    link's per-byte time on bytes / ratio; compress and decompress at
    `bytes_per_s`), with the link's or group's own alpha-beta in the profile's place.
    The trainer fits one profile per process group (point-to-point messages on the
    job group's); the model decides each message on the link it crosses, the cost
    rule the profile stands for. The switcher's refresh calls (one in
    `comm.compression_refresh_calls` zipped to measure the ratio) are not modelled.

    Attributes:
        mode: `comm.compression`.
        streams: `comm.compression_streams`.
        bytes_per_s: codec rate, original bytes/s (`codec_bytes_s`).
    """

    mode: Compression = Compression.OFF
    streams: frozenset[str] = frozenset()
    bytes_per_s: float = math.inf

    @classmethod
    def create(cls, comm: CommConfig, bytes_per_s: float) -> WireCodec:
        if not bytes_per_s > 0:
            raise ValueError(f"codec rate {bytes_per_s} bytes/s must be > 0")
        return cls(comm.compression, frozenset(comm.compression_streams), bytes_per_s)

    def zips(self, stream: str) -> bool:
        """Whether calls of `stream` may travel zipped at all."""
        return self.mode is not Compression.OFF and stream in self.streams

    def seconds(
        self, plain_s: float, profile: Profile | None, kind: Kind, stream: Stream, nbytes: float
    ) -> float:
        """Seconds of one call of `nbytes` (per rank, as the switcher counts them) whose
        plain form takes `plain_s`: plain, or zipped under `profile` where this mode
        zips it (`profile` may be None when `stream` is not zipped)."""
        ratio = ZIP_RATIOS.get((stream.value_bytes, stream.gradient))
        if nbytes <= 0 or ratio is None or not self.zips(stream.name):
            return plain_s
        zipped = profile.zipped_seconds(kind, nbytes, ratio)
        return zipped if self.mode is Compression.ALWAYS else min(plain_s, zipped)

    def link_profile(
        self, cost: CostModel, kind: LinkKind, encodes: bool = True, decodes: bool = True
    ) -> Profile:
        """A point-to-point message on one link (one sender per NIC), as an all-to-all;
        its ends code it or not (`Stream.encodes`, `Stream.decodes`)."""
        latency, bandwidth = cost.link_latency(kind), cost.link_bandwidth(kind, True)
        return self.message_profile(latency, bandwidth, encodes, decodes)

    def message_profile(
        self, latency_s: float, bytes_per_s: float, encodes: bool = True, decodes: bool = True
    ) -> Profile:
        """A point-to-point message at `latency_s` + bytes / `bytes_per_s`, as an all-to-all
        (`link_profile`)."""
        plain = LinearCost(latency_s, 1 / bytes_per_s)
        return self._profile({Kind.ALL_TO_ALL: plain}, 2, encodes, decodes)

    def group_profile(self, cost: CostModel, ranks) -> Profile:
        """The collectives over `ranks` as `CostModel` times them: an all-gather of one
        block per rank, an all-to-all or reduce-scatter of a rank's whole buffer
        (`all_gather_seconds` of its 1 / W share), an all-reduce."""
        ranks = tuple(ranks)
        world, steps = len(ranks), max(len(ranks) - 1, 0)
        bus = cost.bus_bandwidth(ranks) if steps else math.inf
        alpha = cost.all_gather_seconds(0.0, ranks)
        share = LinearCost(alpha, steps / world / bus)
        plain = {
            Kind.ALL_GATHER: LinearCost(alpha, steps / bus),
            Kind.ALL_TO_ALL: share,
            Kind.REDUCE_SCATTER: share,
            Kind.ALL_REDUCE: LinearCost(2 * alpha, 2 * steps / world / bus),
        }
        return self._profile(plain, world)

    def _profile(
        self, plain: dict[Kind, LinearCost], world: int, encodes: bool = True, decodes: bool = True
    ) -> Profile:
        per_byte = 1 / self.bytes_per_s
        fixed = {kind.value: 2 * cost.alpha_s for kind, cost in plain.items()}
        if Kind.ALL_REDUCE in plain:  # a zipped all-reduce is a reduce-scatter, then a gather
            fixed[Kind.ALL_REDUCE.value] = (
                fixed[Kind.REDUCE_SCATTER.value] + fixed[Kind.ALL_GATHER.value]
            )
        plain_by_name = {kind.value: cost for kind, cost in plain.items()}
        # the zipped reduce-scatter's float32 sum is not charged: the plain one sums too
        coding = (per_byte if encodes else 0.0, per_byte if decodes else 0.0)
        return Profile(plain_by_name, fixed, *coding, 0.0, world)

    def collective_seconds(
        self, plain_s: float, cost: CostModel, ranks, kind: Kind, stream: Stream, nbytes: float
    ) -> float:
        """`seconds` of a collective over `ranks` (`group_profile`)."""
        if not self.zips(stream.name):
            return plain_s
        return self.seconds(plain_s, self.group_profile(cost, ranks), kind, stream, nbytes)


PLAIN = WireCodec()
"""Every call plain: `comm.compression=off`."""
