"""plan_step in ms (best of 3, after one warm call) of `bench scale`'s batches at GPUS
GPUs, USP head exchanges costed whole (1) and in 4 pieces (4).

Usage: python plan_step_ms.py GPUS
"""
import time, statistics
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.step_plan import plan_step
from ray_zep.topology import build_topology
import sys
gpus = int(sys.argv[1])
for model, L in (("7b", 6400), ("13b", 8960)):
    for dist in ("arxiv", "github", "prolong64k", "chat"):
        out = []
        for k in (1, 4):
            config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus//8}", f"model.preset={model}", "parallel.weights=fsdp", f"train.tokens_per_rank={L}", f"parallel.ulysses_chunks={k}"])
            config = variant_config(config, "zeppelin", L)
            topology = build_topology(config.topology)
            shape = RunModel.create(config, Hardware.preset(topology)).shape
            lengths = batch_lengths(dist, 4096 * gpus, 0)
            plan_step(lengths, config, topology, shape)
            ts = []
            for _ in range(3):
                t = time.perf_counter(); plan_step(lengths, config, topology, shape); ts.append(time.perf_counter() - t)
            out.append(round(min(ts) * 1e3, 1))
        print(gpus, model, dist, out, flush=True)
