"""Peak resident memory of each rank of 2 (gloo, CPU) once its trainer is built, the
weights made whole first and then split (`deferred=False`, as before) against made part
by part after splitting (`deferred=True`), 7b width and N layers, fsdp.
Usage (from the repository root): PYTHONPATH=. python3 host_peak.py LAYERS"""

import resource
import sys
import time

import torch

from ray_zep.config import load_config
from ray_zep.topology import build_topology
from ray_zep.train import build, trainer
from ray_zep.train.setup import create_comm
from tests.helpers.procs import run_fresh_ranks


def built(rank: int, world: int, layers: int, deferred: bool) -> tuple[float, float]:
    config = load_config(
        None,
        [
            "topology.nodes=1",
            f"topology.gpus_per_node={world}",
            "model.preset=7b",
            f"model.n_layers={layers}",
            "parallel.weights=fsdp",
            "metrics.memory_every=0",
        ],
    )

    def made(config, device, dtype, **_):  # the trainer asks for deferred weights
        return build.build_model(config, device, dtype, deferred=deferred)

    trainer.build_model = made
    started = time.perf_counter()
    trainer.RankTrainer(
        config, create_comm(config, build_topology(config.topology), 600.0), torch.device("cpu")
    )
    seconds = time.perf_counter() - started
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, seconds  # GiB


def main() -> None:
    layers = int(sys.argv[1])
    for deferred in (False, True):
        out = run_fresh_ranks(built, 2, layers, deferred, timeout_s=900)
        label = "part by part (deferred)" if deferred else "whole, then split"
        print(
            f"{label}: peak RSS per rank "
            + ", ".join(f"{g:.2f} GiB" for g, _ in out)
            + "; trainer built in "
            + ", ".join(f"{s:.1f} s" for _, s in out)
        )


if __name__ == "__main__":
    main()
