"""`ray-zep plan`'s summary of the scale bench's batches at 256 GPUs of cluster A (7B, 4k
tokens per GPU, L = 5,120), for the tests of what the summary says."""

from __future__ import annotations

from ray_zep.bench.scale import batch_lengths
from ray_zep.config import load_config
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.stats import PlanStats, plan_stats
from ray_zep.report.placement import summary_line
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch
from ray_zep.topology import build_topology


def summaries(overrides: list[str], datas: tuple[str, ...]) -> dict:
    """Per data mix: (its first batch's plan, the plan's stats, the summary line)."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=32",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", *overrides])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    out: dict[str, tuple[AttentionPlan, PlanStats, str]] = {}
    for data in datas:
        plan, _ = plan_batch(batch_lengths(data, 4096 * 256, 0), run)
        stats = plan_stats(plan, run.shape)
        out[data] = (plan, stats, summary_line(plan, stats))
    return out
