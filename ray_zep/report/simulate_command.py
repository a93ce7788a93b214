"""`ray-zep simulate`: predicted step time and throughput of strategies on a cluster.

Batches come from a Table 2 distribution (`--distribution`, `--tokens`; L is the
batch's tokens per rank times `--headroom`) or from the configured data, as
training would draw them (L = train.tokens_per_rank). Compute rates come from a
calibration file (`ray-zep bench calibrate`) or the preset of the topology's GPU.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np

from ray_zep.config import Config
from ray_zep.costmodel import ComputeRates
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.report.output import write_record
from ray_zep.report.plan_command import PlanRequest, request_lengths
from ray_zep.report.timeline import draw_throughput, draw_timelines
from ray_zep.sim.compare import StrategyResult, simulate_strategies, strategy_names
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.step import RunModel
from ray_zep.topology import Topology, build_topology

TIMELINE_RANKS = 16
"""Ranks drawn in the timeline picture (the first ones)."""


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

    def over_ideal(self, result: StrategyResult) -> float | None:
        """Mean over the batches of the strategy's step / the batch's ideal step."""
        if not result.steps or len(self.ideal_seconds) != len(result.steps):
            return None
        ratios = [s.step_seconds / i for s, i in zip(result.steps, self.ideal_seconds, strict=True)]
        return float(np.mean(ratios))

    def table(self) -> str:
        lines = [
            f"{self.topology.name}: {self.topology.nodes} x {self.topology.gpus_per_node} "
            f"{self.topology.gpu_model}, model {self.config.model.preset}, "
            f"{len(self.batches)} batches of {int(np.mean([b.sum() for b in self.batches]))} "
            f"tokens, L={self.tokens_per_rank}; rates: {self.rates.source}",
            f"{'strategy':<26}{'step s':>9}{'k tok/s':>10}{'vs te_cp':>10}{'x ideal':>9}"
            f"{'fwd ms/layer':>14}{'bwd ms/layer':>14}{'grad s':>8}{'remap':>7}",
        ]
        for name, result in self.results.items():
            if result.error:
                lines.append(f"{name:<26}  cannot place: {result.error}")
                continue
            steps = result.steps
            fwd = np.mean([s.forward_layer_seconds for s in steps]) * 1e3
            bwd = np.mean([s.backward_layer_seconds for s in steps]) * 1e3
            remapped = sum(s.remap is not None for s in steps)
            over = self.over_ideal(result)
            lines.append(
                f"{name:<26}{result.step_seconds:>9.3f}{result.tokens_per_second / 1e3:>10.1f}"
                f"{result.speedup_vs_te_cp:>9.2f}x{over or float('nan'):>8.2f}x{fwd:>14.2f}"
                f"{bwd:>14.2f}{steps[0].grad_sync_seconds:>8.3f}{remapped:>5}/{len(steps)}"
            )
        if self.ideal_seconds:
            lines.append(
                f"ideal step {np.mean(self.ideal_seconds):.3f} s: every FLOP spread evenly at "
                "its unsplit rate, no exposed communication (x ideal: step / ideal, per batch)"
            )
        return "\n".join(lines)

    def record(self) -> dict[str, object]:
        n_layers = build_shape(self.config.model).n_layers
        return {
            "topology": self.topology.to_dict(),
            "model": self.config.model.preset,
            "tokens_per_rank": self.tokens_per_rank,
            "rates": dataclasses.asdict(self.rates),
            "batches": [{"sequences": len(b), "tokens": int(b.sum())} for b in self.batches],
            "ideal_step_seconds": self.ideal_seconds,
            "strategies": {
                n: r.to_dict(n_layers) | {"step_over_ideal": self.over_ideal(r)}
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
    batches, capacity = batches_of(config, topology, request)
    results = simulate_strategies(config, hardware, batches, names, capacity, on_gpu)
    run = RunModel.create(config, hardware, on_gpu)
    ideal = [ideal_step_seconds(lengths, run) for lengths in batches]
    return SimulateResult(config, topology, hardware.rates, capacity, batches, results, ideal)


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
    # up a floor: the calibration file is `bench calibrate`'s record, read back here
    from ray_zep.bench.calibrate import Calibration

    measured = Calibration.load(calibration)
    if measured.link_latency_s is None:
        return Hardware(topology, measured.rates), True
    return measured.hardware(config.topology), False


def batches_of(config: Config, topology: Topology, request: SimulateRequest):
    """(lengths of each requested batch, L): sampled from a distribution with L = tokens per
    rank x headroom, or the configured data's first batches with L = train.tokens_per_rank."""
    world = topology.world_size
    if request.distribution is None:
        batches = [
            request_lengths(config, topology, PlanRequest(batch=b)) for b in range(request.batches)
        ]
        return batches, config.train.tokens_per_rank
    total = request.tokens or world * config.train.tokens_per_rank
    batches = []
    for b in range(request.batches):
        seeded = dataclasses.replace(config.train, seed=config.train.seed + b)
        plan_request = PlanRequest(distribution=request.distribution, tokens=total)
        batches.append(
            request_lengths(dataclasses.replace(config, train=seeded), topology, plan_request)
        )
    return batches, math.ceil(total / world * request.headroom)


def write_outputs(result: SimulateResult, json_path: str | None, out_dir: str) -> list[Path]:
    """JSON record (when asked), throughput bars and the first batch's layer timelines."""
    written = []
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep simulate"
    if json_path:
        written.append(write_record(Path(json_path), command, result.record()))
    out = Path(out_dir)
    placed = {n: r for n, r in result.results.items() if r.steps}
    title = f"{result.config.model.preset} on {result.topology.world_size} GPUs"
    speeds = [r.tokens_per_second for r in placed.values()]
    pictures = [draw_throughput(title, list(placed), speeds, out / "throughput.png")]
    panels = []
    for name, r in placed.items():
        panels += [
            (f"{name} forward", r.steps[0].forward),
            (f"{name} backward", r.steps[0].backward),
        ]
    ranks = range(min(TIMELINE_RANKS, result.topology.world_size))
    pictures.append(draw_timelines(panels, list(ranks), out / "timeline.png"))
    return written + [p for p in pictures if p is not None]  # None: no matplotlib, logged
