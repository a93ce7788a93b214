"""`ray-zep plan --auto`: search the compositions with the simulator, keep what fits.

Every composition the trainer can run on the configured model and cluster is a
candidate: each sequence placement (with the routing and remapping layers off, on,
or one of them, and for `zeppelin` each zone policy) times each weights mode
(times each expert-parallel degree that divides the cluster and the experts, for
an MoE model), times ZipCCL compression off and `auto` (`comm.compression`),
times FoldMoE's pipeline off and on (`parallel.moe_pipeline`: the config's
schedule, or 1a1m; MoE models with expert parallelism only), less what the config
refuses (`ray_zep.parallel.axes.refusal`, the placements' own rules).

Each plays the same batches through the simulator (`ray_zep.sim.step`; the
compositions that differ only in compression and pipeline share one placement of
each batch, as their data actors would make the same) and gets its per-rank memory
modelled (`ray_zep.partition.plan_memory.plan_memory`; neither switch changes it);
the fastest that fits every rank in the GPU's memory wins, of equally fast ones
the one with the fewest switches on. A composition whose data actor cuts documents into
pieces shorter than the config's own batches hold (rank-packed whole sequences cut at L
what a split placement trains whole) trains a shorter context: it is ranked, marked, after
every composition that trains the documents whole (`mark_cut_documents`). A
composition that does not fit without activation checkpointing, where the config sets
none, is placed and played again under the lightest that fits
(`ray_zep.sim.checkpointing.fitting_options`: selective, linears or full on the fewest
first blocks, `train.checkpoint_blocks`), and the step counts what backward recomputes.

Three shortcuts leave every figure the search prints as playing everything gives it. A
placement whose planner declares the settings it reads places each batch once for every
group that agrees on them (`ray_zep.partition.shared_plans`). A
composition with the remapping layer on whose remap policy moves none of its batches
places and plays them as the same composition with it off, and takes that one's steps. And
a group of compositions whose every step has a floor above the second fastest composition
played so far (each batch's bound, or what its plan allows, `ray_zep.sim.kv_floor`: the
ring K/V and dK/dV its busiest NIC must send, a gathered ring's collectives, the busiest
rank's compute; whichever is higher) is not played: it can be neither the winner
nor the runner-up, nor the composition token room, micro-batches and outlier delay are
played from. It is listed with its floor.

Where the batches are budget-packed, the fastest fitting composition is played again
with more token room for the same batches (`ray_zep.sim.token_room`: L x 1.25 and x 1.5,
then x 1.75 and x 2 while the largest played steps fastest, `data.batch_fill` lowered so
that the batch budget stays), and ranked with the rest.

Where the fastest fitting composition runs fsdp over one group of every node and the cost
model times smaller shard groups' collectives shorter, it is played again over those
groups (`parallel.shard_nodes`, `ray_zep.sim.auto_shards`), and ranked with the rest.

Where the fastest fitting composition's planner holds a kept ring's K/V room free on its
members (`parallel.ring_kv_room_mb` unset, resolved from the memory model: zeppelin's work
policy on a GPU of known memory), it is played again with that room at 0 (the members
filled, `keep_where_room` keeping where room is left), which some batches place faster
and others slower (BENCHMARKS.md, forty-eighth series), and ranked with the rest.

Where the batches are the configured data's, budget-packed, the fastest fitting composition
is played again with outlier delay (`ray_zep.sim.outlier_choice`: `data.outlier_tokens` at
2 nodes' token room and at the length about one document in two batches reaches, where
the batches hold such documents) on a window that trains
about the same documents as the composition without it, compared in seconds per token.

Where the fastest fitting composition recomputes activations (an autograd weights mode),
it is played again as 2, 3 and 4 micro-batches a step (`train.micro_batches`, L / 2, L / 3
and L / 4 each: the same tokens a step with a half, a third or a quarter of the
activations at once, `ray_zep.sim.micro_step`): its own batches, each split into that
many parts of about equal tokens, one optimizer update a step; ranked with the rest on
the same batches' bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ray_zep.config import (
    Compression,
    Config,
    MoEPipeline,
    Packing,
    batch_budget,
    config_to_yaml,
)
from ray_zep.errors import MemoryPlanError, ZepError
from ray_zep.model_shapes import build_shape
from ray_zep.options import ActivationCheckpointing, ZonePolicy
from ray_zep.parallel.axes import (
    SEQUENCE_AXES,
    WEIGHTS_AXES,
    AxesChoice,
    Family,
    WeightsMode,
    refusal,
)
from ray_zep.parallel.memory import GB
from ray_zep.partition.plan_memory import plan_memory
from ray_zep.partition.registry import spec_of
from ray_zep.partition.shared_plans import sharing_plans
from ray_zep.partition.stats import plan_stats
from ray_zep.sim.auto_ranking import AutoPlan, Candidate
from ray_zep.sim.auto_shards import shard_group_twin
from ray_zep.sim.auto_shortcuts import played_by_twin, second_fastest, unbeaten
from ray_zep.sim.bound import step_bound
from ray_zep.sim.checkpointing import (
    checkpointing_as,
    fitting_options,
    plans_peak,
)
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.micro_step import MICRO_BATCHES, micro_batched, micro_batched_steps, split_batch
from ray_zep.sim.outlier_choice import (
    MIN_WINDOW,
    DelayEffect,
    delay_window,
    delayed,
    thresholds,
)
from ray_zep.sim.step import RunModel, StepResult, plan_batch, simulate_batch, simulate_plans
from ray_zep.sim.token_room import ROOM_FACTORS, play_around, with_room

SEARCHED_COMPRESSION = (Compression.OFF, Compression.AUTO)
"""`comm.compression` values searched (`always` is never faster than `auto` in the model)."""
PIPELINE_ON = MoEPipeline.ONE_A_ONE_M
"""The schedule searched when the config names none (FoldMoE's fastest; under placements
whose attention runs through the engine it overlaps the MoE micro-batches only)."""


def compositions(config: Config, world: int) -> list[Config]:
    """Every composition of `config`'s model on `world` ranks that the config accepts."""
    shape = build_shape(config.model)
    eps = [e for e in range(1, world + 1) if world % e == 0 and shape.moe_experts % e == 0]
    eps = eps if shape.moe_experts else [1]
    out = []
    for axis, weights, ep in itertools.product(SEQUENCE_AXES.values(), WEIGHTS_AXES, eps):
        if axis.one_process:
            continue
        layers = [(False, False)]
        if axis.planned:
            layers = [(False, False), (True, False), (False, True), (True, True)]
        zones = list(spec_of(axis.placement).zone_policies) or [None]
        for (routing, remap), zone in itertools.product(layers, zones):
            choice = AxesChoice(axis.placement, weights, ep, shape.moe_experts > 0, routing, remap)
            if refusal(choice) is not None:
                continue
            parallel = dataclasses.replace(
                config.parallel,
                sequence=axis.placement,
                weights=weights,
                ep=ep,
                routing=routing,
                remap=remap,
                zone_policy=zone or config.parallel.zone_policy,
            )
            # whole sequences train rank-packed batches (the config requires it), each
            # rank's bin filled to L
            data = config.data
            if axis.whole_sequences:
                data = dataclasses.replace(data, packing=Packing.RANK, batch_fill=1.0)
            try:
                out += _switched(dataclasses.replace(config, parallel=parallel, data=data))
            except ZepError:  # a composition the config's own checks refuse
                continue
    return out


def _switched(config: Config) -> list[Config]:
    """`config` with compression off and auto, each with the MoE pipeline off and on (module
    docstring), in that order (`auto_plan` places their batches once)."""
    parallel = config.parallel
    compressions = list(SEARCHED_COMPRESSION)
    pipelines = [parallel.moe_pipeline]
    if parallel.ep > 1:
        on = parallel.moe_pipeline if parallel.moe_pipeline is not MoEPipeline.NONE else PIPELINE_ON
        pipelines = [MoEPipeline.NONE, on]
    out = []
    for compression, pipeline in itertools.product(compressions, pipelines):
        comm = dataclasses.replace(config.comm, compression=compression)
        switched = dataclasses.replace(parallel, moe_pipeline=pipeline)
        out.append(dataclasses.replace(config, comm=comm, parallel=switched))
    return out


def _placement(config: Config) -> tuple:
    """What decides how a composition places its batches (all but its switches)."""
    p = config.parallel
    return (p.sequence, p.weights, p.ep, p.routing, p.remap, p.zone_policy, config.data.packing)


_REMAP = 4
"""Where `_placement` holds `parallel.remap`."""


def _remap_off(key: tuple) -> tuple:
    """`_placement`'s key of the same composition with the remapping layer off."""
    return (*key[:_REMAP], False, *key[_REMAP + 1 :])


Batches = list[tuple[np.ndarray, list[list[int]] | None]]
"""(lengths, rank bins or None) of each batch a candidate trains."""


def evaluate_group(
    configs: list[Config],
    hardware: Hardware,
    batches: Batches,
    on_gpu: bool,
    twin: list[Candidate] | None = None,
    above: float | None = None,
) -> list[Candidate]:
    """The candidates of compositions that place batches alike (`_placement`): simulated
    steps and modelled memory, each batch placed and its memory modelled once, then
    played under each one's switches.

    `twin`: the same compositions with the remapping layer off, already evaluated. Where
    the remap policy moves none of these batches, the plans and the runs are the twin's
    (nothing else reads `parallel.remap`), and so are the steps: they are taken from it
    instead of played again.

    `above`: where set, a composition of the autograd family whose step cannot be under it
    (`ray_zep.sim.auto_shortcuts.unbeaten`) is not played; it keeps its memory and bounds,
    and says why."""
    candidates = [Candidate(c) for c in configs]
    try:
        run, placed, stats, worst = _placed(configs[0], hardware, batches, on_gpu)
        checkpointing = configs[0].train.activation_checkpointing
        if not worst[1] and checkpointing is ActivationCheckpointing.NONE:
            # where it does not fit and the config sets no checkpointing, the lightest
            # that fits (`fitting_options`), as a run of that composition would set it
            peak_of = plans_peak(stats, hardware, run.shape)
            fitting = fitting_options(run.config, hardware, run, peak_of)[0][0]
            configs = [checkpointing_as(c, fitting) for c in configs]
            candidates = [Candidate(c) for c in configs]
            run, placed, stats, worst = _placed(configs[0], hardware, batches, on_gpu)
    except ZepError as exc:
        for candidate in candidates:
            candidate.error = str(exc).splitlines()[0]
        return candidates
    for candidate in candidates:
        candidate.memory_gb, candidate.fits = worst[0] / GB, worst[1]
    if played_by_twin(candidates, placed, twin):
        return candidates
    runs = [RunModel.create(c, hardware, on_gpu) for c in configs]
    for candidate, r in zip(candidates, runs, strict=True):
        candidate.bounds = [step_bound(lengths, r).seconds for lengths, _ in batches]
    played = list(range(len(candidates)))
    if above is not None and WEIGHTS_AXES[run.config.parallel.weights].family is Family.AUTOGRAD:
        played = unbeaten(candidates, runs, placed, stats, above)
    try:
        # each step's timelines dropped as soon as it is played (`without_timelines`): a
        # group's batches and switches kept them all until the end, several GB at 256 GPUs
        runs = [runs[i] for i in played]
        if not runs:
            steps = []
        elif WEIGHTS_AXES[run.config.parallel.weights].family is Family.WEIGHT_PASSING:
            steps = [[without_timelines(simulate_batch(lengths, r, bins))
                      for lengths, bins in batches] for r in runs]  # fmt: skip
        else:
            routed = run.config.parallel.routing
            per_batch = [[without_timelines(s) for s in simulate_plans(plan, runs, routed, remap)]
                         for plan, remap in placed]  # fmt: skip
            steps = [list(s) for s in zip(*per_batch, strict=True)]
    except ZepError as exc:
        for candidate in candidates:
            candidate.error = str(exc).splitlines()[0]
        return candidates
    for i, mine in zip(played, steps, strict=True):
        candidates[i].steps = mine
    return candidates


def without_timelines(step: StepResult) -> StepResult:
    """`step` without its layer timelines and plan (a task list per rank of the cluster,
    which the ranking never reads): a search of dozens of candidates at 256 GPUs kept 20 GB
    of them."""
    micro = tuple(without_timelines(s) for s in step.micro_steps)
    return dataclasses.replace(step, forward=None, backward=None, micro_steps=micro, plan=None)


def _placed(config: Config, hardware: Hardware, batches: Batches, on_gpu: bool):
    """(the run of `config`, each batch's plan and remap, their stats, (the fullest rank's
    modelled bytes over the batches, whether every rank of every batch fits))."""
    run = RunModel.create(config, hardware, on_gpu)
    placed = [plan_batch(lengths, run, bins) for lengths, bins in batches]
    stats = [plan_stats(plan, run.shape) for plan, _ in placed]
    worst = None
    for one in stats:
        memory = plan_memory(config, hardware.topology, one, run.shape)
        fullest = memory.ranks[memory.fullest].total
        if worst is None or fullest > worst[0]:
            worst = (fullest, memory.fits)
    return run, placed, stats, worst


def auto_plan(
    config: Config,
    hardware: Hardware,
    batches_of: Callable[[Config], Batches],
    on_gpu: bool = True,
    data_of: Callable[[Config, int], Batches] | None = None,
    window: int = MIN_WINDOW,
    progress: Callable[[str], None] | None = None,
) -> AutoPlan:
    """Simulate every composition (module docstring) on the batches `batches_of` gives it:
    the same sampled lengths for all, or the configured data as each composition's data
    actor would draw it (whole sequences are rank-packed). `data_of(config, count)`: the
    configured data's first `count` batches under `config`, where the batches are the
    data's (None for sampled lengths, the same for every composition: no outlier delay is
    played and no composition cuts documents, `mark_cut_documents`); `window`: the batches
    the delay's comparison holds at least (never fewer than `MIN_WINDOW`). `progress`
    gets a line for each of `search_steps` as it ends. A planner that declares what it
    reads places each batch once for every group that agrees on it
    (`ray_zep.partition.shared_plans`)."""
    with sharing_plans():  # one plan of a batch for the groups that place it alike
        report = progress or (lambda line: None)
        candidates = []
        without_remap: dict[tuple, list[Candidate]] = {}  # evaluated groups with the remap off
        for key, alike in _groups(config, hardware.devices):
            twin = without_remap.get(_remap_off(key)) if key[_REMAP] else None
            above = second_fastest(candidates, config.data.packing)
            group = _evaluated(alike, hardware, batches_of, on_gpu, twin, above)
            if not key[_REMAP]:
                without_remap[key] = group
            candidates += group
            report(_group_line(group))
        candidates += _roomier(AutoPlan(candidates), config, hardware, batches_of, on_gpu)
        report("more token room played")
        twin = shard_group_twin(AutoPlan(candidates), config, hardware)
        if twin is not None:
            grouped = _evaluated([twin[0]], hardware, batches_of, on_gpu)
            for candidate in grouped:
                candidate.room_of = twin[1].room_of
            candidates += grouped
        report("shard groups played")
        candidates += kv_room_zero(AutoPlan(candidates), config, hardware, batches_of, on_gpu)
        report("K/V room played")
        candidates += _micro_batched(AutoPlan(candidates), config, hardware, batches_of, on_gpu)
        report("micro-batches played")
        if data_of is not None:  # the data's batches, each composition's as its actor draws them
            ranked = AutoPlan(candidates)
            candidates += delayed_candidates(ranked, config, hardware, data_of, on_gpu, window)
            mark_cut_documents(candidates, config, hardware.devices, batches_of)
        report("outlier delay played" if data_of is not None else "done")
        return AutoPlan(candidates)


SEARCH_PHASES = 5
"""`auto_plan`'s steps after the groups: token room, K/V room, micro-batches, outlier
delay."""


def search_steps(config: Config, world: int) -> int:
    """How many lines `auto_plan` reports: one per group of compositions that place batches
    alike, and one per phase after them."""
    return len(_groups(config, world)) + SEARCH_PHASES


def _groups(config: Config, world: int) -> list[tuple[tuple, list[Config]]]:
    """The compositions in groups that place batches alike (`_placement`), in search order:
    the configured zone policy's groups before the other policies', and of those the sharded
    weights modes' before `replicated`'s (which seldom fits a GPU without recomputing), so
    that the floor rules out more of the groups played later (`auto_shortcuts.unbeaten`).
    The order changes which slow groups are played, not a figure of those that are: a
    group is played whole or not at all, and the winner and the runner-up always are. Each
    group with the remapping layer on comes after its twin with it off."""
    grouped = itertools.groupby(compositions(config, world), key=_placement)
    groups = [(key, list(alike)) for key, alike in grouped]
    configured = config.parallel.zone_policy

    def played_early(group: tuple[tuple, list[Config]]) -> tuple[bool, bool]:
        parallel = group[1][0].parallel
        return parallel.zone_policy is not configured, parallel.weights is WeightsMode.REPLICATED

    return sorted(groups, key=played_early)  # stable: twins keep their order


def _group_line(group: list[Candidate]) -> str:
    """What became of a group: played, taken from its twin, not played, or why it failed."""
    first = group[0]
    if first.steps:
        return f"{first.name}: {first.step_seconds:.3f} s"
    return f"{first.name}: {first.error}"


def mark_cut_documents(
    candidates: list[Candidate],
    config: Config,
    world: int,
    batches_of: Callable[[Config], Batches],
) -> None:
    """Set `Candidate.cut_at` where a candidate's data actor cuts documents into pieces
    shorter than the longest sequence the config's own batches hold (`data.overlong`:
    rank-packed whole-sequence compositions cut at L what the config trains whole)."""
    from ray_zep.data.batching import resolve_max_doc_tokens

    try:
        longest = max((int(lengths.max()) for lengths, _ in batches_of(config) if lengths.size),
                      default=0)  # fmt: skip
    except ZepError:
        return
    for candidate in candidates:
        data, capacity = candidate.config.data, candidate.config.train.tokens_per_rank
        budget = batch_budget(data.batch_fill, world, capacity)
        limit = resolve_max_doc_tokens(data.max_doc_tokens, data.packing, budget, capacity)
        if limit < longest:
            candidate.cut_at = limit


def _evaluated(
    group: list[Config],
    hardware: Hardware,
    batches_of: Callable[[Config], Batches],
    on_gpu: bool,
    twin: list[Candidate] | None = None,
    above: float | None = None,
) -> list[Candidate]:
    """`evaluate_group` on the batches `batches_of` gives the group's first composition;
    where it cannot give them, every composition with that one-line error."""
    try:
        batches = batches_of(group[0])
    except ZepError as exc:
        return [Candidate(c, error=str(exc).splitlines()[0]) for c in group]
    return evaluate_group(group, hardware, batches, on_gpu, twin, above)


def _roomier(
    plan: AutoPlan,
    config: Config,
    hardware: Hardware,
    batches_of: Callable[[Config], Batches],
    on_gpu: bool,
) -> list[Candidate]:
    """The fastest fitting budget-packed composition again with more token room for the
    same batches (`ray_zep.sim.token_room`: L x each of `ROOM_FACTORS`, then the factors
    next to the fastest, `play_around`, the batch fill lowered to match),
    under `config`'s activation checkpointing (where it then does not fit,
    `evaluate_group` finds the lightest that does, as for any composition)."""
    packed = [c for c in plan.ranked
              if c.steps and c.fits and c.config.data.packing is Packing.BUDGET]  # fmt: skip
    if not packed:
        return []
    composition = checkpointing_as(packed[0].config, config)
    out: list[Candidate] = []
    played: dict[float, Candidate] = {1.0: packed[0]}

    def play(factor: float) -> float:
        """Plays the composition at L x `factor`; the fastest fitting factor so far."""
        roomy = with_room(composition, factor, hardware.devices)
        for candidate in _evaluated([roomy], hardware, batches_of, on_gpu) if roomy else []:
            candidate.room_of = packed[0]
            out.append(candidate)
            played[factor] = candidate
        fitting = {f: c for f, c in played.items() if c.steps and c.fits}
        return min(fitting, key=lambda f: fitting[f].step_seconds)

    fastest = 1.0
    for factor in ROOM_FACTORS:
        fastest = play(factor)
    play_around(list(played), fastest, play)  # the fastest's neighbours, then the gaps halved
    return out


def kv_room_zero(
    plan: AutoPlan,
    config: Config,
    hardware: Hardware,
    batches_of: Callable[[Config], Batches],
    on_gpu: bool,
) -> list[Candidate]:
    """The fastest fitting composition again with `parallel.ring_kv_room_mb=0`, where its
    planner reads the K/V room and resolves it from the memory model (module docstring),
    under `config`'s activation checkpointing (as `_roomier`)."""
    fitting = [c for c in plan.ranked if c.steps and c.fits]
    if not fitting or hardware.topology.gpu_memory_bytes <= 0:
        return []
    parallel = fitting[0].config.parallel
    reads = spec_of(parallel.sequence).reads or ()
    if (
        "ring_kv_room_mb" not in reads
        or parallel.zone_policy is not ZonePolicy.WORK
        or parallel.ring_kv_room_mb is not None
        or parallel.ring_kv_keep_gb is not None
    ):
        return []
    best = checkpointing_as(fitting[0].config, config)
    zero = dataclasses.replace(best, parallel=dataclasses.replace(parallel, ring_kv_room_mb=0.0))
    out = _evaluated([zero], hardware, batches_of, on_gpu)
    for candidate in out:
        candidate.room_of = fitting[0].room_of
    return out


def _micro_batched(
    plan: AutoPlan,
    config: Config,
    hardware: Hardware,
    batches_of: Callable[[Config], Batches],
    on_gpu: bool,
) -> list[Candidate]:
    """The fastest fitting composition, where it recomputes activations and its weights
    mode is an autograd one, again as `MICRO_BATCHES` micro-batches a step (module
    docstring): its batches split into that many parts, each part placed and simulated,
    the parts' steps one step (`micro_batched_step`), its bounds the whole batches' at
    the composition's L."""
    fitting = [c for c in plan.ranked if c.steps and c.fits]
    if not fitting or fitting[0].config.train.micro_batches > 1:
        return []
    best = fitting[0]
    if best.config.train.activation_checkpointing is ActivationCheckpointing.NONE:
        return []  # nothing to recompute: micro-batches only repeat the collectives
    if WEIGHTS_AXES[best.config.parallel.weights].family is not Family.AUTOGRAD:
        return []  # searched for the autograd weights modes only
    try:
        batches = batches_of(best.config)
    except ZepError:
        return []
    if any(bins is not None for _, bins in batches):
        return []  # rank-packed bins of L: a smaller L is another batch
    out = []
    for parts in MICRO_BATCHES:
        composition = micro_batched(checkpointing_as(best.config, config), parts)
        try:
            split = [(part, None) for lengths, _ in batches for part in split_batch(lengths, parts)]
        except ZepError:
            continue
        (candidate,) = evaluate_group([composition], hardware, split, on_gpu)
        if candidate.steps:
            candidate.steps = micro_batched_steps(candidate.steps, parts)
            candidate.bounds = list(best.bounds)
        out.append(candidate)
    return out


def delayed_candidates(
    plan: AutoPlan,
    config: Config,
    hardware: Hardware,
    data_of: Callable[[Config, int], Batches],
    on_gpu: bool,
    searched: int = MIN_WINDOW,
) -> list[Candidate]:
    """The fastest fitting budget-packed composition of one batch a step again with
    outlier delay at each of `outlier_choice.thresholds` (module docstring), under
    `config`'s activation checkpointing: each on the delayed stream's window
    (`delay_window`, at least `searched` batches) beside the composition without the
    delay on as many of the data's batches. A delay whose window still holds outliers
    after `outlier_choice.MAX_EXTENSION` more batches keeps its `delay` figures but no
    steps: its comparison would leave the held documents' cost out, so it is not ranked."""
    packed = [c for c in plan.ranked if c.steps and c.fits
              and c.config.data.packing is Packing.BUDGET
              and c.config.train.micro_batches == 1]  # fmt: skip
    if not packed:
        return []
    best, count = packed[0], max(searched, MIN_WINDOW)
    composition = checkpointing_as(best.config, config)
    try:
        first = data_of(composition, count)
    except ZepError:
        return []
    gpus = hardware.topology.gpus_per_node
    plain: dict[int, Candidate] = {}
    out = []
    for threshold in thresholds(composition, gpus, [lengths for lengths, _ in first]):
        trial = delayed(composition, threshold)
        try:
            window, held = delay_window(trial, hardware.devices, count)
            if len(window) not in plain:
                (plain[len(window)],) = evaluate_group(
                    [composition], hardware, data_of(composition, len(window)), on_gpu
                )
        except ZepError:
            continue
        (candidate,) = evaluate_group([trial], hardware, window, on_gpu)
        without = plain[len(window)]
        if candidate.steps and without.steps:
            outliers = sum(int((lengths >= threshold).sum()) for lengths, _ in window)
            candidate.delay = DelayEffect(threshold, len(window), without.tokens_per_second,
                                          candidate.tokens_per_second, held, outliers)  # fmt: skip
            candidate.delay_of = best
        if held:  # its window leaves outliers for later: no fair comparison, not ranked
            candidate.error = (f"{held} outliers still held after {len(window)} batches: "
                               "no window of the delay trains the same documents")  # fmt: skip
            candidate.steps = []
        out.append(candidate)
    return out


def write_best(plan: AutoPlan, path: Path) -> Path:
    """The winner's config as YAML `ray-zep train` accepts.

    Raises:
        MemoryPlanError: no composition runs and fits.
    """
    best = plan.best
    if best is None:
        raise MemoryPlanError(
            "no composition places these batches within the GPU's memory, even with full "
            "activation checkpointing: lower train.tokens_per_rank or add GPUs"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(best.config))
    return path
