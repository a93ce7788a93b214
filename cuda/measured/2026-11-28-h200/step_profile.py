"""Where one rank's training step spends the GPU's time: `bench step`'s case (the 7B width,
8 layers, compiled blocks, loss in chunks of 4,096, packed, 16,384 tokens), its trainer's
step after two warm-up steps, read with torch's profiler; kernels grouped by kind."""

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ray_zep.bench import step as bench
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.shards import shard_for
from ray_zep.topology import build_topology
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer

KINDS = (
    ("flash attention", ("flash", "fmha")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    ("compiled (Triton)", ("triton",)),
    ("optimizer (foreach)", ("multi_tensor", "foreach")),
    ("copies, casts", ("copy", "cast", "memcpy", "memset", "fill")),
    ("reductions", ("reduce",)),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(w in low for w in keys)), "other elementwise")


args = argparse.Namespace(config=None, overrides=[], width="7b", layers=8, loss_chunk=4096,
                          compile=True, tokens="16384", batches="packed", steps=4)
base = bench._base_config(args)
config = bench._case_config(base, "packed", 16384, 4)
device = torch.device("cuda")
topology = build_topology(config.topology)
stream = BatchStream.from_config(open_configured_source(config), config, 1)
trainer = RankTrainer(config, create_comm(config, topology), device)
for _ in range(3):
    trainer.train_step(shard_for(stream.next_batch(), config, topology)[0])
shard = shard_for(stream.next_batch(), config, topology)[0]
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    started = time.perf_counter()
    stats = trainer.train_step(shard)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
busy = sum(e.self_device_time_total for e in kernels) / 1e6
by_kind = collections.Counter()
for e in kernels:
    by_kind[kind(e.key)] += e.self_device_time_total / 1e6
print(f"step {wall * 1e3:.1f} ms wall, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%}), "
      f"{len(shard.lengths)} sequences, model {stats.model_flops / wall / 1e12:.0f} TFLOP/s")
for name, seconds in by_kind.most_common():
    print(f"  {name:22s} {seconds * 1e3:8.1f} ms  {seconds / wall:6.1%} of the step")
print("top kernels:")
for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
    print(f"  {e.self_device_time_total / 1e3:8.2f} ms x{e.count:4d}  {kind(e.key)[:12]:12s} {e.key[:90]}")
