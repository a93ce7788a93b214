"""plan_step wall time on bench scale's 4k batches, the median of REPEATS calls a row.

usage: PYTHONPATH=TREE python plan_step_times.py GPUS REPEATS ROWS_JSON
ROWS_JSON: a `bench scale` record; its zeppelin rows give model, distribution and L.
Each row: zeppelin's config (cluster_a, fsdp, `variant_config`), seed 0's batch, one call
first (its one-time costs left out), then REPEATS timed calls of `plan_step` (the
placement, routing and bytes, as the data actor runs a step), with its parts.
"""

import collections
import json
import sys
import time

import ray_zep.partition.plan_memory as plan_memory
import ray_zep.partition.zeppelin as zeppelin
import ray_zep.step_plan as step_plan
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.topology import build_topology

gpus, repeats, record = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
spent = collections.Counter()


def timed(module, name, key):
    inner = getattr(module, name)

    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started

    setattr(module, name, call)


timed(zeppelin, "balance", "balance")
timed(plan_memory, "keep_where_room", "keep_room")
timed(step_plan, "choose_remap", "remap")
timed(step_plan, "attention_step_parts", "traffic")
with open(record) as f:
    rows = json.load(f)["rows"]
for row in rows:
    if row["placement"] != "zeppelin":
        continue
    L = row["tokens_per_rank"]
    config = load_config(
        None,
        [
            "topology.preset=cluster_a",
            f"topology.nodes={gpus // 8}",
            f"model.preset={row['model']}",
            f"train.tokens_per_rank={L}",
            "parallel.weights=fsdp",
        ],
    )
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(variant_config(config, "zeppelin", L), hardware)
    lengths = batch_lengths(row["distribution"], 4096 * gpus, 0)
    step_plan.plan_step(lengths, run.config, hardware.topology, run.shape)
    calls = []
    for _ in range(repeats):
        spent.clear()
        started = time.perf_counter()
        step_plan.plan_step(lengths, run.config, hardware.topology, run.shape)
        calls.append((time.perf_counter() - started, dict(spent)))
    calls.sort(key=lambda call: call[0])
    seconds, parts = calls[len(calls) // 2]
    print(
        f"{row['model']:4s} {row['distribution']:10s} L={L} plan_step median "
        f"{seconds * 1e3:.0f} ms (least {calls[0][0] * 1e3:.0f})",
        {key: round(value * 1e3) for key, value in parts.items()},
        flush=True,
    )
