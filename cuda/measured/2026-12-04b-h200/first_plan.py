"""The planner's one-time costs in a fresh process: import, the first plan_step (where the
compiled kernels compile, or load from numba's cache), and the second.

usage: PYTHONPATH=TREE python first_plan.py GPUS
7b, arxiv, 4k tokens per GPU, cluster_a, zeppelin's config as bench scale builds it.
"""

import sys
import time

started = time.perf_counter()
import ray_zep.step_plan as step_plan  # noqa: E402
from ray_zep.config import load_config  # noqa: E402
from ray_zep.data.synthetic import batch_lengths  # noqa: E402
from ray_zep.sim.compare import variant_config  # noqa: E402
from ray_zep.sim.hardware import Hardware  # noqa: E402
from ray_zep.sim.step import RunModel  # noqa: E402
from ray_zep.topology import build_topology  # noqa: E402

imported = time.perf_counter()
gpus = int(sys.argv[1])
config = load_config(
    None,
    [
        "topology.preset=cluster_a",
        f"topology.nodes={gpus // 8}",
        "model.preset=7b",
        "train.tokens_per_rank=4096",
        "parallel.weights=fsdp",
    ],
)
hardware = Hardware.preset(build_topology(config.topology))
run = RunModel.create(variant_config(config, "zeppelin", 4096), hardware)
lengths = batch_lengths("arxiv", 4096 * gpus, 0)
ready = time.perf_counter()
step_plan.plan_step(lengths, run.config, hardware.topology, run.shape)
first = time.perf_counter()
step_plan.plan_step(lengths, run.config, hardware.topology, run.shape)
second = time.perf_counter()
print(
    f"import {imported - started:.2f} s, setup {ready - imported:.2f} s, "
    f"first plan_step {first - ready:.2f} s, second {second - first:.3f} s"
)
