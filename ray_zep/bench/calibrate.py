"""`ray-zep bench calibrate`: measure this device and, on CPU, its virtual cluster's links.

Compute (`ray_zep.bench.calibrate_kernels`): attention rates per block kind and
length, the matmul rate, the element-wise rate of the model's own layers and the
optimizer's cost per parameter, on one thread per process on CPU (one virtual GPU
is one single-threaded process), in bf16 on a GPU. Links, on CPU
(`ray_zep.bench.calibrate_links`): messages and all-gathers among as many gloo
processes as the virtual cluster has ranks, computing between messages as
training does; and the model's training step in one process alone, against which
the share of a core each rank gets is probed (`ray_zep.bench.core_share`).

Writes `calibration.json`: the `ComputeRates` the simulator loads (`ray-zep
simulate --calibration`), the link fits, and every measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ray_zep.bench.calibrate_kernels import (
    Measurement,
    calibration_dtype,
    curve_heads,
    curves,
    measure_attention,
    measure_call,
    measure_codec,
    measure_matmul,
    measure_model,
    pointwise_rate,
)
from ray_zep.bench.calibrate_links import ROUNDS as LINK_ROUNDS
from ray_zep.bench.calibrate_links import (
    LinkPoint,
    contention,
    fit_link,
    latency_curve,
    measure_links,
)
from ray_zep.bench.calibrate_ring import with_ring_step
from ray_zep.bench.core_share import ShareProbe
from ray_zep.config import Config, TopologyConfig
from ray_zep.costmodel import ComputeRates
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import ModelShape, build_shape
from ray_zep.sim.events import CorePool
from ray_zep.sim.hardware import Hardware
from ray_zep.topology import build_topology


def fit(points: list[Measurement]) -> tuple[float, float]:
    """(overhead seconds >= 0, rate) of `seconds = overhead + amount / rate`."""
    x = np.array([p.flops for p in points])
    y = np.array([p.seconds for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # noise: fall back to a pure rate through the origin
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return float(intercept), 1.0 / float(slope)


_LINK_KEYS = ("link_latency_s", "link_bandwidth", "step_latency_s", "step_bandwidth")
_SHARE_KEYS = ("core_share", "alone_step_s", "job_share", "run_share")


def _optional_float(record: dict, key: str, path: str | Path) -> float | None:
    """`record[key]` as a float, None where absent or null.

    Raises:
        ConfigError: the value is not a number.
    """
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"--calibration {path}: {key} must be a number or null, not {value!r}; "
            "run `ray-zep bench calibrate` again"
        )
    return float(value)


@dataclass
class Calibration:
    """What `ray-zep bench calibrate` measured.

    Attributes:
        rates: one device's rates (one single-threaded process on CPU).
        link_latency_s, link_bandwidth: a message between two ranks of the virtual
            cluster (None on a GPU), measured at `core_share`.
        step_latency_s, step_bandwidth: one step of an all-gather among them.
        latency_curve: (seconds of compute between two messages, a message's latency)
            in rising compute, measured like `link_latency_s` after shorter compute
            bursts too (`ray_zep.bench.calibrate_links.latency_curve`); empty: not
            measured (every message at `link_latency_s`).
        ranks: processes the links were measured with.
        cores: cores of this machine.
        core_share: share of a core each of those ranks got while the links and the
            ring step were measured (`ray_zep.bench.core_share`: the model's step
            alone over its seconds in every rank at once; cores / ranks when not
            measured).
        ring_step_s: what a ring step of the attention engine costs besides its kernel
            and its transfers, at `core_share` (`ray_zep.bench.calibrate_ring`).
        alone_step_s: the model's training step in one process alone, the reference
            of every probe of the share (`ShareProbe`; None: not measured).
        job_share: what share of the compute rate a rank keeps inside a training job
            (measured by `ray_zep_workers.bench_calibrate` on steps through Ray: the raylet, the
            driver and the data actor share the same cores; None: not measured): the
            median of `job_shares`, the pairs of job runs that measured it.
        run_share: share of a core each rank gets in the run being predicted (probed
            around it); None: `core_share`.
        measurements: every timed point.

    On a CPU virtual cluster every cost is CPU time: one measured in a process alone
    (kernels, a kernel call) takes 1 / share as long in a run whose ranks get `share`
    of a core each, and one measured among the ranks at `core_share` (messages, the
    ring step, which carry the compute's sharing already) takes `core_share / share`
    as long.
    """

    rates: ComputeRates
    link_latency_s: float | None = None
    link_bandwidth: float | None = None
    step_latency_s: float | None = None
    step_bandwidth: float | None = None
    latency_curve: tuple[tuple[float, float], ...] = ()
    ranks: int = 1
    cores: int = 1
    core_share: float | None = None
    ring_step_s: float = 0.0
    alone_step_s: float | None = None
    job_share: float | None = None
    job_shares: tuple[float, ...] = ()
    run_share: float | None = None
    measurements: list = field(default_factory=list)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**asdict(self.rates), **{k: v for k, v in asdict(self).items() if k != "rates"}}
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A `calibration.json` written by `save` (measurements are not read back)."""
        rates = ComputeRates.load(path)
        record = json.loads(Path(path).read_text())
        links = {k: _optional_float(record, k, path) for k in _LINK_KEYS}
        shares = {k: _optional_float(record, k, path) for k in _SHARE_KEYS}
        try:
            sizes = {k: int(record.get(k, 1)) for k in ("ranks", "cores")}
            shares["job_shares"] = tuple(float(s) for s in record.get("job_shares", ()))
            curve = tuple((float(c), float(s)) for c, s in record.get("latency_curve", ()))
            ring_step_s = float(record.get("ring_step_s", 0.0))
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"--calibration {path}: ranks, cores, job_shares, latency_curve (pairs of "
                f"seconds) or ring_step_s is malformed ({exc}); run `ray-zep bench "
                "calibrate` again"
            ) from exc
        return cls(rates, **links, **sizes, **shares, latency_curve=curve,
                   ring_step_s=ring_step_s)  # fmt: skip

    @property
    def virtual(self) -> bool:
        """A CPU virtual cluster's calibration (its links measured)."""
        return self.link_bandwidth is not None

    def share(self, world: int) -> float:
        """Share of a core each of `world` ranks gets while all compute: probed for the
        calibrated rank count (around the run, else at calibration), cores / ranks
        otherwise; 1 for a GPU's calibration."""
        if not self.virtual:
            return 1.0
        measured = self.run_share if self.run_share is not None else self.core_share
        if measured is not None and world == self.ranks:
            return min(1.0, measured)
        return min(1.0, self.cores / world)

    def _alone_note(self) -> str:
        if self.alone_step_s is None:
            return ""
        return f" (the model's step {self.alone_step_s * 1e3:.0f} ms alone)"

    def _pairs_note(self) -> str:
        if len(self.job_shares) < 2:
            return ""
        return " (median of " + ", ".join(f"{s:.2f}" for s in self.job_shares) + ")"

    def share_probe(self, shape: ModelShape) -> ShareProbe:
        """The probe of the share each rank gets around a run of a model of `shape`.

        Raises:
            ConfigError: the calibration did not time the model's step alone (written
                by an older ray_zep, or not on a virtual cluster).
        """
        if self.alone_step_s is None:
            raise ConfigError(
                "the calibration has no alone_step_s to probe the core share against: "
                "run `ray-zep bench calibrate` again"
            )
        return ShareProbe(shape, self.ranks, self.alone_step_s)

    def _factors(self, world: int) -> tuple[float, float]:
        """(share of a core that compute measured alone gets inside the job, slowdown of
        costs measured among the ranks)."""
        calibrated = world == self.ranks
        job = self.job_share if self.job_share and calibrated else 1.0
        share = self.share(world) * job
        measured_at = self.core_share if self.core_share is not None else share
        return share, measured_at / share

    def job_rates(self, world: int) -> ComputeRates:
        """The rates of one of `world` ranks inside a training job (class docstring): the
        kernels and a kernel call at the rank's share of a core (times `job_share`), the
        ring step's costs measured among the ranks rescaled to it; the fixed costs
        measured through the job (`step_overhead_s`, `fsdp_unit_overhead_s`) stay."""
        share, among = self._factors(world)
        note = f"x{self.share(world):.2f} for {world} ranks on {self.cores} cores"
        if share != self.share(world):
            note += f", x{share / self.share(world):.2f} with every rank computing in the job"
        rates = self.rates.scaled(share, note)
        if not self.virtual:
            return rates
        return dataclasses.replace(
            rates,
            call_overhead_s=self.rates.call_overhead_s / share + self.ring_step_s * among,
            ring_row_seconds=self.rates.ring_row_seconds * among,
        )

    def hardware(self, topology: TopologyConfig) -> Hardware:
        """The virtual cluster of `topology` as measured: every link at the measured message
        latency and bandwidth (the attention engine's ring messages at the latency of the
        compute between them, `latency_curve`), each rank's compute at its share of the
        cores (class docstring), the ranks sharing the cores (`CorePool`): a rank
        computes faster while others wait."""
        cluster = build_topology(topology)
        share, among = self._factors(cluster.world_size)
        bandwidth = (self.link_bandwidth or 1e9) / among
        latency = (self.link_latency_s or 0.0) * among
        links = dataclasses.replace(
            topology,
            intra_node_gbytes_per_s=bandwidth / 1e9,
            nic_gbits_per_s=bandwidth * 8 / 1e9,
            intra_node_latency_us=latency * 1e6,
            inter_node_latency_us=latency * 1e6,
        )
        cluster = build_topology(links)
        step = None
        if self.step_latency_s is not None and self.step_bandwidth:
            step = (self.step_latency_s * among, self.step_bandwidth / among)
        pool = CorePool(cluster.world_size, share) if self.virtual else None
        curve = tuple((c * among, s * among) for c, s in self.latency_curve)
        return Hardware(cluster, self.job_rates(cluster.world_size), step, pool, curve)

    def table(self) -> str:
        lines = [f"{'op':<20}{'size':>9}{'GFLOP or MB':>13}{'ms':>10}{'GFLOP/s or GB/s':>17}"]
        for m in self.measurements:
            if isinstance(m, LinkPoint):
                lines.append(f"{m.op:<20}{m.nbytes:>9}{m.nbytes / 1e6:>13.3f}"
                             f"{m.seconds * 1e3:>10.3f}{'':>17}")  # fmt: skip
                continue
            rate = f"{m.flops / m.seconds / 1e9:>17.2f}" if m.flops else f"{'':>17}"
            lines.append(f"{m.op:<20}{m.size:>9}{m.flops / 1e9:>13.3f}{m.seconds * 1e3:>10.3f}"
                         + rate)  # fmt: skip
        r = self.rates
        lines.append(
            f"fit: attention (longest blocks) forward {r.attention_forward / 1e9:.2f} GFLOP/s, "
            f"backward {r.attention_backward / 1e9:.2f} GFLOP/s, matmul {r.matmul / 1e9:.2f} "
            f"GFLOP/s, call {r.call_overhead_s * 1e6:.1f} us, element-wise "
            f"{r.pointwise / 1e9:.3f} G elements/s, optimizer "
            f"{r.optimizer_param_seconds * 1e9:.2f} ns/parameter, compute x{r.contention:.2f} "
            f"while messages move, ZipCCL codec {r.codec_bytes_s / 1e9:.2f} GB/s"
        )
        if self.link_bandwidth:
            lines.append(
                f"fit: {self.ranks} ranks on {self.cores} cores, each computing at "
                f"{self.share(self.ranks):.2f} of a core{self._alone_note()}: message "
                f"{self.link_latency_s * 1e6:.0f} us + bytes / {self.link_bandwidth / 1e9:.2f} "
                f"GB/s; all-gather step {self.step_latency_s * 1e6:.0f} us + bytes / "
                f"{self.step_bandwidth / 1e9:.2f} GB/s"
            )
        if self.latency_curve:
            after = ", ".join(
                f"{s * 1e3:.2f} ms after {c * 1e3:.1f} ms" for c, s in self.latency_curve
            )
            lines.append(f"fit: message latency by the compute between messages: {after}")
        if self.job_share:
            lines.append(
                f"inside a training job a rank computes at x{self.job_share:.2f} of that"
                f"{self._pairs_note()}; "
                f"fixed step cost {r.step_overhead_s * 1e3:.1f} ms, FSDP2 "
                f"{r.fsdp_unit_overhead_s * 1e3:.1f} ms per unit"
            )
        return "\n".join(lines)


def measure_compute(
    shape: ModelShape, device: torch.device, repeats: int
) -> tuple[Measurement, list, list, list, float, Measurement]:
    """(call, attention, matmul, model measurements, optimizer seconds per parameter,
    codec) of one process (one thread on CPU: one virtual GPU is one single-threaded
    process)."""
    dtype = calibration_dtype(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        call = measure_call(shape, device, dtype, repeats)
        attention = measure_attention(shape, device, dtype, repeats)
        matmul = measure_matmul(shape, device, dtype, repeats)
        model, optimizer = measure_model(shape, device, dtype, repeats)
        codec = measure_codec(device, dtype, repeats)
    finally:
        torch.set_num_threads(threads)
    return call, attention, matmul, model, optimizer, codec


def calibrate(
    config: Config, device: torch.device, repeats: int = 5, link_rounds: int = LINK_ROUNDS
) -> Calibration:
    """Measure and fit the rates of `device` for `config.model` (bf16 on a GPU, fp32 on CPU,
    as training runs) and, on CPU, the links among the processes of `config.topology`
    (each point the median of `link_rounds` measurements) and the attention engine's ring
    step among them."""
    shape = build_shape(config.model)
    ranks = build_topology(config.topology).world_size
    call, attention, matmul, model, optimizer, codec = measure_compute(shape, device, repeats)
    _, matmul_rate = fit(matmul)
    kinds = curves(attention, call.seconds)
    longest = {kind: points[-1][1] for kind, points in kinds}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    rates = ComputeRates(
        longest["forward_causal"],
        longest["backward_causal"],
        matmul_rate,
        call.seconds,
        f"calibrated: {name}",
        curves=kinds,
        pointwise=pointwise_rate(shape, model, matmul_rate),
        optimizer_param_seconds=optimizer,
        curve_heads=curve_heads(shape, device),
        codec_bytes_s=codec.size / codec.seconds,
    )
    measured = [call, *attention, *matmul, *model, codec]
    out = Calibration(rates, measurements=measured, cores=cpu_count())
    if device.type == "cpu":
        out.ranks = max(2, ranks)
        probe, _ = ShareProbe.calibrate(shape, out.ranks)
        out.alone_step_s = probe.alone_s
        links, out.core_share = probe.around(lambda: measure_links(out.ranks, rounds=link_rounds))
        out.rates = dataclasses.replace(out.rates, contention=contention(links))
        out.link_latency_s, out.link_bandwidth = fit_link(links, "message")
        out.step_latency_s, out.step_bandwidth = fit_link(links, "all_gather_step")
        out.latency_curve = latency_curve(links, out.link_latency_s, out.link_bandwidth)
        out.measurements += links
        if ranks > 1:
            out = with_ring_step(config, out)
    return out


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
