"""Placements side by side on the same sampled batches: what `ray-zep simulate` reports.

Each placement's variants come from its spec (`ray_zep.partition.registry`). Baselines
run as the executor runs them without the routing and remapping layers, except
`te_cp`, the reference, which runs as TransformerEngine runs it
(`Variant.te_wire`, `Variant.te_padding`), and `megatron_hybrid_cp`, Megatron-Core's
hybrid DP x CP: waves of power-of-two TE CP groups (`ray_zep.sim.megatron_cp`),
`megatron_dynamic_cp`, Megatron-LM's packing-aware dynamic CP (`default_dynamic_cp`):
the global batch packed into micro-batches of power-of-two TE CP groups, every rank
running each micro-batch with no barrier between them (`ray_zep.sim.megatron_dynamic_cp`),
and `bytescale_hdp`, ByteScale's hybrid data parallelism: rings of any size and packed
micro-batches, ranks running different numbers of them (`ray_zep.sim.bytescale`).
`zeppelin` is the full system: the Zeppelin partitioner and engine,
routing, and the remapping layer under `parallel.remap_policy`, with the config's
`parallel.zone_policy` (work-balanced by default); `zeppelin+work` and `zeppelin+cost` the same
with the work-balanced and the cost model's zones. The ablation
adds, as in the Zeppelin paper's Fig. 11, `te_cp+routing` (even split, ring
transfers through proxies) and `te_cp+routing+partition` (the Zeppelin
partitioner and engine with routing, no remap).

With `train.micro_batches` = k above 1, a variant that places a step's batch as one plan
plays it as k micro-batches (`ray_zep.sim.micro_step`: the data's consecutive batches, or
a batch split into k parts of about equal tokens); the baselines that schedule
micro-batches or waves of their own schedule the step's whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ray_zep.config import Config
from ray_zep.errors import ConfigError, ZepError
from ray_zep.parallel.axes import WEIGHTS_AXES, Family, Placement, WeightsMode
from ray_zep.partition import registry
from ray_zep.partition.spec import Bench, Role, Variant
from ray_zep.sim.bytescale import NAME as BYTESCALE_HDP
from ray_zep.sim.bytescale import simulate_bytescale
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.megatron_cp import NAME as MEGATRON_HYBRID_CP
from ray_zep.sim.megatron_cp import simulate_hybrid_cp, te_padded
from ray_zep.sim.megatron_dynamic_cp import NAME as MEGATRON_DYNAMIC_CP
from ray_zep.sim.megatron_dynamic_cp import simulate_dynamic_cp
from ray_zep.sim.micro_step import micro_batched_step, split_batch
from ray_zep.sim.step import RunModel, StepResult, simulate_batch

_REFERENCE, _SYSTEM = registry.reference(), registry.playing(Role.SYSTEM)
REFERENCE = _REFERENCE.name
ROUTED_TE_CP = f"{REFERENCE}+routing"
ROUTED_PARTITION = f"{REFERENCE}+routing+partition"
SYSTEM_MODELS: dict[str, Variant] = {
    MEGATRON_HYBRID_CP: Variant(_REFERENCE.axis.placement, te_wire=True, hybrid_cp=True),
    MEGATRON_DYNAMIC_CP: Variant(_REFERENCE.axis.placement, te_wire=True, dynamic_cp=True),
    # dK/dV in the activation dtype (generous: ByteScale's paper does not say).
    BYTESCALE_HDP: Variant(Placement.HYBRID_DP, te_wire=True, bytescale=True),
    ROUTED_TE_CP: Variant(_REFERENCE.axis.placement, routed=True),
    ROUTED_PARTITION: Variant(_SYSTEM.axis.placement, routed=True),
}
"""The variants the simulator models beside the placements' own (`registry.variants`):
the baselines' systems (their waves and micro-batches) and the Fig. 11 ablation."""
ABLATION = (REFERENCE, ROUTED_TE_CP, ROUTED_PARTITION, _SYSTEM.name)
"""The Fig. 11 ladder, each row adding one part of Zeppelin."""


class _Variants(Mapping[str, Variant]):
    """Every variant by name, read from the registry at each lookup, so a placement
    registered later is simulated too."""

    def _table(self) -> dict[str, Variant]:
        return {**registry.variants(), **SYSTEM_MODELS}

    def __getitem__(self, name: str) -> Variant:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


VARIANTS: Mapping[str, Variant] = _Variants()
DEFAULT_STRATEGIES = (*registry.listed(Bench.SIMULATE), MEGATRON_HYBRID_CP)


@dataclass
class StrategyResult:
    """A variant's simulated steps over the sampled batches.

    Attributes:
        name: the variant.
        steps: one result per batch (empty when `error` is set).
        error: why the variant could not place the batches.
        speedup_vs_te_cp: te_cp's mean step time over this variant's.
    """

    name: str
    steps: list[StepResult] = field(default_factory=list)
    error: str | None = None
    speedup_vs_te_cp: float | None = None

    @property
    def step_seconds(self) -> float | None:
        return float(np.mean([s.step_seconds for s in self.steps])) if self.steps else None

    @property
    def tokens_per_second(self) -> float | None:
        if not self.steps:
            return None
        return sum(s.tokens for s in self.steps) / sum(s.step_seconds for s in self.steps)

    def to_dict(self, n_layers: int) -> dict[str, object]:
        out: dict[str, object] = {
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "speedup_vs_te_cp": self.speedup_vs_te_cp,
        }
        if self.error:
            out["error"] = self.error
        if self.steps:
            parts = [s.breakdown(n_layers) for s in self.steps]
            out["breakdown_seconds"] = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}
            out["remapped_batches"] = sum(s.remap is not None for s in self.steps)
            out["per_batch_step_seconds"] = [s.step_seconds for s in self.steps]
        return out


def strategy_names(text: str | None, ablation: bool) -> tuple[str, ...]:
    """Variants to simulate: the listed ones (te_cp always, as the reference), plus the ladder."""
    names = list(check_variants(DEFAULT_STRATEGIES if text is None else _split(text)))
    if ablation:
        names += [n for n in ABLATION if n not in names]
    if REFERENCE not in names:
        names.append(REFERENCE)
    return tuple(dict.fromkeys(names))


def check_variants(names) -> tuple[str, ...]:
    """`names` if every one is a variant.

    Raises:
        ConfigError: naming the first unknown one and the choices.
    """
    for name in names:
        if name not in VARIANTS:
            raise ConfigError(f"--strategies: {name!r} is not one of {', '.join(VARIANTS)}")
    return tuple(names)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def simulate_strategies(
    config: Config,
    hardware: Hardware,
    batches: list[np.ndarray],
    names: tuple[str, ...],
    tokens_per_rank: int,
    on_gpu: bool = True,
    micro: list[list[np.ndarray]] | None = None,
) -> dict[str, StrategyResult]:
    """Simulate every variant of `names` on every batch (lengths arrays), each placed as
    the data actor would place it under that variant's axes (`simulate_batch`; te_cp on
    TE's padded lengths, `simulate_te_padded`; megatron_hybrid_cp in its waves,
    `simulate_hybrid_cp`; megatron_dynamic_cp in its micro-batches, `simulate_dynamic_cp`;
    bytescale_hdp in micro-batches, `simulate_bytescale`) with
    the config's weights mode (replicated where it passes weights); speedups are
    filled in when te_cp is among them. `micro`: each batch's micro-batches where a step
    trains several (`train.micro_batches`; None: each batch split into that many parts
    of about equal tokens)."""
    results = {}
    for name in names:
        run = RunModel.create(variant_config(config, name, tokens_per_rank), hardware, on_gpu)
        if VARIANTS[name].te_wire:
            run = run.with_te_wire()
        variant = VARIANTS[name]
        step = _step_function(variant)
        parts = 1 if variant.scheduled else config.train.micro_batches
        result = StrategyResult(name)
        try:
            result.steps = [
                _in_parts(step, lengths, run, parts, None if micro is None else micro[b])
                for b, lengths in enumerate(batches)
            ]
        except ZepError as exc:
            result.steps, result.error = [], str(exc)
        results[name] = result
    reference = results[REFERENCE].step_seconds if REFERENCE in results else None
    for result in results.values():
        if reference and result.step_seconds:
            result.speedup_vs_te_cp = reference / result.step_seconds
    return results


def _in_parts(step, lengths: np.ndarray, run: RunModel, parts: int, given) -> StepResult:
    """`step` of the batch `lengths`, or of its `parts` micro-batches one after another
    (`given`, else split from it)."""
    if parts == 1:
        return step(lengths, run)
    split = given if given is not None else split_batch(lengths, parts)
    return micro_batched_step([step(part, run) for part in split])


def _step_function(variant: Variant) -> Callable[[np.ndarray, RunModel], StepResult]:
    """How a variant's step on a batch is simulated."""
    if variant.bytescale:
        return simulate_bytescale
    if variant.hybrid_cp:
        return simulate_hybrid_cp
    if variant.dynamic_cp:
        return simulate_dynamic_cp
    return simulate_te_padded if variant.te_padding else simulate_batch


def simulate_te_padded(lengths: np.ndarray, run: RunModel) -> StepResult:
    """One step of the configured composition with every sequence padded as TE's THD CP
    pads it over all ranks (`te_padded`); L grows to the padded batch's share where the
    padding overflows it. The padded tokens are computed and sent; the result counts the
    real ones.

    Raises:
        PlacementError, ConfigError: as `simulate_batch`.
    """
    world = run.hardware.topology.world_size
    padded = te_padded(lengths, world)
    capacity = max(run.config.train.tokens_per_rank, -(-int(padded.sum()) // world))
    train = dataclasses.replace(run.config.train, tokens_per_rank=capacity)
    run = dataclasses.replace(run, config=dataclasses.replace(run.config, train=train))
    step = simulate_batch(padded, run)
    return dataclasses.replace(step, tokens=int(np.asarray(lengths, dtype=np.int64).sum()))


def variant_config(config: Config, name: str, tokens_per_rank: int) -> Config:
    """`config` with the variant's placement, routing and remap, and L = `tokens_per_rank`."""
    variant = VARIANTS[name]
    late = config.parallel.prefetch_after_attention
    weights = config.parallel.weights
    if WEIGHTS_AXES[weights].family is not Family.AUTOGRAD:
        weights = WeightsMode.REPLICATED
    parallel = dataclasses.replace(
        config.parallel,
        sequence=variant.placement,
        weights=weights,
        routing=variant.routed,
        remap=variant.remap,
        zone_policy=variant.zone_policy or config.parallel.zone_policy,
        dkv_wire=variant.dkv_wire or config.parallel.dkv_wire,
        prefetch_after_attention=False if variant.foreign else late,
        prefetch_depth=1 if variant.foreign else config.parallel.prefetch_depth,
    )
    train = dataclasses.replace(config.train, tokens_per_rank=tokens_per_rank)
    return dataclasses.replace(config, parallel=parallel, train=train)
