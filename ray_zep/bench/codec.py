"""`ray-zep bench codec`: ratio and speed of the ZipCCL codec next to general-purpose codecs.

Data: Gaussian BF16 at several σ, ReLU-like activations, and real tensors of
the configured model after a few training steps (weights, gradients and the
hidden states between blocks, as BF16 the way GPU training communicates them,
and the gradients also as the FP32 this CPU trains in). Codecs: ours (the
native kernel of the data's device, and the torch reference), zstd level 3,
lz4 and blosc2 (each single-threaded, like ours), where installed
(`pip install 'ray-zep[bench]'`). Every round trip is checked bit for bit.
Then messages of the sizes collectives send (64 KiB to 16 MiB of Gaussian
BF16) through ours and zstd level 3, where per-call overhead shows.
On a GPU our `compress` returns before the compressed length reaches the host
(two launches per chunk, no wait): "comp" times that call, "comp+len" the call
and the one read of the length a sender needs. Throughputs are original bytes
per second; each figure is the best of
`repeats` timed runs after a warm-up, a run repeating the call until it
takes at least `MIN_RUN_S` (so that small messages are timed reliably).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ray_zep.collectives import Compressed, compress, decompress, native
from ray_zep.collectives.format import float_format
from ray_zep.command_args import counts, names, optional_config, optional_config_args
from ray_zep.config import Config, Packing
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Placement, WeightsMode
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column

SIGMAS = (1e-3, 0.02, 1.0, 1e3)
CODECS = ("zipccl", "zipccl-torch", "zstd-3", "lz4", "blosc2")
MESSAGE_BYTES = (64 << 10, 1 << 20, 16 << 20)
MESSAGE_CODECS = ("zipccl", "zstd-3")
"""Codecs timed on the message sizes: ours on its public path against the goal's zstd-3."""
MESSAGE_PREFIX = "message "
MIN_RUN_S = 0.02
NAME = "codec"
HELP = "ZipCCL codec vs zstd, lz4, blosc2: ratio, GB/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    optional_config_args(parser)
    parser.add_argument("--values", type=int, default=1 << 22, help="values per synthetic tensor")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best is kept)")
    parser.add_argument("--train-steps", type=int, default=3, help="steps before real tensors")
    parser.add_argument("--codecs", help="default: " + ",".join(CODECS))
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where our codec runs (cpu)"
    )
    parser.add_argument(
        "--messages",
        help="message sizes in KiB, comma-separated (default "
        + ",".join(str(b >> 10) for b in MESSAGE_BYTES)
        + ")",
    )


def message_sizes(text: str | None) -> tuple[int, ...]:
    """`--messages` in bytes (`MESSAGE_BYTES` when not given).

    Raises:
        ConfigError: not a list of positive counts of KiB (`counts`).
    """
    if not text:
        return MESSAGE_BYTES
    return tuple(kib << 10 for kib in counts(text, "--messages"))


def run(args: argparse.Namespace) -> BenchResult:
    codecs = names(args.codecs, CODECS)
    spec = CodecBenchSpec(args.values, args.repeats, args.train_steps, codecs,
                          message_sizes(args.messages), args.device)  # fmt: skip
    config = optional_config(args)
    available = available_codecs(codecs, spec.device)
    skipped = [f"skipping {c}: {why}" for c, why in available.items() if why]
    tensors = {**synthetic_tensors(spec.values), **model_tensors(config, spec.train_steps)}
    rows = run_codec_bench(tensors, spec)
    spec_record = {**asdict(spec), "topology": config.topology.preset, "model": config.model.preset}
    return BenchResult.from_rows(
        NAME, spec_record, rows, COLUMNS, draw_codec_chart, notes=skipped, goals=goals(rows)
    )


@dataclass(frozen=True)
class CodecRow:
    data: str
    dtype: str
    codec: str
    device: str
    mbytes: float
    ratio: float
    compress_gbps: float
    compress_sized_gbps: float
    """Compress and then read the compressed length (on a GPU, `compress` returns before
    the dynamic parts' lengths reach the host; elsewhere the same call as compress)."""
    decompress_gbps: float
    both_gbps: float
    """Original bytes over (compress + decompress) time."""
    exact: bool


@dataclass(frozen=True)
class CodecBenchSpec:
    values: int = 1 << 22
    repeats: int = 3
    train_steps: int = 3
    codecs: tuple[str, ...] = CODECS
    messages: tuple[int, ...] = MESSAGE_BYTES
    """Message sizes in bytes (Gaussian BF16) timed with `MESSAGE_CODECS`."""
    device: str = "cpu"
    """Where our codec's tensors live: "cpu", or "cuda" (the CUDA kernel and the torch
    reference on the GPU); the general-purpose codecs always code a host copy."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.codecs) - set(CODECS))
        if unknown:
            raise ConfigError(f"bench codec --codecs: {unknown} not in {', '.join(CODECS)}")
        for key in ("values", "repeats", "train_steps"):
            if getattr(self, key) < 1:
                flag = key.replace("_", "-")
                raise ConfigError(f"bench codec --{flag}={getattr(self, key)}: must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench codec --device={self.device}: expected cpu | cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bench codec --device=cuda: torch sees no CUDA GPU")


def synthetic_tensors(values: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(values, generator=gen)
    out = {f"gaussian sigma={s:g}": (normal * s).bfloat16() for s in SIGMAS}
    out["relu activations"] = torch.relu(normal).bfloat16()
    return out


def model_tensors(config: Config, steps: int) -> dict[str, torch.Tensor]:
    """Weights, gradients and hidden states of the configured model after `steps` steps."""
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source
    from ray_zep.data.shards import shard_for
    from ray_zep.distributed import Comm
    from ray_zep.topology import build_topology
    from ray_zep.train.trainer import RankTrainer

    # one process, the reference: the config's model and data, whatever its placement
    parallel = config.parallel
    parallel.sequence, parallel.weights = Placement.SINGLE, WeightsMode.REPLICATED
    parallel.routing = parallel.remap = False
    config.data.packing = Packing.RANK  # one rank's batch, as the recorded figures used
    topology = build_topology(config.topology)
    comm = Comm.create(topology, 1, config.comm.timeout_s)
    stream = BatchStream.from_config(open_configured_source(config), config, 1)
    trainer = RankTrainer(config, comm, torch.device("cpu"))
    hidden: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: hidden.append(out.detach().reshape(-1)))
        for layer in trainer.model.layers
    ]
    for step in range(steps):
        hidden.clear()
        shard = shard_for(stream.next_batch(), config, topology)[0]
        if step + 1 < steps:
            trainer.train_step(shard)
        else:
            trainer.compute_gradients(shard)
    for hook in hooks:
        hook.remove()
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.params])
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.params])
    return {
        "weights": weights.bfloat16(),
        "gradients": grads.bfloat16(),
        "gradients fp32": grads.float(),
        "hidden states": torch.cat(hidden).bfloat16(),
    }


def message_tensors(sizes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Gaussian BF16 (sigma 0.02) messages of `sizes` bytes."""
    gen = torch.Generator().manual_seed(1)
    return {
        f"{MESSAGE_PREFIX}{_size_name(size)}": (
            torch.randn(size // 2, generator=gen) * 0.02
        ).bfloat16()
        for size in sizes
    }


def _size_name(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def run_codec_bench(tensors: dict[str, torch.Tensor], spec: CodecBenchSpec) -> list[CodecRow]:
    """Every codec of `spec` on every tensor, then the message sizes with `MESSAGE_CODECS`.

    Torch runs on one thread meanwhile, like every codec here.
    """
    message_codecs = tuple(c for c in spec.codecs if c in MESSAGE_CODECS)
    with _one_thread():
        rows = _run(tensors, spec.codecs, spec.repeats, spec.device)
        messages = message_tensors(spec.messages)
        return rows + _run(messages, message_codecs, spec.repeats, spec.device)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(
    tensors: dict[str, torch.Tensor], codecs: tuple[str, ...], repeats: int, device: str = "cpu"
) -> list[CodecRow]:
    rows = []
    for name, host in tensors.items():
        placed = host.to(device)
        for codec in codecs:
            tensor = placed if codec.startswith("zipccl") else host
            pair = _codec(codec, tensor)
            if pair is not None:
                rows.append(_measure(name, tensor, codec, *pair, repeats))
    return rows


def available_codecs(codecs: tuple[str, ...], device: str = "cpu") -> dict[str, str | None]:
    """Each codec and why it cannot run here (None: it can)."""
    probe = torch.zeros(8, dtype=torch.bfloat16)
    out = {}
    for c in codecs:
        tensor = probe.to(device) if c.startswith("zipccl") else probe
        out[c] = None if _codec(c, tensor) is not None else _missing(c, tensor.device)
    return out


def _missing(codec: str, device: torch.device) -> str:
    if codec == "zipccl":
        return native.unavailable_reason(device, float_format(torch.bfloat16)) or ""
    return f"module {_MODULES.get(codec)} not installed (pip install 'ray-zep[bench]')"


_MODULES = {"zstd-3": "zstandard", "lz4": "lz4.frame", "blosc2": "blosc2"}


def _codec(name: str, tensor: torch.Tensor) -> tuple[Callable, Callable] | None:
    """(compress, decompress) of `name` on `tensor`, or None when unavailable."""
    if name in ("zipccl", "zipccl-torch"):
        backend = "native" if name == "zipccl" else "torch"
        fmt = float_format(tensor.dtype)
        if backend == "native" and native.unavailable_reason(tensor.device, fmt):
            return None
        return (lambda: compress(tensor, backend=backend)), (
            lambda c: decompress(c, backend=backend)
        )
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError:
        return None
    raw = tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    if name == "zstd-3":
        zc, zd = module.ZstdCompressor(level=3), module.ZstdDecompressor()
        return (lambda: zc.compress(raw)), zd.decompress
    if name == "lz4":
        return (lambda: module.compress(raw)), module.decompress
    module.set_nthreads(1)
    size = tensor.element_size()
    return (lambda: module.compress(raw, typesize=size)), module.decompress


def _measure(data, tensor, codec, encode, decode, repeats) -> CodecRow:
    nbytes = tensor.numel() * tensor.element_size()
    packed = encode()
    sized = isinstance(packed, Compressed) and not packed.sizes_known  # before nbytes reads it
    restored = decode(packed)
    exact = _same_bits(tensor, restored)
    size = (
        packed.nbytes
        if hasattr(packed, "nbytes") and not isinstance(packed, bytes)
        else len(packed)
    )
    t_c = _best(encode, repeats, tensor.device)
    t_cs = _best(lambda: encode().resolve(), repeats, tensor.device) if sized else t_c
    t_d = _best(lambda: decode(packed), repeats, tensor.device)
    return CodecRow(
        data=data,
        dtype=str(tensor.dtype).removeprefix("torch."),
        codec=codec,
        device=tensor.device.type,
        mbytes=nbytes / 1e6,
        ratio=nbytes / size,
        compress_gbps=nbytes / t_c / 1e9,
        compress_sized_gbps=nbytes / t_cs / 1e9,
        decompress_gbps=nbytes / t_d / 1e9,
        both_gbps=nbytes / (t_c + t_d) / 1e9,
        exact=exact,
    )


def _same_bits(tensor: torch.Tensor, restored) -> bool:
    if isinstance(restored, torch.Tensor):
        if restored.device != tensor.device:  # the decoder left the tensor's device
            return False
        got, want = (t.contiguous().reshape(-1).view(torch.uint8) for t in (restored, tensor))
        return torch.equal(got, want)
    return bytes(restored) == tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _best(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call: the best of `repeats` runs of enough calls to last `MIN_RUN_S`."""
    calls = max(1, math.ceil(MIN_RUN_S / max(_timed(fn, 1, device), 1e-9)))
    return min(_timed(fn, calls, device) for _ in range(max(repeats, 1))) / calls


def _timed(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def goals(rows: list[CodecRow]) -> list[tuple[str, bool]]:
    """The issue's codec goals, checked on these rows."""
    ours = {r.data: r for r in rows if r.codec == "zipccl" and r.device == "cpu"}
    zstd = {r.data: r for r in rows if r.codec == "zstd-3"}
    gaussian = [r for d, r in ours.items() if d.startswith("gaussian")]
    out = []
    if gaussian:
        worst = min(r.ratio for r in gaussian)
        out.append(
            (f"ratio >= 1.40 on Gaussian BF16 at every sigma (worst {worst:.3f})", worst >= 1.40)
        )
    shared = [d for d in ours if d in zstd and d.startswith("gaussian")]
    if shared:
        ok = all(
            ours[d].both_gbps > zstd[d].both_gbps and ours[d].ratio > zstd[d].ratio for d in shared
        )
        out.append(("CPU codec faster than zstd-3 (compress + decompress) and compresses more", ok))
    if "gradients" in ours and "gradients" in zstd:
        us, them = ours["gradients"], zstd["gradients"]
        out.append(
            (
                f"model gradients (BF16): ratio {us.ratio:.3f} >= zstd-3's {them.ratio:.3f} and "
                f"c+d {us.both_gbps:.3f} > {them.both_gbps:.3f} GB/s",
                us.ratio >= them.ratio and us.both_gbps > them.both_gbps,
            )
        )
    out += _message_goals(ours, zstd)
    gpu = [r for r in rows if r.codec == "zipccl" and r.device == "cuda"]
    if gpu:
        big = max(gpu, key=lambda r: r.mbytes)
        out.append(
            (
                f"CUDA codec compresses >= 500 GB/s ({big.data}: {big.compress_gbps:.1f} GB/s)",
                big.compress_gbps >= 500,
            )
        )
    return out


def _message_goals(ours: dict[str, CodecRow], zstd: dict[str, CodecRow]) -> list[tuple[str, bool]]:
    """Each message size: our public round trip at least as fast as zstd-3's."""
    sizes = [d for d in ours if d.startswith(MESSAGE_PREFIX) and d in zstd]
    return [
        (
            f"{d}: c+d {ours[d].both_gbps:.3f} >= zstd-3's {zstd[d].both_gbps:.3f} GB/s",
            ours[d].both_gbps >= zstd[d].both_gbps,
        )
        for d in sizes
    ]


COLUMNS = (
    Column("data", "data"),
    Column("dtype", "dtype"),
    Column("codec", "codec"),
    Column("dev", "device"),
    Column("MB", "mbytes", ".1f"),
    Column("ratio", "ratio", ".3f"),
    Column("comp GB/s", "compress_gbps", ".3f"),
    Column("comp+len GB/s", "compress_sized_gbps", ".3f"),
    Column("dec GB/s", "decompress_gbps", ".3f"),
    Column("c+d GB/s", "both_gbps", ".3f"),
    Column("exact", lambda r: "yes" if r.exact else "NO"),
)


def draw_codec_chart(rows: list[CodecRow], path: Path) -> Path | None:
    """Ratio and compress+decompress throughput per data set, one bar per codec.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_codec, rows), size=(12.0, 7.6), rows=2)


def _draw_codec(rows: list[CodecRow], figure: Any, axes: Any) -> None:
    data = list(dict.fromkeys(r.data for r in rows))
    codecs = list(dict.fromkeys(r.codec for r in rows))
    table = {(r.data, r.codec): r for r in rows}

    def values(attr: str) -> list[list[float | None]]:
        return [
            [getattr(table[(d, c)], attr) if (d, c) in table else None for c in codecs]
            for d in data
        ]

    ratio, speed = values("ratio"), values("both_gbps")
    grouped_bars(axes[0, 0], data, codecs, ratio, title="compression ratio", ylabel="ratio (x)")
    title = "compress + decompress throughput"
    grouped_bars(axes[1, 0], data, codecs, speed, title=title, ylabel="GB/s", xlabel="tensor")
