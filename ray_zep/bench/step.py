"""`ray-zep bench step`: one rank's training step on this process's device.

For every tokens-per-step of `--tokens` and batch shape of `--batches`, the
configured model trains `--steps` steps on one rank through the trainer's step
(`RankTrainer.train_step`: the step every Ray worker of `ray-zep train` runs;
bf16 autocast on a GPU, fp32 on CPU), on batches drawn as the data actor draws
them (`BatchStream`, `shard_for`). Batch shapes:

- `packed`: synthetic documents of the ArXiv row of the Zeppelin paper's Table 2,
  their lengths scaled so that the longest bin fills a step, rank-packed into the
  step's tokens (longer documents split at L);
- `long`: one sequence per step: documents of at least 64 x L tokens (ArXiv
  lengths x 64 L / 1024), cut into L-token pieces, each trained as one sequence.

Reported per case: the mean tokens a step holds (a packed step holds fewer than its
L: whole documents fill it) and sequences per step, the steady seconds per step (after
`WARM_UP` steps, synchronised), tokens/s of the tokens held, MFU (the trainer's model
FLOPs, 3 x forward with causal attention, over the device's dense BF16 peak:
`metrics.peak_tflops` or the datasheet of a known GPU), the allocator's highest peak
over the steady steps against the memory model's highest for the same shards. A case
that runs out of memory is a row saying so, with the model's prediction.

`--width 3b|7b` and `--layers N` pick the model (on a GPU the default is the 3B
width with 4 layers, `GPU_MODEL`; `7b` is the 7B preset's width, 32 heads of
128); `--loss-chunk N` computes the loss N tokens at a time
(`model.loss_chunk_tokens`) and `--compile` compiles every block's regions
(`model.compile`). The table and the JSON name all four. The memory model
prices the chunked loss as it runs (one chunk's logits, the hidden states' and
the head weight's gradients), not the whole batch's logits.

`--checkpointing none,selective,...` plays each activation checkpointing mode as a case
of its own (on the config's `train.checkpoint_blocks`, every block by default). Beside
the measured step each row sets the simulator's step for the same shards at the
device's preset rates (`ray_zep.bench.step_model`: what `bench scale`'s cluster rows
are built from; NaN on a CPU), and what backward recomputes in it against what the
device spent over the case without checkpointing (where `none` was played).

Not the Ray path itself: no data actor, no checkpoint, no process group (one rank).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ray_zep.bench.step_model import modelled_step
from ray_zep.command_args import (
    at_least,
    counts,
    known,
    names,
    optional_config,
    optional_config_args,
)
from ray_zep.config import Config, config_from_dict, config_to_dict, load_config
from ray_zep.costmodel import datasheet_peak_flops
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.options import ActivationCheckpointing
from ray_zep.parallel.axes import WeightsMode
from ray_zep.partition import registry
from ray_zep.partition.spec import Role
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.progress import ProgressLine
from ray_zep.report.text_table import Column
from ray_zep.sim.checkpointing import checkpointing_label

NAME = "step"
HELP = "time one rank's training step on this device"
BATCHES = ("packed", "long")
CHECKPOINTING = tuple(mode.value for mode in ActivationCheckpointing)
WARM_UP = 2
"""Steps left out of the timing (allocator, kernel selection, autotuning)."""
GPU_MODEL = (
    "model.preset=3b",
    "model.n_layers=4",
    "model.n_heads=25",
    "model.n_kv_heads=5",
)
"""The default model on a GPU: the 3B preset's width (dim 3200, FFN 8640, vocab 32k)
with heads of 128 (its 32 heads of 100 have no flash kernel: head dims must be
multiples of 8) and 4 of its 26 layers, so that 64k tokens per step fit one GPU
without activation checkpointing."""
WIDTHS = {
    "3b": GPU_MODEL[:1] + GPU_MODEL[2:],
    "7b": ("model.preset=7b",),
}
"""`--width`: the model keys of each width (its layers come from `--layers`)."""
GPU_TOKENS = (8192, 16384, 32768, 65536)
CPU_TOKENS = (256, 512)
LONG_SCALE = 64
"""`long` batches: document lengths x 64 L / 1024 (every document spans many steps)."""
GiB = float(1 << 30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    optional_config_args(parser)
    parser.add_argument(
        "--tokens",
        help="tokens per step, comma-separated (default: "
        + ",".join(map(str, GPU_TOKENS)) + " on a GPU, " + ",".join(map(str, CPU_TOKENS))
        + " on CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--batches", default=",".join(BATCHES), help="packed (several documents) and/or long"
    )
    parser.add_argument("--steps", type=int, default=6, help=f"steps per case ({WARM_UP} warm-up)")
    parser.add_argument(
        "--width", choices=sorted(WIDTHS), help="model width: the 3B (heads of 128) or 7B preset's"
    )
    parser.add_argument("--layers", type=int, help="transformer blocks (model.n_layers)")
    parser.add_argument(
        "--loss-chunk",
        type=int,
        help="tokens per chunk of the loss (model.loss_chunk_tokens; 0: whole batch)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each block's regions (model.compile)"
    )
    parser.add_argument(
        "--checkpointing",
        help="activation checkpointing modes to play, comma-separated, each on the config's "
        "blocks (train.activation_checkpointing: " + ", ".join(CHECKPOINTING) + "; default: "
        "the config's own)",
    )  # fmt: skip


@dataclass(frozen=True)
class StepRow:
    device: str
    model: str
    loss_chunk: int
    compiled: bool
    checkpointing: str
    batch: str
    tokens: int
    held: float
    sequences: float
    seconds: float
    tokens_per_s: float
    mfu: float
    measured_gib: float
    modelled_gib: float
    loss: float
    modelled_s: float = float("nan")
    """The simulator's step for the same shards at the device's preset rates
    (`ray_zep.bench.step_model`; NaN without a preset)."""
    modelled_recompute_s: float = float("nan")
    """What backward recomputes in that modelled step."""
    over_none_s: float = float("nan")
    """Measured seconds over the same case without checkpointing (NaN where `none` was
    not played): what the recomputation cost on the device."""
    error: str = ""

    @property
    def model_error(self) -> float:
        if not self.measured_gib:
            return float("nan")
        return self.modelled_gib / self.measured_gib - 1.0

    @property
    def step_model_error(self) -> float:
        """The modelled step against the measured one."""
        return self.modelled_s / self.seconds - 1.0 if self.seconds else float("nan")


COLUMNS = [
    Column("model", "model", "<10"),
    Column("loss chunk", "loss_chunk", ">10"),
    Column("compiled", "compiled", "<8"),
    Column("ckpt", "checkpointing", "<9"),
    Column("batch", "batch", "<8"),
    Column("tokens/step", "tokens", ">12"),
    Column("held/step", "held", ">10.0f"),
    Column("seqs/step", "sequences", ">10.1f"),
    Column("s/step", "seconds", ">9.3f"),
    Column("tokens/s", "tokens_per_s", ">11.0f"),
    Column("MFU", "mfu", ">7.1%"),
    Column("peak GiB", "measured_gib", ">9.2f"),
    Column("model GiB", "modelled_gib", ">10.2f"),
    Column("model err", "model_error", ">10.1%"),
    Column("model s", "modelled_s", ">8.3f"),
    Column("s err", "step_model_error", ">7.1%"),
    Column("recompute s", "over_none_s", ">12.3f"),
    Column("model rc s", "modelled_recompute_s", ">11.3f"),
    Column("note", "error", "<"),
]


def run(args: argparse.Namespace) -> BenchResult:
    from ray_zep.train.build import resolve_device

    base = _base_config(args)
    device = resolve_device(base.train.device)
    default = GPU_TOKENS if device.type == "cuda" else CPU_TOKENS
    tokens = list(counts(args.tokens, "--tokens") if args.tokens else default)
    at_least("--tokens", min(tokens), 2, "train.tokens_per_rank")
    batches = names(args.batches, BATCHES)
    known("--batches", batches, BATCHES)
    if args.steps <= WARM_UP:
        raise ConfigError(f"--steps={args.steps}: more than the {WARM_UP} warm-up steps")
    peak = _peak_flops(base, device)
    modes = _checkpointing(args, base)
    cases = [(n, batch, mode) for n in tokens for batch in batches for mode in modes]
    rows = []
    with ProgressLine(len(cases), "cases", sys.stdout) as bar:
        for n, batch, mode in cases:
            row = run_case(_case_config(base, batch, n, args.steps, mode), device, batch, peak)
            rows.append(row)
            bar.update(len(rows), _case_line(row))
    rows = _with_recompute_measured(rows)
    name = _name(device)
    flash = _flash_impl(device)
    note = (
        f"device: {name}; peak {peak / 1e12:.0f} TFLOP/s dense BF16"
        if peak
        else f"device: {name}; no known peak (set metrics.peak_tflops): MFU not computed"
    )
    notes = [note] + ([f"flash attention: {flash}"] if flash else [])
    spec = {"device": name, "tokens": tokens, "batches": batches, "steps": args.steps,
            "peak_flops": peak, "model": config_to_dict(base)["model"],
            "loss_chunk_tokens": base.model.loss_chunk_tokens,
            "compile": base.model.compile, "flash_impl": flash,
            "checkpointing": [m.value for m in modes]}  # fmt: skip
    records = [
        asdict(r) | {"model_error": r.model_error, "step_model_error": r.step_model_error}
        for r in rows
    ]
    return BenchResult.from_rows(NAME, spec, rows, COLUMNS, draw, records=records, notes=notes)


def _base_config(args: argparse.Namespace) -> Config:
    """The user's config; without one, the demo config with `GPU_MODEL` on a GPU; then
    the flags' model keys over it.

    Raises:
        ConfigError: `--layers` or `--loss-chunk` out of range.
    """
    flags = _flag_overrides(args)
    if args.config is None and not args.overrides and torch.cuda.is_available():
        default = [GPU_MODEL[1]] if args.width else list(GPU_MODEL)  # a width's own heads
        return load_config(None, [*default, *flags])
    args.overrides = [*args.overrides, *flags]
    return optional_config(args)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    """The model keys `--width`, `--layers`, `--loss-chunk` and `--compile` set."""
    keys = list(WIDTHS[args.width]) if args.width else []
    if args.layers is not None:
        at_least("--layers", args.layers, 1, "model.n_layers")
        keys.append(f"model.n_layers={args.layers}")
    if args.loss_chunk is not None:
        at_least("--loss-chunk", args.loss_chunk, 0, "model.loss_chunk_tokens")
        keys.append(f"model.loss_chunk_tokens={args.loss_chunk}")
    if args.compile:
        keys.append("model.compile=true")
    return keys


def _checkpointing(args: argparse.Namespace, base: Config) -> list[ActivationCheckpointing]:
    """The modes of `--checkpointing`, or the config's own.

    Raises:
        ConfigError: a mode that is not one of `CHECKPOINTING`.
    """
    if not args.checkpointing:
        return [base.train.activation_checkpointing]
    modes = names(args.checkpointing, CHECKPOINTING)
    known("--checkpointing", modes, CHECKPOINTING)
    return [ActivationCheckpointing(mode) for mode in modes]


def _case_line(row: StepRow) -> str:
    """A finished case in one line, printed as it ends (a run cut short keeps them)."""
    case = f"{row.model} {row.tokens} tokens {row.batch} ckpt {row.checkpointing}"
    if row.error:
        return f"{case}: {row.error} (model {row.modelled_gib:.2f} GiB)"
    return (f"{case}: {row.seconds:.3f} s/step (model {row.modelled_s:.3f}), peak "
            f"{row.measured_gib:.2f} GiB (model {row.modelled_gib:.2f})")  # fmt: skip


def _with_recompute_measured(rows: list[StepRow]) -> list[StepRow]:
    """Each row with its measured seconds over its case without checkpointing."""
    plain = {(r.tokens, r.batch): r.seconds for r in rows if r.checkpointing == "none"}
    return [
        replace(r, over_none_s=r.seconds - plain.get((r.tokens, r.batch), math.nan)) for r in rows
    ]


def _model_name(config: Config) -> str:
    """`3b x4`: the preset and the number of layers of the case's model."""
    return f"{config.model.preset} x{build_shape(config.model).n_layers}"


def _peak_flops(config: Config, device: torch.device) -> float:
    if config.metrics.peak_tflops:
        return config.metrics.peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    return datasheet_peak_flops(torch.cuda.get_device_name(device)) or 0.0


def _case_config(
    base: Config, batch: str, tokens: int, steps: int, mode: ActivationCheckpointing
) -> Config:
    plain = config_to_dict(base)
    plain["topology"].update(nodes=1, gpus_per_node=1)
    packed = registry.playing(Role.PACKED).name
    plain["parallel"].update(sequence=packed, weights=WeightsMode.REPLICATED.value,
                             routing=False, remap=False)  # fmt: skip
    plain["comm"]["compression"] = "off"
    plain["data"].update(source="synthetic:arxiv", packing="rank", overlong="split",
                         max_doc_tokens=None)  # fmt: skip
    longest = 64 * 1024  # Table 2's longest ArXiv bin, in tokens
    scale = LONG_SCALE * tokens / 1024 if batch == "long" else tokens / longest
    plain["data"]["length_scale"] = scale
    plain["train"].update(tokens_per_rank=tokens, steps=steps, micro_batches=1,
                          checkpoint_every=0)  # fmt: skip
    if mode is not base.train.activation_checkpointing:  # the config's blocks, another mode
        plain["train"].update(activation_checkpointing=mode.value, checkpoint_rest="none")
        if mode is ActivationCheckpointing.NONE:
            plain["train"]["checkpoint_blocks"] = 0
    plain["metrics"].update(memory_every=1, progress=False)
    return config_from_dict(plain)


def run_case(config: Config, device: torch.device, batch: str, peak: float) -> StepRow:
    """Train `config.train.steps` steps of one rank; the row of its steady steps."""
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source
    from ray_zep.data.shards import shard_for
    from ray_zep.topology import build_topology
    from ray_zep.train.accounting import modelled_memory
    from ray_zep.train.setup import create_comm
    from ray_zep.train.trainer import RankTrainer

    topology = build_topology(config.topology)
    comm = create_comm(config, topology)
    stream = BatchStream.from_config(open_configured_source(config), config, 1)
    tokens = config.train.tokens_per_rank
    trainer, shard = None, None
    seconds, sequences, held, peaks, modelled, flops, losses = [], [], [], [], [], [], []
    lengths: list[list[int]] = []
    try:
        trainer = RankTrainer(config, comm, device)
        for _ in range(config.train.steps):
            shard = shard_for(stream.next_batch(), config, topology)[0]
            _sync(device)
            started = time.perf_counter()
            stats = trainer.train_step(shard)
            _sync(device)
            seconds.append(time.perf_counter() - started)
            sequences.append(len(shard.lengths))
            lengths.append([int(n) for n in shard.lengths])
            held.append(shard.num_tokens)
            peaks.append(float(stats.memory["measured"][0]))
            modelled.append(float(stats.memory["modelled"][0]))  # this step's shard
            flops.append(stats.model_flops)
            losses.append(stats.loss)
    except torch.OutOfMemoryError:
        model = modelled_memory(shard, trainer.ctx).total if trainer and shard else 0.0
        del trainer
        _release(device)
        nan = float("nan")
        step = modelled_step(config, _name(device), lengths[WARM_UP:] or lengths)
        return StepRow(*_case(config, device), batch, tokens, nan, nan, nan, nan, nan, 0.0,
                       model / GiB, nan, step.step_seconds, step.recompute_seconds,
                       error="out of memory")  # fmt: skip
    del trainer
    _release(device)
    steady = slice(WARM_UP, None)
    step_s = statistics.mean(seconds[steady])
    mean_flops = statistics.mean(flops[steady])
    mean_held = statistics.mean(held[steady])
    step = modelled_step(config, _name(device), lengths[steady])
    # the steady steps' highest peak against the model's highest for the same shards
    return StepRow(
        *_case(config, device),
        batch,
        tokens,
        mean_held,
        statistics.mean(sequences[steady]),
        step_s,
        mean_held / step_s,
        mean_flops / step_s / peak if peak else float("nan"),
        max(peaks[steady]) / GiB,
        max(modelled[steady]) / GiB,
        losses[-1],
        step.step_seconds,
        step.recompute_seconds,
    )


def _case(config: Config, device: torch.device) -> tuple[str, str, int, bool, str]:
    """The row's device, model, loss chunk, compile and checkpointing columns."""
    model = config.model
    ckpt = checkpointing_label(config, build_shape(model))
    return _name(device), _model_name(config), model.loss_chunk_tokens, model.compile, ckpt


def _flash_impl(device: torch.device) -> str:
    """The implementation torch's flash ops ran on this device (FA2/FA3/FA4, with FA2's
    reason), or "" where they did not run (CPU, an older GPU)."""
    from ray_zep.attention import torch_flash

    return torch_flash.use_fastest_impl(device) if torch_flash.available(device) else ""


def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def draw(rows: list[StepRow], path: Path) -> Path | None:
    """Tokens/s per tokens-per-step, one bar per batch shape (None: no matplotlib)."""
    return save_figure(path, partial(_draw, rows), size=(10.0, 4.4))


def _draw(rows: list[StepRow], figure: Any, axes: Any) -> None:
    sizes = sorted({r.tokens for r in rows})
    shapes = sorted({r.batch for r in rows})
    by_case = {(r.tokens, r.batch): r for r in rows}
    values = [
        [None if by_case[n, b].error else by_case[n, b].tokens_per_s / 1e3 for b in shapes]
        for n in sizes
    ]
    title = f"one rank's training step, {rows[0].device}" if rows else "no rows"
    grouped_bars(axes[0, 0], [f"{n:,}" for n in sizes], shapes, values, title=title,
                 ylabel="k tokens/s", xlabel="tokens per step")  # fmt: skip
