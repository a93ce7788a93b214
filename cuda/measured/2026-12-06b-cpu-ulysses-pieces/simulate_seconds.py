"""Seconds `simulate_plan` takes on `bench scale`'s 13b github batch at 1,024 GPUs of
cluster A (L = 8,960), USP head exchanges whole and in 4 pieces (best of 3, after one warm
call; the placement planned once, as the code at hand plans it). Run at a commit before
the pieces, both lines time the pairwise whole exchanges of then.

Usage: python simulate_seconds.py
"""
import dataclasses
import time

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology

overrides = ["topology.preset=cluster_a", "topology.nodes=128", "model.preset=13b",
             "parallel.weights=fsdp", "train.tokens_per_rank=8960"]
config = variant_config(load_config(None, overrides), "zeppelin", 8960)
hardware = Hardware.preset(build_topology(config.topology))
run = RunModel.create(config, hardware)
lengths = batch_lengths("github", 4096 * 1024, 0)
plan, remap = plan_batch(lengths, run)
for pieces in (1, 4):
    if hasattr(config.parallel, "ulysses_chunks"):
        parallel = dataclasses.replace(config.parallel, ulysses_chunks=pieces)
        played = dataclasses.replace(run, config=dataclasses.replace(config, parallel=parallel))
    else:
        played = run
    simulate_plan(plan, played, config.parallel.routing, remap)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        simulate_plan(plan, played, config.parallel.routing, remap)
        times.append(time.perf_counter() - start)
    print(f"pieces={pieces}: {min(times):.2f} s")
