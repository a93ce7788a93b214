"""Train one rank of a job with plain torch.distributed (no Ray), for the dist tests.

Every rank builds the same batch stream from the config (the role the data
actor plays under Ray), positioned by the checkpoint it resumed from, and
trains through the library's `run_rank`.
"""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from ray_zep import steplog
from ray_zep.config import Config, load_config
from ray_zep.config.checks import torch_shards_experts
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.data.batching import BatchStream, Cursor, GlobalBatch
from ray_zep.data.builder import write_token_parquet
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.regroup import regroup
from ray_zep.data.shards import shard_for
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.topology import Topology, build_topology
from ray_zep.train.checkpoint import Progress, read_model_state
from ray_zep.train.loop import run_rank
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer

NEEDS_EXPERT_MESH = pytest.mark.skipif(
    not torch_shards_experts(),
    reason="torch < 2.12 has no per-parameter FSDP mesh: experts sharded over their "
    "replicas are refused when the config loads (ray_zep.config.checks)",
)
"""For tests that shard experts over their replicas (`parallel.ep` > 1 under fsdp / hsdp)."""

TIMEOUT_S = 60.0

SMALL_RUN = [
    "model.preset=tiny",
    "model.n_layers=2",
    "train.tokens_per_rank=192",
    "data.source=synthetic:arxiv",
    "data.length_scale=0.02",
    "metrics.progress=false",
    "train.adam_eps=1e-6",
    "metrics.memory_every=0",
    "metrics.summary_gpus=[]",
]
"""A run small enough for several processes on two cores, with varied lengths.

AdamW's eps is 1e-6 here: its update divides each gradient by the gradient's own
magnitude plus eps, so an entry whose gradient is below eps (a tiny model has a few,
around 6e-9) turns summation-order rounding of 1e-9, far below the 1e-5 tolerance on
gradients, into a visible difference of its update. With eps 1e-6 the same rounding
stays as small in the parameters as it is in the gradients. Memory is not measured
(`metrics.memory_every=0`): the tracker doubles a step's time; tests/test_memory.py
measures it."""


def mixed_dataset(path: Path) -> Path:
    """A Parquet file of documents from 1 to 300 tokens: with `train.tokens_per_rank=64`
    the long ones span ranks and nodes (rings, routing and remapping have work)."""
    rng = np.random.default_rng(3)
    lengths = [1, 3, 5, 7, 300, *[1, 2, 3, 1] * 8, 63, 129, 77, 2, 1, 40, 9, 250, 11]
    docs = [rng.integers(0, 256, size=n, dtype=np.int32) for n in lengths]
    return write_token_parquet(docs, path).path


def make_stream(config: Config, topology: Topology, progress: Progress) -> BatchStream:
    return BatchStream.from_config(
        open_configured_source(config),
        config,
        topology.world_size,
        cursor=Cursor.from_dict(progress.cursor) if progress.cursor else None,
        start_index=progress.step * config.train.micro_batches,
    )


class Stopped(Exception):
    """Raised on every rank at once to end a run after a given step (a lost node)."""


def loaded_config(config_path: Path | None, overrides: list[str]) -> Config:
    """`load_config`, remembered per process: a pooled rank loads the same few configs
    many times over (about 10 ms each); each caller gets its own copy."""
    text = None if config_path is None else Path(config_path).read_text()
    return copy.deepcopy(_load_once(config_path, text, tuple(overrides)))


@functools.lru_cache(maxsize=512)
def _load_once(config_path: Path | None, text: str | None, overrides: tuple[str, ...]) -> Config:
    """Keyed by the file's text too: a test that rewrites its YAML loads it again."""
    return load_config(config_path, list(overrides))


def train_rank(
    rank: int,
    world: int,
    overrides: list[str],
    config_path: Path | None = None,
    live_nodes: int | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train this rank; return losses, final parameters and the samples of each step.

    `live_nodes`: run on that many of the configured nodes, each step still training the
    configured global batch (as an elastic run does, in micro-batches); `stop_after`:
    end the run after that step, as a lost node would (its checkpoint must be saved)."""
    config = loaded_config(config_path, overrides)
    threads_before = set(threading.enumerate())  # a reused process may hold older runs'
    configured = build_topology(config.topology)
    topology = configured if live_nodes is None else configured.with_nodes(live_nodes)
    comm = create_comm(config, topology, TIMEOUT_S)
    state: dict[str, Any] = {"batches": {}}

    def start_data(progress: Progress) -> None:
        state["stream"] = make_stream(config, configured, progress)

    def fetch(step: int):
        if stop_after is not None and step >= stop_after:
            raise Stopped(step)
        micro = config.train.micro_batches
        batches = [_batch(state, step * micro + m) for m in range(micro)]
        parts = [p for b in batches for p in
                 regroup(b, config, configured.world_size, topology.world_size)]  # fmt: skip
        return [shard_for(part, config, topology)[rank] for part in parts]

    events: list[dict] = []
    try:
        trainer = run_rank(
            config,
            comm,
            torch.device("cpu"),
            Path(config.train.out_dir),
            fetch,
            start_data,
            events.append,
        )
    except Stopped:
        return {"losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"}}
    return {
        "losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"},
        # weight-passing modes hold only their own shard: its names, full-model keys;
        # FSDP2's shards are gathered whole (a collective: every rank returns them)
        "params": full_state(trainer.state_module),
        "samples": {
            s: [(p.doc, p.start, p.length) for p in b.pieces] for s, b in state["batches"].items()
        },
        "events": events,
        "weight_ledger": trainer.pipeline.weights.ledger if trainer.pipeline else None,
        # the routing layer's relay and mailbox threads this run started, still running
        "routing_threads": _new_routing_threads(threads_before),
    }


ROUTING_THREADS = ("ray-zep-relay", "ray-zep-mailbox")


def _new_routing_threads(before: set) -> list[str]:
    """Names of the routing threads started since `before` that still run."""
    return [t.name for t in set(threading.enumerate()) - before if t.name in ROUTING_THREADS]


def first_gradients(rank: int, overrides: list[str]) -> RankTrainer:
    """A trainer of this rank after computing (and syncing) the first batch's gradients."""
    config = loaded_config(None, overrides)
    topology = build_topology(config.topology)
    comm = create_comm(config, topology, TIMEOUT_S)
    batch = make_stream(config, topology, Progress(0, {})).next_batch()
    trainer = RankTrainer(config, comm, torch.device("cpu"))
    trainer.compute_gradients(shard_for(batch, config, topology)[rank])
    return trainer


def gradients_of(trainer: RankTrainer) -> dict[str, torch.Tensor]:
    return {name: _whole(p.grad).clone() for name, p in trainer.model.named_parameters()}


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state with FSDP2-sharded tensors gathered whole (collective)."""
    return {k: _whole(v).detach().clone() for k, v in module.state_dict().items()}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _batch(state: dict[str, Any], step: int) -> GlobalBatch:
    stream: BatchStream = state["stream"]
    while stream.next_index <= step:
        batch = stream.next_batch()
        state["batches"][batch.index] = batch
    return state["batches"][step]


def tokens_per_step(ledger: dict) -> dict[int, list[tuple[int, int]]]:
    """Each step's (document, token) positions, none twice in a step: ranks hold a
    sequence's fragments differently on 2 and 4 ranks, the tokens trained are the same
    (a document comes again in the next epoch, so steps may repeat one another)."""
    steps = {}
    for step, pieces in ledger.items():
        tokens = [(doc, t) for doc, start, length in pieces for t in range(start, start + length)]
        assert len(set(tokens)) == len(tokens), f"step {step} trained a token twice"
        steps[step] = sorted(tokens)
    return steps


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest ||a - b|| / ||b|| over tensors, and the tensor's name."""
    worst = (0.0, "")
    for name, ref in b.items():
        err = float((a[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        worst = max(worst, (err, name))
    return worst


def checkpoint_params(path: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Model parameters stored in a DCP checkpoint, read without a process group."""
    model = Transformer(build_shape(loaded_config(None, overrides).model))
    return read_model_state(path, model)


def jsonl_losses(run_dir: Path) -> dict[int, float]:
    """Loss of every step in metrics.jsonl (none before the file exists)."""
    rows = steplog.read_rows(run_dir / METRICS_FILE_NAME)
    return {row["step"]: row["loss"] for row in rows if "step_seconds" in row}


def train_rank_each(rank: int, world: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    """`train_rank` for several configs in turn on the same processes (one spawn)."""
    return [train_rank(rank, world, overrides) for overrides in runs]
