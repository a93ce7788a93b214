"""`ray-zep bench scale`: placements from 64 to 4,096 GPUs, modelled on the same batches.

For every case (GPUs of cluster A, length distribution, model, tokens per GPU on
average; L = that x headroom) and placement, on the same sampled batches:

- work max/mean: the busiest rank's linear + attention FLOPs over the mean
  (`PlanStats.work_imbalance`), averaged over the batches and the worst batch;
- step / ideal: the simulated step (`ray_zep.sim`) over the batch's ideal step
  (`ray_zep.sim.ideal`), step / bound over its lower bound (`ray_zep.sim.bound`: the
  ideal, the K/V exchange no placement avoids, the weights' collectives and both on
  one node's NICs), where the step beyond the bound goes (imbalance, split kernels,
  contention, exposed transfers, waits and what activation checkpointing recomputes;
  not for the baselines' scheduled steps),
  and modelled tokens/s per GPU;
- inter-node bytes per step (`traffic.attention_step_traffic`: every layer's ring,
  collective and remap bytes), the planner's wall time (`plan_step`, as the data
  actor runs it: a step's median and slowest over the batches, its micro-batches' plans
  together, and the slowest single call, `call ms`) and the fullest rank's
  modelled memory under the lightest activation checkpointing that fits the GPU
  (`ckpt`: none, or selective, linears or full on the fewest first blocks that fit,
  as Megatron-LM's `--recompute-num-layers`, "full 12/40" on 12 of 40 blocks, whichever
  simulates fastest where several fit; the step counts what backward recomputes), and
  whether it fits (`fits`: no row is dropped for not fitting even with full
  checkpointing; one that does not is marked). The batches are planned under the
  lightest checkpointing in which a rank of L tokens fits, the mode a run of that L
  sets: the ring K/V a plan keeps is what that mode leaves room for;
- micro-batches (`micro`): where a row recomputes, its placement plays the batch again
  as 2 micro-batches of L / 2 a step, then 3 of L / 3, and so on while that still
  recomputes, up to `--micro-batches` (`ray_zep.sim.micro_step`: the trainer's
  `train.micro_batches`, the batch's sequences split into parts of about equal tokens,
  one optimizer update), and the row keeps the fastest; its bound stays the batch's at
  L, which no micro-batch holding fewer tokens beats;
- token room (`--room`, `L`): each row is played at L x each factor on the same batches,
  as `plan --auto` plays the fastest composition with more room (1.25, 1.5 and 2), and
  keeps the fastest that fits; its bound is the batch's at that L. With `--room-up-to`,
  each placement is then played at the factors next to its fastest on a ladder of 0.25
  until both are played, then at the middles between the fastest and its nearest played
  factors (`--room-halvings`, 2 by default), up to the factor given, as `plan --auto`
  does up to 2 (`ray_zep.sim.token_room.play_around`);
- K/V room (`--kv-room`, `K/V room`): each row is played with each
  `parallel.ring_kv_room_mb` listed (`model`: unset, the memory model's cost of a token
  in a ring, which the planner holds free on a kept ring's members; `0`: the budget
  alone, the members filled and `keep_where_room` keeping where room is left) at every
  `--room` factor, and keeps the fastest that fits.

Placements are `ray-zep simulate`'s variants: `zeppelin` is the full system with the
config's `parallel.zone_policy` (`work` by default), `zeppelin+cost` with `cost`.
`bytescale_hdp` and `megatron_dynamic_cp` run several micro-batches per rank: their work
sums them per rank, their bytes sum their rounds, their memory is the fullest round's, and their
planner time is their schedule's (`megatron_dynamic_cp`'s plans hold the lengths its
dataset pads).
`megatron_hybrid_cp` runs in waves of CP groups, so its plan columns are empty but its
memory (the fullest wave's).

Every case runs FSDP on cluster A; `key=value` overrides change that and any other key the
grid does not set itself (`ray_zep.bench.scale_overrides`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from ray_zep.bench.scale_columns import level_columns, simulated_columns
from ray_zep.bench.scale_options import (
    as_option,
    bounds_by_choice,
    fitting_checkpointing,
    own_bounds,
    weights_choices,
    with_weights_choice,
)
from ray_zep.bench.scale_overrides import (
    GPUS_PER_NODE,
    OVERRIDES_HELP,
    case_overrides,
    checked_overrides,
    overrides_note,
)
from ray_zep.bench.scale_play import filled_config, plan_batch_timed, scheduler_of, simulated_step
from ray_zep.bench.scale_report import COLUMNS, draw_scale_chart
from ray_zep.command_args import counts, factors, known, names
from ray_zep.config import Config, load_config
from ray_zep.data.synthetic import DISTRIBUTIONS, batch_lengths
from ray_zep.errors import ConfigError, ZepError
from ray_zep.parallel.axes import Sharding
from ray_zep.parallel.memory import GB
from ray_zep.partition import registry
from ray_zep.partition.plan_memory import rank_memory
from ray_zep.partition.spec import Bench
from ray_zep.partition.stats import max_over_mean, plan_stats
from ray_zep.remap.solver import max_flow_library
from ray_zep.report.output import BenchResult
from ray_zep.report.progress import ProgressLine
from ray_zep.run_memory import node_reshard_applies
from ray_zep.sim.bytescale import NAME as BYTESCALE_HDP
from ray_zep.sim.checkpointing import (
    checkpointing_label,
    fitting_options,
)
from ray_zep.sim.compare import VARIANTS, variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.megatron_cp import NAME as MEGATRON_HYBRID_CP
from ray_zep.sim.megatron_cp import hybrid_cp_wave_plans
from ray_zep.sim.megatron_dynamic_cp import NAME as MEGATRON_DYNAMIC_CP
from ray_zep.sim.micro_step import micro_batched_steps, split_batch
from ray_zep.sim.step import RunModel
from ray_zep.sim.token_room import ROOM_HALVINGS, ROOM_MOST, ROOM_STEP, play_around
from ray_zep.topology import build_topology
from ray_zep.traffic import attention_step_traffic

PLACEMENTS = (
    *registry.listed(Bench.SCALE),
    MEGATRON_HYBRID_CP,
    MEGATRON_DYNAMIC_CP,
    BYTESCALE_HDP,
)
NAME = "scale"
HELP = "placements from 64 to 4,096 GPUs, modelled"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides", nargs="*", help=f"key=value overrides of every case's config {OVERRIDES_HELP}"
    )
    parser.add_argument("--gpus", default="64,256,1024,4096", help="cluster sizes (8 per node)")
    distributions = ",".join(ScaleBenchSpec.distributions)
    parser.add_argument("--distributions", help=f"default: {distributions}")
    parser.add_argument("--models", default="7b,13b", help="model presets (default 7b,13b)")
    parser.add_argument("--tokens", default="4k,16k", help="tokens per GPU on average")
    parser.add_argument("--placements", help="default: " + ",".join(PLACEMENTS))
    parser.add_argument("--batches", type=int, default=1, help="sampled batches per case")
    parser.add_argument("--headroom", type=float, default=1.25, help="L / tokens per GPU")
    parser.add_argument(
        "--micro-batches", type=int, default=4,
        help="most micro-batches a step tried where a row recomputes (1: one batch a step)",
    )  # fmt: skip
    parser.add_argument(
        "--plan-only", action="store_true", help="plan, no simulation: work, bytes, ms, memory"
    )
    parser.add_argument(
        "--plan-repeats", type=int, default=1,
        help="times each batch is planned again for the planner's time, the median kept "
        "(the same plan each time; default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--room", default="1",
        help="token-room factors each row tries, L x each for the same batches, keeping the "
        "fastest that fits (plan --auto tries 1,1.25,1.5,2, see --room-up-to; default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--room-up-to", type=float, default=None,
        help=f"then try the factors next to a row's fastest fitting one (+-{ROOM_STEP}) until "
        f"both are tried, then the gaps beside the fastest halved (--room-halvings), up to "
        f"this factor (plan --auto: {ROOM_MOST})",
    )  # fmt: skip
    parser.add_argument(
        "--room-halvings", type=int, default=ROOM_HALVINGS,
        help="with --room-up-to, how many times the gaps beside the fastest room are halved "
        f"once its neighbours on the ladder are tried (default {ROOM_HALVINGS}, as plan --auto; "
        "0: the ladder alone)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-room", default="model",
        help="parallel.ring_kv_room_mb values each row tries (model: unset, the memory "
        "model's; numbers: MB a token), keeping the fastest that fits (default model)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> BenchResult:
    spec = ScaleBenchSpec(
        gpus=counts(args.gpus, "--gpus"),
        distributions=names(args.distributions, ScaleBenchSpec.distributions),
        models=names(args.models, ()),
        tokens_per_gpu=counts(args.tokens, "--tokens"),
        placements=names(args.placements, planned_placements(args.plan_only)),
        batches=args.batches,
        headroom=args.headroom,
        plan_only=args.plan_only,
        plan_repeats=args.plan_repeats,
        micro_batches=args.micro_batches,
        room=factors(args.room, "--room"),
        kv_room=kv_rooms(args.kv_room),
        room_up_to=args.room_up_to,
        room_halvings=args.room_halvings,
        overrides=tuple(args.overrides),
    )
    cases = len(spec.models) * len(spec.tokens_per_gpu) * len(spec.gpus) * len(spec.distributions)
    with ProgressLine(cases, "cases", sys.stdout) as bar:
        rows = run_scale_bench(spec, progress=bar.counter())
    return BenchResult.from_rows(NAME, asdict(spec), rows, COLUMNS, draw_scale_chart, key_columns=5,
                                 notes=overrides_note(spec.overrides))  # fmt: skip


def kv_rooms(text: str) -> tuple[float | None, ...]:
    """'model,0' -> (None, 0.0): `--kv-room`'s values; errors name the flag."""
    out: list[float | None] = []
    for item in text.replace(" ", "").split(","):
        if item == "model":
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not value >= 0:
            raise ConfigError(
                f"--kv-room item {item!r}: 'model' or MB >= 0, e.g. --kv-room model,0"
            )
        out.append(value)
    return tuple(out)


def planned_placements(plan_only: bool) -> tuple[str, ...]:
    """The default placements: all of them, or those with a plan to time (`--plan-only`)."""
    return tuple(p for p in PLACEMENTS if not (plan_only and p == MEGATRON_HYBRID_CP))


@dataclass(frozen=True)
class ScaleBenchSpec:
    """The grid of cases and the placements compared on each."""

    gpus: tuple[int, ...] = (64, 256, 1024, 4096)
    distributions: tuple[str, ...] = ("arxiv", "github", "prolong64k", "chat")
    models: tuple[str, ...] = ("7b", "13b")
    tokens_per_gpu: tuple[int, ...] = (4096, 16384)
    placements: tuple[str, ...] = PLACEMENTS
    batches: int = 1
    headroom: float = 1.25
    plan_only: bool = False
    """Plan the batches without simulating them: the plan columns only (work, bytes,
    planner ms, memory), fast at 4,096 GPUs."""
    plan_repeats: int = 1
    """Times each batch is planned for `plan ms` (the median: a single call can carry a
    process's one-time costs or another program's load); the plans are the same."""
    micro_batches: int = 4
    """The most micro-batches a step a recomputing row is played with (module docstring)."""
    room: tuple[float, ...] = (1.0,)
    """Token-room factors each row is played at (L = tokens x headroom x each, the same
    batches), the fastest that fits kept (module docstring)."""
    kv_room: tuple[float | None, ...] = (None,)
    """`parallel.ring_kv_room_mb` values each row is played with (None: unset), the
    fastest that fits kept (module docstring)."""
    room_up_to: float | None = None
    """Each placement is then played at the factors next to its fastest fitting one
    (`ray_zep.sim.token_room.play_around`) until both are played, then at the middles of
    the gaps beside it, up to this factor (module docstring); None: `room` alone."""
    room_halvings: int = ROOM_HALVINGS
    """How many times `room_up_to`'s search halves the gaps beside the fastest factor
    (`ray_zep.sim.token_room.next_room`; 0: the ladder alone)."""
    overrides: tuple[str, ...] = ()
    """`key=value` overrides of every case's config (`ray_zep.bench.scale_overrides`)."""

    def __post_init__(self) -> None:
        for g in self.gpus:
            if g < GPUS_PER_NODE or g % GPUS_PER_NODE:
                raise ConfigError(f"--gpus {g}: a multiple of {GPUS_PER_NODE} (cluster A nodes)")
        known("--distributions", self.distributions, DISTRIBUTIONS)
        known("--placements", self.placements, VARIANTS)
        if self.plan_only and MEGATRON_HYBRID_CP in self.placements:
            raise ConfigError(f"--placements: {MEGATRON_HYBRID_CP} has no single plan to time "
                              "(--plan-only)")  # fmt: skip
        if self.batches < 1 or self.headroom < 1.0:
            raise ConfigError("--batches must be >= 1 and --headroom >= 1")
        if self.micro_batches < 1:
            raise ConfigError(f"--micro-batches={self.micro_batches}: must be >= 1")
        if self.plan_repeats < 1:
            raise ConfigError(f"--plan-repeats={self.plan_repeats}: must be >= 1")
        if not self.room or min(self.room) < 1.0:
            raise ConfigError(f"--room {self.room}: factors of L must be >= 1")
        if self.room_up_to is not None and not self.room_up_to >= max(self.room):
            raise ConfigError(f"--room-up-to {self.room_up_to}: at least the largest --room "
                              f"factor ({max(self.room)})")  # fmt: skip
        if self.room_halvings < 0:
            raise ConfigError(f"--room-halvings {self.room_halvings}: must be >= 0")
        if self.plan_only and (len(self.room) > 1 or self.room_up_to is not None):
            raise ConfigError("--room: one factor, no --room-up-to, with --plan-only (no step "
                              "to choose by)")  # fmt: skip
        if self.plan_only and len(self.kv_room) > 1:
            raise ConfigError("--kv-room: one value with --plan-only (no step to choose by)")
        checked_overrides(f"bench {NAME}", self.overrides)


@dataclass
class ScaleRow:
    """One placement on one case (None: not measured for this placement)."""

    gpus: int
    distribution: str
    model: str
    tokens_per_gpu: int
    placement: str
    step_s: float | None = None
    step_over_ideal: float | None = None
    step_over_bound: float | None = None
    imbalance_s: float | None = None
    split_kernels_s: float | None = None
    contention_s: float | None = None
    """Compute slowed by communication kernels beyond the bound's least (`over_bound`)."""
    transfers_s: float | None = None
    """Exposed transfers beyond the bound (`ray_zep.sim.bound.over_bound`)."""
    waits_s: float | None = None
    recompute_s: float | None = None
    """What backward recomputes under the row's activation checkpointing (`ckpt`)."""
    tokens_per_s_per_gpu: float | None = None
    work_mean: float | None = None
    work_worst: float | None = None
    level: float | None = None
    """The level of work the balanced placement kept, times the mean rank's (mean over the
    batches; `ray_zep.partition.level_trace`): None for placements made without levels."""
    ring_fill: float | None = None
    """The kept level's rings' and USP groups' members: their mean work before the whole
    sequences, over the level (mean over the batches; `LevelTry.ring_fill`): the group
    sizes the nodes allow leave the rest of the level to the whole sequences, or idle."""
    rings_at_mean: float | None = None
    """The ranks the rings need at the mean level, at least, over the ranks there are (mean
    over the batches where the planner counted them): over 1, no level that low fits."""
    inter_node_gb: float | None = None
    planner_ms: float | None = None
    """`plan_step` wall time, the median over the batches (a full collection of Python's
    garbage collector can land in any one call); with micro-batches, their plans' together."""
    planner_ms_max: float | None = None
    planner_ms_call: float | None = None
    """The slowest single `plan_step` call over the batches: a step of k micro-batches
    plans k batches, one call each, as the data actor plans each micro-batch it streams
    (`planner_ms` sums them)."""
    peak_memory_gb: float | None = None
    checkpointing: str | None = None
    """The activation checkpointing the row runs (`fitting_options`, the fastest): the mode,
    with "k/n" where it applies to the first k of n blocks; the step counts what it
    recomputes."""
    fits: str | None = None
    """"yes", or "NO" where the fullest rank's modelled memory exceeds the GPU's."""
    node_shards: bool | None = None
    """Whether the row keeps each block sharded over the node after its forward
    (`parallel.reshard_to_node`; unset, the row is played with and without and keeps the
    faster); None where the key means nothing (one node, hsdp, whole copies)."""
    shard_nodes: int | None = None
    """fsdp's shard groups (`parallel.shard_nodes`; 0: one over every node; unset, the row
    is played with one and with the group whose collectives the cost model times
    fastest, `fastest_shard_nodes`, and keeps the faster); None for other weights modes."""
    micro_batches: int = 1
    """Micro-batches a step (module docstring), each of at most L / this tokens a rank."""
    tokens_per_rank: int | None = None
    """L the row ran at (`--room`: the fastest of its factors that fits)."""
    kv_room_mb: float | None = None
    """`parallel.ring_kv_room_mb` the row ran with (None: unset; `--kv-room`)."""
    gpu_time: dict | None = None
    """Where the ranks' GPU-time goes, mean over the batches (`ray_zep.sim.gpu_time`);
    in the JSON record only."""
    phase_ends: list | None = None
    """Where the first batch's forward and backward end (`ray_zep.sim.phase_setter`: the
    rank, its time by cause, the sequences it holds); in the JSON record only."""
    error: str | None = None


def case_batches(distribution: str, total: int, count: int) -> list[np.ndarray]:
    """The `count` batches of `total` tokens a case of `distribution` plays (seeds 0 ..
    count - 1): `scale-replay` plays a record's rows on the same ones."""
    return [batch_lengths(distribution, total, seed) for seed in range(count)]


def run_scale_bench(spec: ScaleBenchSpec, progress=print) -> list[ScaleRow]:
    """Every case of `spec` x every placement (module docstring)."""
    max_flow_library()  # loaded once per process (a data actor's first plan): in no row's time
    rows = []
    for model in spec.models:
        for tokens in spec.tokens_per_gpu:
            for gpus in spec.gpus:
                for distribution in spec.distributions:
                    case = (gpus, distribution, model, tokens)
                    started = time.perf_counter()
                    batches = case_batches(distribution, tokens * gpus, spec.batches)
                    rows += scale_case(spec, *case, batches)
                    progress(f"{gpus} GPUs {distribution} {model} {tokens // 1024}k/GPU: "
                             f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    return rows


def scale_case(spec: ScaleBenchSpec, gpus: int, distribution: str, model: str, tokens: int,
               batches: list[np.ndarray]) -> list[ScaleRow]:  # fmt: skip
    """One case of the grid: `spec.placements` on `batches` (of `tokens` x `gpus` tokens
    each) on `gpus` GPUs of cluster A; `distribution` labels the rows. Each placement is
    played at every `spec.room` factor of L and keeps the fastest that fits (the fastest
    where none fits; the first where none ran)."""
    played = [(factor, case_at(dataclasses.replace(spec, headroom=spec.headroom * factor), gpus,
                                distribution, model, tokens, batches, kv_room))
              for factor in spec.room for kv_room in spec.kv_room]  # fmt: skip
    kept = [min(((factor, rows[p]) for factor, rows in played), key=lambda fr: _room_rank(fr[1]))
            for p in range(len(spec.placements))]  # fmt: skip
    if spec.room_up_to is None:
        return [row for _, row in kept]
    return [_room_around(spec, row, factor, gpus, distribution, model, tokens, batches)
            for factor, row in kept]  # fmt: skip


def _room_around(spec: ScaleBenchSpec, row: ScaleRow, factor: float, gpus: int, distribution: str,
                 model: str, tokens: int, batches: list[np.ndarray]) -> ScaleRow:  # fmt: skip
    """`row` (one placement's fastest over `spec.room`, at `factor`), or the fastest of it
    and the factors `play_around` plays next to the fastest, up to `spec.room_up_to`;
    none where `row` did not run or fit."""
    if row.step_s is None or row.fits != "yes":
        return row

    def play(following: float) -> float:
        nonlocal row, factor
        one = dataclasses.replace(spec, placements=(row.placement,),
                                  headroom=spec.headroom * following)  # fmt: skip
        tried = [case_at(one, gpus, distribution, model, tokens, batches, kv_room)[0]
                 for kv_room in spec.kv_room]  # fmt: skip
        best = min([row, *tried], key=_room_rank)
        if best is not row:
            row, factor = best, following
        return factor

    play_around(spec.room, factor, play, spec.room_up_to, spec.room_halvings)
    return row


def _room_rank(row: ScaleRow) -> tuple:
    """What `scale_case` keeps first: played, then fitting, then fastest (then the
    smaller L and the K/V room listed first)."""
    played = row.step_s is not None
    return (not played, row.fits != "yes", row.step_s if played else 0.0)


def case_at(spec: ScaleBenchSpec, gpus: int, distribution: str, model: str, tokens: int,
             batches: list[np.ndarray],
             kv_room: float | None = None) -> list[ScaleRow]:  # fmt: skip
    """`scale_case` at `spec.headroom` and `parallel.ring_kv_room_mb=kv_room` alone."""
    capacity = math.ceil(tokens * spec.headroom)
    config = load_config(None, case_overrides(gpus, model, capacity, kv_room, spec.overrides))
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    ideal = None if spec.plan_only else [ideal_step_seconds(b, run) for b in batches]
    bounds = None if spec.plan_only else bounds_by_choice(batches, run)
    rows = []
    for name in spec.placements:
        row = ScaleRow(gpus, distribution, model, tokens, name, kv_room_mb=kv_room)
        tried = []
        for choice in weights_choices(run):
            one = dataclasses.replace(row)
            chosen = with_weights_choice(config, choice)
            try:
                one = _fastest_micro_batches(spec, one, chosen, hardware, batches,
                                             (ideal, bounds))  # fmt: skip
            except ZepError as exc:
                one.error = str(exc)
            tried.append(one)
        # played without error, then as scale_case keeps a room; without the shards on ties
        rows.append(min(tried, key=lambda one: (one.error is not None, *_room_rank(one))))
    return rows


def _fastest_micro_batches(spec: ScaleBenchSpec, row: ScaleRow, config: Config,
                           hardware: Hardware, batches, yardsticks) -> ScaleRow:  # fmt: skip
    """`row` measured with one batch a step and, where it recomputes, with one micro-batch
    more (of L / that many each) while they still recompute, up to `spec.micro_batches`
    (module docstring); the fastest. Placements that schedule micro-batches or waves of
    their own, and `--plan-only`, play one batch a step; a micro-batch the placement
    cannot hold at the smaller L ends the search."""
    scheduled = VARIANTS[row.placement].scheduled
    best = None
    for parts in range(1, spec.micro_batches + 1):
        capacity = math.ceil(row.tokens_per_gpu * spec.headroom / parts)
        train = dataclasses.replace(config.train, tokens_per_rank=capacity, micro_batches=parts)
        tried = dataclasses.replace(
            row, micro_batches=parts, tokens_per_rank=math.ceil(row.tokens_per_gpu * spec.headroom)
        )
        try:
            split = [split_batch(lengths, parts) for lengths in batches]
            _measure(tried, dataclasses.replace(config, train=train), hardware, split,
                     yardsticks, capacity, spec.plan_repeats)  # fmt: skip
        except ZepError:
            if best is None:
                raise
            return best  # a micro-batch the placement cannot hold at L / parts
        if best is None or tried.step_s < best.step_s:
            best = tried
        if spec.plan_only or scheduled or not tried.recompute_s:
            break
    return best


def _measure(row, config: Config, hardware: Hardware, batches, yardsticks, capacity: int,
             plan_repeats: int = 1) -> None:  # fmt: skip
    """Fills `row`; `batches` holds each batch's micro-batches (one part where a step
    trains one batch). Without `yardsticks` (ideal steps and bounds of the whole
    batches; plan only) its simulated columns stay empty. The micro-batches are planned
    first; the step is then simulated under each lightest activation checkpointing whose
    modelled memory fits the GPU (`fitting_options`; full on every block where none
    does, and the row says NO), and the fastest kept."""
    ideal, bounds = yardsticks
    variant = row.placement
    parts = [part for one in batches for part in one]  # every batch's micro-batches in turn
    config = filled_config(variant_config(config, variant, capacity), parts, hardware.devices)
    run = RunModel.create(config, hardware)
    run = dataclasses.replace(run, config=_planning_checkpointing(config, hardware, run))
    if VARIANTS[variant].te_wire:
        run = run.with_te_wire()
    works, inter, planner, stats, planned, levels = [], [], [], [], [], []
    routed = config.parallel.routing
    for lengths in parts:
        if VARIANTS[variant].hybrid_cp:
            plans = hybrid_cp_wave_plans(lengths, run)
            planned.append((plans, None, None, True))
            stats.append([plan_stats(plan, run.shape) for plan in plans])
            continue
        scheduler = scheduler_of(VARIANTS[variant])
        plans, micro, remap, seconds = plan_batch_timed(scheduler, lengths, run, plan_repeats)
        planned.append((plans, micro, remap, False))
        planner.append(seconds)
        stats.append([plan_stats(plan, run.shape) for plan in plans])
        works.append(max_over_mean(sum(one.work_flops for one in stats[-1])))
        levels.append(level_columns(plans, hardware.devices))
        inter.append(sum(attention_step_traffic(plan, run.shape, routed, remap,
                                                dkv_owner=run.dkv_owner).inter_node
                         for plan in plans))  # fmt: skip
    options = fitting_checkpointing(config, hardware, run, stats)
    runs = [dataclasses.replace(run, config=as_option(run.config, option))
            for option, _ in options]  # fmt: skip
    chosen = 0
    if ideal is not None:
        # every option that fits is simulated (they differ only in what backward
        # recomputes); the row keeps the fastest
        stepped = [micro_batched_steps([simulated_step(part, one_run, *one)
                                        for part, one in zip(parts, planned, strict=True)],
                                       len(batches[0]))
                   for one_run in runs]  # fmt: skip
        chosen = min(range(len(stepped)), key=lambda i: sum(s.step_seconds for s in stepped[i]))
        own = own_bounds(bounds, options[chosen][0])
        seconds = simulated_columns(row, stepped[chosen], ideal, own, run.shape.n_layers)
        row.tokens_per_s_per_gpu = sum(int(b.sum()) for b in parts) / seconds / hardware.devices
    fitting, peak = options[chosen]
    row.checkpointing, row.peak_memory_gb = checkpointing_label(fitting, run.shape), peak / GB
    row.fits = "yes" if peak <= hardware.usable_memory_bytes else "NO"
    if node_reshard_applies(fitting, hardware.topology):
        row.node_shards = bool(fitting.parallel.reshard_to_node)
    if fitting.parallel.weights_axis.sharding is Sharding.ALL_RANKS:
        row.shard_nodes = fitting.parallel.shard_nodes
    if works:
        step_sums = len(works) // len(batches)  # a step's micro-batches
        row.work_mean, row.work_worst = float(np.mean(works)), float(max(works))
        kept = [k for k, _, _ in levels if k is not None]
        needed = [n for _, n, _ in levels if n is not None]
        fills = [f for _, _, f in levels if f is not None]
        row.level = float(np.mean(kept)) if kept else None
        row.rings_at_mean = float(np.mean(needed)) if needed else None
        row.ring_fill = float(np.mean(fills)) if fills else None
        row.inter_node_gb = float(np.mean(inter)) * step_sums / 1e9
        per_step = np.asarray(planner).reshape(len(batches), -1).sum(axis=1)
        row.planner_ms = float(np.median(per_step)) * 1e3
        row.planner_ms_max = float(per_step.max()) * 1e3
        row.planner_ms_call = float(max(planner)) * 1e3


def _planning_checkpointing(config: Config, hardware: Hardware, run: RunModel) -> Config:
    """`config` under the first checkpointing option (`fitting_options`) in which a rank
    holding L tokens, all in rings, fits the GPU (the heaviest where none does): the mode
    a run of this L sets, and the one its plans are made under (how much ring K/V they
    keep depends on it)."""
    capacity = config.train.tokens_per_rank

    def peak_of(checked: Config) -> float:
        return rank_memory(checked, hardware.topology, run.shape, capacity, capacity).total

    return fitting_options(config, hardware, run, peak_of)[0][0]
