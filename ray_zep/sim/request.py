"""What `ray-zep plan` and `ray-zep simulate` ask for, and the strategies simulated on it.

A batch to place is explicit lengths, a draw from a Table 2 distribution, or a
batch of the configured data as training would draw it (`BatchRequest`). A
simulation samples `SimulateRequest.batches` of them (from a distribution: L is
the batch's tokens per rank times `headroom`; from the data: L =
train.tokens_per_rank) and plays every requested strategy on the cluster: the
topology's GPU preset, or a calibration file (`ray-zep bench calibrate`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ray_zep.command_args import parse_lengths
from ray_zep.config import Config
from ray_zep.costmodel import ComputeRates
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.sim.bound import StepBound, over_bound, step_bound
from ray_zep.sim.calibration import Calibration
from ray_zep.sim.compare import (
    REFERENCE,
    StrategyResult,
    simulate_strategies,
    strategy_names,
    variant_config,
)
from ray_zep.sim.gpu_time import mean_gpu_time_shares
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.micro_step import split_batch
from ray_zep.sim.phase_setter import PhaseSetter, phase_setters
from ray_zep.sim.replay import data_batches
from ray_zep.sim.step import RunModel
from ray_zep.topology import Topology, build_topology


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """What to place: explicit lengths, a synthetic distribution, or a batch of the data."""

    lengths: str | None = None
    distribution: str | None = None
    tokens: int | None = None
    batch: int = 0


def request_lengths(config: Config, topology: Topology, request: BatchRequest) -> np.ndarray:
    """Sequence lengths of the batch to place.

    Raises:
        ConfigError: both --lengths and --distribution, a bad value of either, or a
            negative --batch.
    """
    chosen = [request.lengths is not None, request.distribution is not None]
    if all(chosen):
        raise ConfigError("give either --lengths or --distribution, not both")
    if request.lengths is not None:
        return parse_lengths(request.lengths)
    if request.distribution is not None:
        from ray_zep.data.synthetic import batch_lengths

        total = request.tokens or topology.world_size * config.train.tokens_per_rank
        if total < 1:
            raise ConfigError(f"--tokens={total} must be >= 1")
        return batch_lengths(request.distribution, total, config.train.seed)
    if request.batch < 0:
        raise ConfigError(f"--batch={request.batch} must be >= 0")
    lengths, _ = data_batches(config, topology.world_size, request.batch, 1)[0]
    return lengths


@dataclasses.dataclass(frozen=True)
class SimulateRequest:
    strategies: str | None = None
    ablation: bool = False
    batches: int = 3
    distribution: str | None = None
    tokens: int | None = None
    headroom: float = 1.25
    calibration: str | None = None

    def __post_init__(self) -> None:
        if self.batches < 1:
            raise ConfigError(f"--batches={self.batches} must be >= 1")
        if self.headroom < 1.0:
            raise ConfigError(f"--headroom={self.headroom} must be >= 1 (L >= tokens per rank)")


@dataclasses.dataclass
class SimulateResult:
    config: Config
    topology: Topology
    rates: ComputeRates
    tokens_per_rank: int
    batches: list[np.ndarray]
    results: dict[str, StrategyResult]
    ideal_seconds: list[float] = dataclasses.field(default_factory=list)
    """Each batch's ideal step (`ray_zep.sim.ideal`)."""
    bounds: list[StepBound] = dataclasses.field(default_factory=list)
    """Each batch's step bound (`ray_zep.sim.bound`)."""
    _setters: dict[str, list[PhaseSetter]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    """`phase_setters` by strategy, worked out once for the table and the record."""

    def over_ideal(self, result: StrategyResult) -> float | None:
        """Mean over the batches of the strategy's step / the batch's ideal step."""
        return _mean_ratio(result, self.ideal_seconds)

    def over_bound(self, result: StrategyResult) -> float | None:
        """Mean over the batches of the strategy's step / the batch's bound."""
        return _mean_ratio(result, [b.seconds for b in self.bounds])

    def beyond_bound(self, result: StrategyResult) -> dict[str, float] | None:
        """Mean over the batches of where the step's time beyond its bound goes
        (`ray_zep.sim.bound.over_bound`); None for steps without layer timelines."""
        if not result.steps or len(self.bounds) != len(result.steps):
            return None
        n_layers = build_shape(self.config.model).n_layers
        parts = [over_bound(s, b, n_layers) for s, b in zip(result.steps, self.bounds, strict=True)]
        if any(p is None for p in parts):
            return None
        return {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}

    def gpu_time(self, result: StrategyResult) -> dict[str, float] | None:
        """Mean over the batches of where the ranks' GPU-time goes
        (`ray_zep.sim.gpu_time`); None for steps without whole-step layer timelines."""
        return mean_gpu_time_shares(result.steps, self.topology.world_size)

    def phase_setters(self, result: StrategyResult) -> list[PhaseSetter]:
        """The ranks ending the first batch's forward and backward, and what they hold
        (`ray_zep.sim.phase_setter`); empty where the strategy placed nothing."""
        if result.name not in self._setters:
            steps = result.steps
            self._setters[result.name] = phase_setters(steps[0]) if steps else []
        return self._setters[result.name]

    def record(self) -> dict[str, object]:
        n_layers = build_shape(self.config.model).n_layers
        return {
            "topology": self.topology.to_dict(),
            "model": self.config.model.preset,
            "tokens_per_rank": self.tokens_per_rank,
            "rates": dataclasses.asdict(self.rates),
            "batches": [{"sequences": len(b), "tokens": int(b.sum())} for b in self.batches],
            "ideal_step_seconds": self.ideal_seconds,
            "bounds": [dataclasses.asdict(b) for b in self.bounds],
            "strategies": {
                n: r.to_dict(n_layers)
                | {
                    "step_over_ideal": self.over_ideal(r),
                    "step_over_bound": self.over_bound(r),
                    "beyond_bound_seconds": self.beyond_bound(r),
                    "gpu_time_shares": self.gpu_time(r),
                    "phase_setters": [s.to_dict() for s in self.phase_setters(r)],
                }
                for n, r in self.results.items()
            },
        }


def run_simulate(config: Config, request: SimulateRequest) -> SimulateResult:
    """Sample the batches and simulate every requested strategy on them.

    Raises:
        ConfigError: bad options or calibration file.
    """
    names = strategy_names(request.strategies, request.ablation)
    hardware, on_gpu = request_hardware(config, request.calibration)
    topology = hardware.topology
    batches, steps, capacity = step_batches(config, topology, request)
    results = simulate_strategies(config, hardware, batches, names, capacity, on_gpu, steps)
    run = RunModel.create(config, hardware, on_gpu)
    ideal = [ideal_step_seconds(lengths, run) for lengths in batches]
    # the bound at the variants' L and weights mode (`variant_config`)
    bounded = RunModel.create(variant_config(config, REFERENCE, capacity), hardware, on_gpu)
    bounds = [step_bound(lengths, bounded) for lengths in batches]
    return SimulateResult(
        config, topology, hardware.rates, capacity, batches, results, ideal, bounds
    )


def _mean_ratio(result: StrategyResult, per_batch: list[float]) -> float | None:
    if not result.steps or len(per_batch) != len(result.steps):
        return None
    steps = [s.step_seconds for s in result.steps]
    return float(np.mean(np.asarray(steps) / np.asarray(per_batch)))


def request_hardware(config: Config, calibration: str | None) -> tuple[Hardware, bool]:
    """(the cluster to simulate, whether it trains on GPUs): the topology's preset, or a
    calibration's rates; a CPU calibration (it measured links) stands for the config's
    virtual cluster of processes on this machine.

    Raises:
        ConfigError: the calibration file cannot be read.
    """
    topology = build_topology(config.topology)
    if calibration is None:
        return Hardware.preset(topology), True
    measured = Calibration.load(calibration)
    if measured.link_latency_s is None:
        return Hardware(topology, measured.rates), True
    return measured.hardware(config.topology), False


def batches_of(
    config: Config, topology: Topology, request: SimulateRequest
) -> tuple[list[np.ndarray], int]:
    """(lengths of each requested step's batch, L): `step_batches`' batches."""
    batches, _, capacity = step_batches(config, topology, request)
    return batches, capacity


def step_batches(
    config: Config, topology: Topology, request: SimulateRequest
) -> tuple[list[np.ndarray], list[list[np.ndarray]], int]:
    """(lengths of each requested step's batch, its micro-batches, L): sampled from a
    distribution with L = tokens per rank x headroom, or the configured data's first
    batches with L = train.tokens_per_rank. With `train.micro_batches` = k above 1 a step
    trains k batches of L: k of the data's consecutive batches, or by default k x ranks x
    L sampled tokens split into k parts of about equal tokens
    (`ray_zep.sim.micro_step.split_batch`), L then being a part's tokens per rank x
    headroom."""
    world, parts = topology.world_size, config.train.micro_batches
    if request.distribution is None:
        if parts == 1:
            steps = [[request_lengths(config, topology, BatchRequest(batch=b))]
                     for b in range(request.batches)]  # fmt: skip
        else:
            drawn = [
                lengths for lengths, _ in data_batches(config, world, 0, request.batches * parts)
            ]
            steps = [drawn[b * parts : (b + 1) * parts] for b in range(request.batches)]
        batches = [one[0] if parts == 1 else np.concatenate(one) for one in steps]
        return batches, steps, config.train.tokens_per_rank
    total = request.tokens or world * config.train.tokens_per_rank * parts
    batches = []
    for b in range(request.batches):
        seeded = dataclasses.replace(config.train, seed=config.train.seed + b)
        batch_request = BatchRequest(distribution=request.distribution, tokens=total)
        batches.append(
            request_lengths(dataclasses.replace(config, train=seeded), topology, batch_request)
        )
    steps = [split_batch(lengths, parts) for lengths in batches]
    return batches, steps, math.ceil(total / world / parts * request.headroom)
