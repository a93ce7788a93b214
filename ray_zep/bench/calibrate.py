"""`ray-zep bench calibrate`: measure this device and, on CPU, its virtual cluster's links.

Compute (`ray_zep.bench.calibrate_kernels`): attention rates per block kind and
length, the matmul rate, the element-wise rate of the model's own layers and the
optimizer's cost per parameter, on one thread per process on CPU (one virtual GPU
is one single-threaded process), in bf16 on a GPU. Links, on CPU
(`ray_zep.bench.calibrate_links`): messages and all-gathers among as many gloo
processes as the virtual cluster has ranks, computing between messages as
training does; and the model's training step in one process alone, against which
the share of a core each rank gets is probed (`ray_zep.core_share`).

Writes `calibration.json` (`ray_zep.sim.calibration.Calibration`): the `ComputeRates`
the simulator loads (`ray-zep simulate --calibration`), the link fits, and every
measurement.
"""

from __future__ import annotations

import dataclasses
import os

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
    ring_step_shares,
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
from ray_zep.config import Config
from ray_zep.core_share import ShareProbe
from ray_zep.costmodel import ComputeRates
from ray_zep.model_shapes import ModelShape, build_shape
from ray_zep.report.text_table import Column, render_table
from ray_zep.sim.calibration import Calibration
from ray_zep.topology import build_topology


def fit(points: list[Measurement]) -> tuple[float, float]:
    """(overhead seconds >= 0, rate) of `seconds = overhead + amount / rate`."""
    x = np.array([p.flops for p in points])
    y = np.array([p.seconds for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # noise: fall back to a pure rate through the origin
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return float(intercept), 1.0 / float(slope)


def _is_link(point: Measurement | LinkPoint) -> bool:
    return isinstance(point, LinkPoint)


MEASUREMENT_COLUMNS = (
    Column("op", "op"),
    Column("size", lambda m: m.nbytes if _is_link(m) else m.size),
    Column("GFLOP or MB", lambda m: m.nbytes / 1e6 if _is_link(m) else m.flops / 1e9, ".3f"),
    Column("ms", lambda m: m.seconds * 1e3, ".3f"),
    Column(
        "GFLOP/s or GB/s",
        lambda m: None if _is_link(m) or not m.flops else m.flops / m.seconds / 1e9,
        ".2f",
    ),
)


SHARE_COLUMNS = (
    Column("block", lambda r: r[0]),
    Column("length", lambda r: r[1]),
    Column("ring step TFLOP/s", lambda r: r[2] / 1e12, ".3f"),
    Column("kernel alone TFLOP/s", lambda r: r[3] / 1e12, ".3f"),
    Column("step / kernel", lambda r: r[4], ".1%"),
)


def calibration_table(calibration: Calibration) -> str:
    """Every measured point, then the fits."""
    lines = [render_table(calibration.measurements, MEASUREMENT_COLUMNS)]
    r = calibration.rates
    lines.append(
        f"fit: attention (longest blocks) forward {r.attention_forward / 1e9:.2f} GFLOP/s, "
        f"backward {r.attention_backward / 1e9:.2f} GFLOP/s, matmul {r.matmul / 1e9:.2f} "
        f"GFLOP/s, call {r.call_overhead_s * 1e6:.1f} us, element-wise "
        f"{r.pointwise / 1e9:.3f} G elements/s, optimizer "
        f"{r.optimizer_param_seconds * 1e9:.2f} ns/parameter, compute x{r.contention:.2f} "
        f"while messages move, ZipCCL codec {r.codec_bytes_s / 1e9:.2f} GB/s"
    )
    shares = ring_step_shares(calibration.measurements)
    if shares:
        lines.append("the engine's ring step against the kernel alone on the same block:")
        lines.append(render_table(shares, SHARE_COLUMNS))
    if calibration.link_bandwidth:
        c = calibration
        lines.append(
            f"fit: {c.ranks} ranks on {c.cores} cores, each computing at "
            f"{c.share(c.ranks):.2f} of a core{_alone_note(c)}: message "
            f"{c.link_latency_s * 1e6:.0f} us + bytes / {c.link_bandwidth / 1e9:.2f} "
            f"GB/s; all-gather step {c.step_latency_s * 1e6:.0f} us + bytes / "
            f"{c.step_bandwidth / 1e9:.2f} GB/s"
        )
    if calibration.latency_curve:
        after = ", ".join(
            f"{s * 1e3:.2f} ms after {c * 1e3:.1f} ms" for c, s in calibration.latency_curve
        )
        lines.append(f"fit: message latency by the compute between messages: {after}")
    if calibration.job_share:
        lines.append(
            f"inside a training job a rank computes at x{calibration.job_share:.2f} of that"
            f"{_pairs_note(calibration)}; "
            f"fixed step cost {r.step_overhead_s * 1e3:.1f} ms, FSDP2 "
            f"{r.fsdp_unit_overhead_s * 1e3:.1f} ms per unit"
        )
    return "\n".join(lines)


def _alone_note(calibration: Calibration) -> str:
    if calibration.alone_step_s is None:
        return ""
    return f" (the model's step {calibration.alone_step_s * 1e3:.0f} ms alone)"


def _pairs_note(calibration: Calibration) -> str:
    if len(calibration.job_shares) < 2:
        return ""
    return " (median of " + ", ".join(f"{s:.2f}" for s in calibration.job_shares) + ")"


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
