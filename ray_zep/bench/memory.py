"""`ray-zep bench memory`: per-rank memory, modelled and measured, per weights mode.

Each case trains a few steps of the configured model on a virtual topology (one
gloo process per GPU, the trainer's own step) and measures the last step with
the trainer's probe (`ray_zep.train.memory_probe`): the peak of live tensors and
the most parameters + gradients + optimizer state held. The model
(`ray_zep.parallel.memory`) is computed for the same rank and tokens. Two goals
are checked and reported, met or not:

- sharded state: FSDP2's measured state peak is at most the replicated one
  divided by the ranks, plus one block's unsharded parameters (checked for
  every FSDP2 case: units per block hold a block's unsharded gradients too,
  units per projection one projection's);
- the model: within 10% of the measured peak, case by case.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ray_zep.bench.local_ranks import rank_context, start_ranks
from ray_zep.command_args import names, optional_config, optional_config_args
from ray_zep.config import (
    ActivationCheckpointing,
    Config,
    FsdpUnit,
    config_from_dict,
    config_to_dict,
    load_config,
)
from ray_zep.distributed.launch import free_port
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import WEIGHTS_AXES, Family, WeightsMode
from ray_zep.parallel.memory import FP32, block_params, state_bytes
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column
from ray_zep.run_memory import memory_inputs
from ray_zep.topology import build_topology

NAME = "memory"
HELP = "per-rank memory, modelled and measured"
REPLICATED, FSDP = WeightsMode.REPLICATED.value, WeightsMode.FSDP.value
BLOCK, LINEAR = FsdpUnit.BLOCK.value, FsdpUnit.LINEAR.value
MODEL_TOLERANCE = 0.10
"""The model must be within 10% of the measured peak."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    optional_config_args(parser)
    parser.add_argument("--weights", default="replicated,fsdp", help="weights modes to run")
    parser.add_argument(
        "--checkpointing", default="none,full", help="train.activation_checkpointing values"
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per case; the last is measured")


def run(args: argparse.Namespace) -> BenchResult:
    if args.config is None and not args.overrides:  # the demo model on a virtual 1 x 8
        whole = ["parallel.sequence=whole", "parallel.routing=false", "parallel.remap=false"]
        sizes = ["topology.nodes=1", "topology.gpus_per_node=8", "data.packing=rank"]
        config = load_config(Path("conf/demo.yaml"), [*sizes, *whole])
    else:
        config = optional_config(args)
    if args.steps < 2:
        raise ConfigError(f"--steps={args.steps}: at least 2 (the first has no optimizer state)")
    weights, checkpointing = list(names(args.weights, ())), list(names(args.checkpointing, ()))
    known = [m.value for m in WeightsMode if WEIGHTS_AXES[m].family is Family.AUTOGRAD]
    for name in weights:
        if name not in known:
            raise ConfigError(f"--weights item {name!r}: choose from {', '.join(known)}")
    for name in checkpointing:
        if name not in [m.value for m in ActivationCheckpointing]:
            modes = ", ".join(m.value for m in ActivationCheckpointing)
            raise ConfigError(f"--checkpointing item {name!r}: choose from {modes}")
    rows = run_cases(config, cases(weights, checkpointing), args.steps)
    checks = goals(rows, config)
    spec = {"weights": weights, "checkpointing": checkpointing, "steps": args.steps}
    return BenchResult.from_rows(
        NAME,
        spec | {"goals": checks},
        rows,
        COLUMNS,
        draw,
        records=row_dicts(rows),
        goals=verdicts(checks),
    )


@dataclass(frozen=True)
class MemoryCase:
    weights: str
    checkpointing: str
    prefetch: bool = True
    unit: str = BLOCK
    """`parallel.fsdp_unit`."""

    @property
    def name(self) -> str:
        fetch = "" if self.weights == REPLICATED or self.prefetch else "-noprefetch"
        unit = "" if self.unit == BLOCK else f"-{self.unit}"
        return f"{self.weights}{unit}{fetch}/{self.checkpointing}"


@dataclass(frozen=True)
class MemoryRow:
    """One case: rank 0's figures (bytes) of the last step."""

    case: str
    weights: str
    checkpointing: str
    ranks: int
    tokens: int
    modelled: float
    measured: float
    state_measured: float
    state_modelled: float
    modelled_parts: dict
    measured_parts: dict

    @property
    def model_error(self) -> float:
        return self.modelled / self.measured - 1.0 if self.measured else float("nan")


def cases(weights: list[str], checkpointing: list[str]) -> list[MemoryCase]:
    """Every weights mode x checkpointing; FSDP2 modes with and without prefetch, and
    with a unit per projection."""
    out = []
    for w in weights:
        for c in checkpointing:
            out.append(MemoryCase(w, c))
            if w != REPLICATED:
                out += [MemoryCase(w, c, prefetch=False), MemoryCase(w, c, unit=LINEAR)]
    return out


def run_cases(config: Config, todo: list[MemoryCase], steps: int) -> list[MemoryRow]:
    """Train every case on `topology.nodes x topology.gpus_per_node` gloo processes."""
    ranks = build_topology(config.topology).world_size
    port = free_port()
    queue = rank_context().SimpleQueue()
    plain = config_to_dict(config)
    start_ranks(_rank_main, (ranks, port, plain, todo, steps, queue), ranks)
    return queue.get()


def _rank_main(rank, ranks, port, plain, todo, steps, queue) -> None:
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source
    from ray_zep.data.shards import shard_for
    from ray_zep.distributed.launch import init_process_group
    from ray_zep.train.setup import create_comm
    from ray_zep.train.trainer import RankTrainer

    torch.set_num_threads(1)
    base = config_from_dict(plain)
    init_process_group("gloo", rank, ranks, "127.0.0.1", port, 120.0, base.comm.timeout_s)
    rows = []
    for case in todo:
        config = _with(base, case, steps)
        topology = build_topology(config.topology)
        comm = create_comm(config, topology)
        stream = BatchStream.from_config(
            open_configured_source(config), config, topology.world_size
        )
        trainer = RankTrainer(config, comm, torch.device("cpu"))
        for _ in range(steps):
            shard = shard_for(stream.next_batch(), config, topology)[rank]
            stats = trainer.train_step(shard)
        measured = trainer.memory_probe.last
        modelled = stats.memory["parts"]["modelled"]
        rows.append(
            MemoryRow(
                case.name,
                case.weights,
                case.checkpointing,
                ranks,
                shard.num_tokens,
                modelled["total"],
                measured.get("peak", 0.0),
                measured.get("state_peak", 0.0),
                state_bytes(trainer.shape, memory_inputs(config, topology, shard.num_tokens)),
                modelled,
                measured,
            )
        )
        del trainer
        dist.barrier()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _with(config: Config, case: MemoryCase, steps: int) -> Config:
    plain = config_to_dict(config)
    plain["parallel"]["weights"] = case.weights
    plain["train"]["activation_checkpointing"] = case.checkpointing
    plain["train"]["steps"] = steps
    plain["metrics"]["memory_every"] = 1
    plain["parallel"]["prefetch"] = case.prefetch
    plain["parallel"]["fsdp_unit"] = case.unit
    return config_from_dict(plain)


def goals(rows: list[MemoryRow], config: Config) -> list[dict]:
    """The two goals, case by case: figures, limits and whether they are met."""
    shape = build_shape(config.model)
    block = max(block_params(shape, i) for i in range(shape.n_layers)) * FP32
    out = []
    by_case = {(r.weights, r.checkpointing): r for r in rows}
    for row in rows:
        out.append(
            {
                "goal": "model within 10% of measured",
                "case": row.case,
                "value": row.model_error,
                "limit": MODEL_TOLERANCE,
                "met": abs(row.model_error) <= MODEL_TOLERANCE,
            }
        )
        replicated = by_case.get((REPLICATED, row.checkpointing))
        if row.weights == FSDP and replicated is not None:
            limit = replicated.state_measured / row.ranks + block
            out.append(
                {
                    "goal": "fsdp state <= replicated / ranks + one block",
                    "case": row.case,
                    "value": row.state_measured,
                    "limit": limit,
                    "met": row.state_measured <= limit,
                }
            )
    return out


def row_dicts(rows: list[MemoryRow]) -> list[dict]:
    return [{**asdict(r), "model_error": r.model_error} for r in rows]


MIB = 2**20
COLUMNS = (
    Column("case", "case"),
    Column("ranks", "ranks"),
    Column("tokens", "tokens"),
    Column("modelled MiB", "modelled", ".2f", MIB),
    Column("measured MiB", "measured", ".2f", MIB),
    Column("error", "model_error", "+.1%"),
    Column("state MiB", "state_measured", ".2f", MIB),
)


def verdicts(checks: list[dict]) -> list[tuple[str, bool]]:
    """Each check as a (goal, met) line: the goal, its case, the figure and its limit."""
    return [
        (f"{c['goal']}: {c['case']} {c['value']:.4g} vs {c['limit']:.4g}", c["met"]) for c in checks
    ]


def draw(rows: list[MemoryRow], path: Path) -> Path | None:
    """Modelled and measured peak per case, MiB.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw, rows), size=(10.0, 4.4))


def _draw(rows: list[MemoryRow], figure: Any, axes: Any) -> None:
    groups = [r.case for r in rows]
    values = [[r.modelled / MIB, r.measured / MIB, r.state_measured / MIB] for r in rows]
    title = f"per-rank peak memory on {rows[0].ranks} CPU ranks" if rows else "no rows"
    series = ["modelled peak", "measured peak", "measured state"]
    grouped_bars(
        axes[0, 0], groups, series, values, title=title, ylabel="MiB per rank", xlabel="case"
    )
