"""The per-rank training loop, independent of how processes were launched.

Ray workers and plain torch.distributed tests both run `run_rank`: it picks
the checkpoint to resume from on rank 0 and broadcasts the choice (every rank
loads the same one), asks the data side to start right after it, then trains,
checkpoints, records the samples of every step (ray_zep.train.ledger) and
reports.

Events passed to `report` (rank 0 only), all plain dicts:
    {"event": "start", "step": k}          training resumes after step k (0: fresh)
    {"event": "step", **StepStats}          one finished step
    {"event": "checkpoint", "step": k, "path": ...}
    {"event": "eval", "step": k, "loss": ..., "label_tokens": ..., "documents": ...,
     "seconds": ...}                        the validation loss after step k
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ray_zep.config import Config
from ray_zep.data.shards import RankShard
from ray_zep.distributed import Comm
from ray_zep.distributed.waiting import collectives_of
from ray_zep.errors import CheckpointError, ConfigError, ZepError
from ray_zep.train import checkpoint, checkpoint_dirs
from ray_zep.train.ledger import SampleLedger, rewind_departed
from ray_zep.train.trainer import RankTrainer

log = logging.getLogger(__name__)

FetchShards = Callable[[int], list[RankShard]]
"""Returns this rank's shards of the given step (0-based), one per micro-batch: step s
trains batches s x k ... s x k + k - 1 of the stream, k = `train.micro_batches`."""
StartData = Callable[[checkpoint.Progress], None]
"""Positions this rank's data source right after the given progress (every rank calls it
before the first step; a source shared by all ranks acts on rank 0's call): its next
batch is number progress.step x `train.micro_batches`."""
Report = Callable[[dict], None]


def run_rank(
    config: Config,
    comm: Comm,
    device: torch.device,
    run_dir: Path,
    fetch_shards: FetchShards,
    start_data: StartData | None = None,
    report: Report | None = None,
) -> RankTrainer:
    """Train this rank up to `train.steps`, resuming if a checkpoint exists.

    Returns:
        The trainer after the last step (tests inspect its parameters), its routing
        threads stopped (`RankTrainer.close`).
    """
    trainer = RankTrainer(config, comm, device)
    try:
        _train(trainer, config, comm, run_dir, fetch_shards, start_data, report)
    finally:
        trainer.close()  # the routing layer's threads; the parameters stay readable
    return trainer


def _train(
    trainer: RankTrainer,
    config: Config,
    comm: Comm,
    run_dir: Path,
    fetch_shards: FetchShards,
    start_data: StartData | None,
    report: Report | None,
) -> None:
    """`run_rank`'s steps, checkpoints and evaluations with `trainer`."""
    resume_from = _agree_on_checkpoint(run_dir, config, comm)
    progress = trainer.load(resume_from) if resume_from else checkpoint.Progress(0, {})
    ledger = SampleLedger(run_dir, comm.rank) if config.train.sample_ledger else None
    if ledger:
        ledger.rewind(progress.step)
        if comm.rank == 0:
            rewind_departed(run_dir, comm.world_size, progress.step)
    if start_data is not None:
        start_data(progress)
    if report and comm.rank == 0:
        report({"event": "start", "step": progress.step})
    if comm.distributed:
        dist.barrier(group=comm.group)
    every = config.train.checkpoint_every
    for step in range(progress.step, config.train.steps):
        started = time.perf_counter()
        shards = fetch_shards(step)
        fetched = time.perf_counter()
        with collectives_of(f"step {step + 1}", comm.timeout_s, comm.rank):
            stats = trainer.train_step(shards)
        stats.step_seconds = time.perf_counter() - started
        if ledger:
            for shard in shards:
                ledger.record(trainer.steps_done, shard)
        if report and comm.rank == 0:
            report({"event": "step", "data_seconds": fetched - started, **stats.to_dict()})
        last = trainer.steps_done == config.train.steps
        evaluate = _due(trainer.steps_done, config.train.eval_every)
        if (last and config.train.save_last) or evaluate or _due(trainer.steps_done, every):
            path = trainer.save(run_dir, shards[-1].cursor_after)
            if comm.rank == 0:
                checkpoint_dirs.prune_checkpoints(run_dir, config.train.keep_checkpoints)
            if report and comm.rank == 0:
                report({"event": "checkpoint", "step": trainer.steps_done, "path": str(path)})
            if evaluate:
                _evaluate(config, comm, path, trainer.steps_done, report)


def _due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0


def _evaluate(config: Config, comm: Comm, path: Path, step: int, report: Report | None) -> None:
    """Rank 0 evaluates the checkpoint of `step` on `data.eval_source` in one process (as
    `ray-zep eval` does); the others wait for its answer (within comm.timeout_s)."""
    from ray_zep.train.evaluate import run_eval
    from ray_zep.train.restore import ModelSource

    outcome: list[dict] = [{}]
    if comm.rank == 0:
        started = time.perf_counter()
        held_out = dataclasses.replace(config.data, source=config.data.eval_source)
        source = ModelSource(dataclasses.replace(config, data=held_out), path)
        try:
            result = run_eval(source, config.train.eval_batches or None)
            outcome = [
                {
                    "loss": result.loss,
                    "label_tokens": result.label_tokens,
                    "documents": len(result.documents),
                    "seconds": time.perf_counter() - started,
                }
            ]
        except ZepError as exc:
            outcome = [{"error": f"train.eval_every at step {step}: {exc}"}]
    if comm.distributed:
        dist.broadcast_object_list(outcome, src=0, group=comm.group)
    if "error" in outcome[0]:
        raise ConfigError(outcome[0]["error"])
    if report and comm.rank == 0:
        report({"event": "eval", "step": step, **outcome[0]})


def _agree_on_checkpoint(run_dir: Path, config: Config, comm: Comm) -> Path | None:
    """Rank 0 picks the checkpoint (or the error) and every rank gets the same answer."""
    choice: list[dict[str, str | None]] = [{}]
    if comm.rank == 0:
        try:
            found = checkpoint_dirs.resume_checkpoint(
                run_dir, config.train.resume, config.parallel.ep
            )
            choice = [{"path": str(found) if found else None}]
        except CheckpointError as exc:
            choice = [{"error": str(exc)}]
    if comm.distributed:
        dist.broadcast_object_list(choice, src=0, group=comm.group)
    if choice[0].get("error"):
        raise CheckpointError(str(choice[0]["error"]))
    path = choice[0].get("path")
    if path:
        log.info("resuming from %s", path)
    return Path(path) if path else None
