"""`ray-zep bench calibrate`: measure this device's attention and matmul rates.

Runs the attention kernels training would select (flash-attn on a GPU with bf16,
the torch reference otherwise) forward and backward on packed causal batches of
the configured model's heads, and the model's matmul shapes, at several sizes.
Per operation, `seconds = overhead + flops / rate` is fitted by least squares
over the sizes (FLOPs counted as the simulator counts them). On CPU it also
measures a gloo point-to-point link between two processes (`seconds = latency +
bytes / bandwidth`), which is what a virtual cluster's ranks send over.

Writes `calibration.json` (the `ComputeRates` the simulator loads, plus the
link fit) and prints the measurements.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ray_zep.attention.kernels import select_backward, select_kernel
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.costmodel import BACKWARD_ATTENTION_FACTOR, ComputeRates
from ray_zep.dist.launch import free_port
from ray_zep.model.shapes import ModelShape

ATTENTION_LENGTHS = (64, 128, 256, 512)
"""Sequence lengths of the packed causal batches (each batch holds TOKENS tokens)."""
MATMUL_TOKENS = (256, 512, 1024, 2048)
TOKENS = 2048
LINK_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)


@dataclass
class Measurement:
    op: str
    size: int
    flops: float
    seconds: float


def fit(points: list[Measurement]) -> tuple[float, float]:
    """(overhead seconds >= 0, rate) of `seconds = overhead + amount / rate`."""
    x = np.array([p.flops for p in points])
    y = np.array([p.seconds for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # noise: fall back to a pure rate through the origin
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return float(intercept), 1.0 / float(slope)


def _timed(repeats: int, fn, *args, **kwargs) -> float:
    """Median seconds of `fn(*args, **kwargs)` after one warm-up call."""
    fn(*args, **kwargs)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn(*args, **kwargs)
        sync()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure_attention(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[Measurement]:
    kernel = select_kernel("auto", device, dtype)
    backward = select_backward(kernel)
    heads, kv_heads, dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
    out = []
    generator = torch.Generator().manual_seed(0)
    for length in ATTENTION_LENGTHS:
        seqs = PackedSeqs.from_lengths([length] * (TOKENS // length), device)

        def rand(h):
            return torch.randn((TOKENS, h, dim), generator=generator).to(device, dtype)

        q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
        flops = 4.0 * (TOKENS // length) * length * (length + 1) / 2 * heads * dim
        seconds = _timed(repeats, kernel, q, k, v, seqs, seqs, causal=True)
        out.append(Measurement("attention_forward", length, flops, seconds))
        o, lse = kernel(q, k, v, seqs, seqs, causal=True)
        dout = torch.randn_like(o)
        seconds = _timed(repeats, backward, dout, q, k, v, o, lse, seqs, seqs, True)
        out.append(
            Measurement("attention_backward", length, BACKWARD_ATTENTION_FACTOR * flops, seconds)
        )
    return out


def measure_matmul(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[Measurement]:
    weight = torch.randn((shape.dim, shape.ffn_dim), device=device, dtype=dtype)
    out = []
    for tokens in MATMUL_TOKENS:
        x = torch.randn((tokens, shape.dim), device=device, dtype=dtype)
        seconds = _timed(repeats, torch.matmul, x, weight)
        out.append(Measurement("matmul", tokens, 2.0 * tokens * shape.dim * shape.ffn_dim, seconds))
    return out


def _link_worker(rank: int, port: int, repeats: int, result) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for nbytes in LINK_BYTES:
        buf = torch.zeros(nbytes // 4)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - started) / 2)
        if rank == 0:
            result.append((nbytes, float(np.median(times[1:]))))
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


def measure_gloo_link(repeats: int) -> list[Measurement]:
    """One-way time of gloo messages between two local processes (ping-pong / 2)."""
    import torch.multiprocessing as mp

    port = free_port()
    with mp.Manager() as manager:
        result = manager.list()
        mp.spawn(_link_worker, args=(port, repeats, result), nprocs=2, join=True)
        return [Measurement("gloo_link", n, float(n), s) for n, s in result]


@dataclass
class Calibration:
    rates: ComputeRates
    link_latency_s: float | None
    link_bandwidth: float | None
    measurements: list[Measurement]

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            **asdict(self.rates),
            "link_latency_s": self.link_latency_s,
            "link_bandwidth": self.link_bandwidth,
            "measurements": [asdict(m) for m in self.measurements],
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A `calibration.json` written by `save` (measurements are not read back)."""
        rates = ComputeRates.load(path)
        record = json.loads(Path(path).read_text())
        return cls(rates, record.get("link_latency_s"), record.get("link_bandwidth"), [])

    def table(self) -> str:
        lines = [f"{'op':<20}{'size':>9}{'GFLOP or MB':>13}{'ms':>10}{'GFLOP/s or GB/s':>17}"]
        for m in self.measurements:
            scale = 1e9 if m.op != "gloo_link" else 1e6
            lines.append(
                f"{m.op:<20}{m.size:>9}{m.flops / scale:>13.3f}{m.seconds * 1e3:>10.3f}"
                f"{m.flops / m.seconds / 1e9:>17.2f}"
            )
        r = self.rates
        lines.append(
            f"fit: attention forward {r.attention_forward / 1e9:.2f} GFLOP/s, backward "
            f"{r.attention_backward / 1e9:.2f} GFLOP/s, matmul {r.matmul / 1e9:.2f} GFLOP/s, "
            f"call overhead {r.call_overhead_s * 1e6:.1f} us"
        )
        if self.link_bandwidth:
            lines.append(
                f"fit: gloo link {self.link_latency_s * 1e6:.1f} us + bytes / "
                f"{self.link_bandwidth / 1e9:.2f} GB/s"
            )
        return "\n".join(lines)


def calibrate(shape: ModelShape, device: torch.device, repeats: int = 5) -> Calibration:
    """Measure and fit the rates of `device` (bf16 on a GPU, fp32 on CPU, as training runs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # one virtual GPU = one process with one thread
    try:
        attention = measure_attention(shape, device, dtype, repeats)
        matmul = measure_matmul(shape, device, dtype, repeats)
    finally:
        torch.set_num_threads(threads)
    overhead, forward = fit([m for m in attention if m.op == "attention_forward"])
    _, backward = fit([m for m in attention if m.op == "attention_backward"])
    _, matmul_rate = fit(matmul)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    rates = ComputeRates(forward, backward, matmul_rate, overhead, f"calibrated: {name}")
    measurements = attention + matmul
    latency = bandwidth = None
    if device.type == "cpu":
        link = measure_gloo_link(repeats)
        latency, bandwidth = fit(link)
        measurements += link
    return Calibration(rates, latency, bandwidth, measurements)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
