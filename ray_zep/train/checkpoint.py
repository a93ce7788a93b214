"""Checkpoints with torch.distributed.checkpoint (DCP): saving and loading them. Where
they live and which one a run resumes from is `ray_zep.train.checkpoint_dirs`.

A checkpoint of step k (k steps done) lives in
`<train.out_dir>/checkpoints/step_<k>/` and holds, through DCP: the model, the
optimizer state, every rank's RNG state, the step and the data cursor. After
every rank has written its part, rank 0 writes a `COMPLETE` marker; a folder
without it is an interrupted save and is ignored. The newest complete
checkpoint is what a restarted run resumes from.

Replicated tensors (data parallelism) are written once by DCP's planner;
parameters that differ between ranks (experts split by expert parallelism)
are stored under names unique to their shard. The data cursor can be read
without a process group (`read_progress`).

Every weights mode writes the same keys: parameters by their name in the whole
model (FSDP2's DTensors as the global tensor, a weight-passing rank's shard under
the names of the layers it owns) and the optimizer state flattened per parameter.
So a checkpoint resumes under another weights mode (replicated, fsdp, hsdp,
tawpipe, ring_relay) and another number of ranks: DCP reads each rank's part from
whatever ranks wrote it. Only the expert-parallel degree must match (it names the
expert shards). RNG states are per rank and come back only at the same rank count
(the step uses none: no dropout, the data order comes from the cursor). The mode's
name is in the COMPLETE marker for the resume log only, so a run saved under a
former name (`weipipe`, now `ring_relay`) resumes like any other.

Loading never unpickles code: the non-tensor items DCP stores as pickled
bytes (step, cursor, optimizer counters) are read with `weights_only=True`,
so a checkpoint that holds anything but plain data is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ray_zep import constants
from ray_zep.distributed import Comm
from ray_zep.errors import CheckpointError, first_line
from ray_zep.train.checkpoint_dirs import Progress, check_resumable, read_marker

log = logging.getLogger(__name__)

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer state keyed by parameter name, so every weights mode writes the same keys."""


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    comm: Comm,
    ep: int = 1,
    weights: str = "",
) -> None:
    """Write a checkpoint collectively (every rank calls it).

    Args:
        ep: the run's expert-parallel degree (a resuming run must match it).
        weights: the run's weights mode, recorded for the log of a resume.
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    names = _shard_names(model)
    state = {
        "model": _renamed(model_state, names),
        "optim": _renamed_optim(optim_state, names),
        "progress": _progress_state(progress),
        "rng": {f"rank{comm.rank}": _rng_state()},
    }
    try:
        with _quiet_single_process():
            dcp.save(
                state,
                checkpoint_id=str(path),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
        if comm.distributed:
            dist.barrier(group=comm.group)
    except Exception as exc:
        first = first_line(exc)
        raise CheckpointError(
            f"saving the checkpoint of step {progress.step} to {path} on rank {comm.rank} "
            f"failed or exceeded comm.timeout_s={comm.timeout_s:g}: {first}"
        ) from exc
    if comm.rank == 0:
        marker = {
            "step": progress.step,
            "world_size": comm.world_size,
            "ep": ep,
            "weights": weights,
        }
        (path / constants.CHECKPOINT_COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        log.info("saved checkpoint of step %d to %s", progress.step, path)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Comm,
    ep: int = 1,
    weights: str = "",
) -> Progress:
    """Load a checkpoint into the model and optimizer collectively; return its progress.

    Raises:
        CheckpointError: the checkpoint is incomplete or was saved with another
            `parallel.ep`.
    """
    marker = check_resumable(path, ep)
    same_ranks = marker.get("world_size") == comm.world_size
    if comm.rank == 0 and (not same_ranks or marker.get("weights", weights) != weights):
        log.info(
            "resuming %s (saved by %s rank(s), parallel.weights=%s) on %d rank(s) with "
            "parallel.weights=%s",
            path,
            marker.get("world_size"),
            marker.get("weights") or "?",
            comm.world_size,
            weights,
        )
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    names = _shard_names(model)
    state: dict[str, Any] = {
        "model": _renamed(model_state, names),
        "optim": _renamed_optim(optim_state, names),
        "progress": _progress_state(Progress(0, {})),
    }
    if same_ranks:
        state["rng"] = {f"rank{comm.rank}": _rng_state()}
    with _quiet_single_process():
        _load(state, path, comm.group, not comm.distributed)
    back = {new: old for old, new in names.items()}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=_renamed(state["model"], back),
        optim_state_dict=_renamed_optim(state["optim"], back),
        options=OPTIONS,
    )
    if same_ranks:
        _set_rng_state(state["rng"][f"rank{comm.rank}"])
    return _progress_from_state(state["progress"])


def read_progress(path: Path) -> Progress:
    """Step and data cursor of a checkpoint, read without a process group."""
    read_marker(path)
    state = {"progress": _progress_state(Progress(0, {}))}
    with _quiet_single_process():
        _load(state, path, None, True)
    return _progress_from_state(state["progress"])


def read_model_state(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, read without a process group.

    Args:
        path: a complete checkpoint.
        model: a model of the checkpoint's shape; its state dict gives the keys
            and shapes to fill (the model itself is not changed).
    """
    read_marker(path)
    state = {"model": model.state_dict()}
    with _quiet_single_process():
        _load(state, path, None, True)
    return state["model"]


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with its pickled items read as plain data only."""

    def load_bytes(self, read_item, value) -> None:
        try:
            item = torch.load(value, weights_only=True)
        except Exception as exc:  # an UnpicklingError names the refused global
            lines = str(exc).splitlines() or ["unreadable"]
            reason = next((line for line in lines if "global" in line.lower()), lines[0])
            raise CheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} is not plain data and is not "
                f"loaded (weights_only=True): {reason.strip()}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
        else:
            self.state_dict[read_item.dest_index.fqn] = item


def _load(state: dict[str, Any], path: Path, group, no_dist: bool) -> None:
    try:
        dcp.load(
            state,
            checkpoint_id=str(path),
            process_group=group,
            no_dist=no_dist,
            planner=WeightsOnlyLoadPlanner(),
        )
    except CheckpointException as exc:
        refused = _refusal(exc)
        if refused is None:
            raise
        raise CheckpointError(f"{path}: {refused}") from None


def _refusal(exc: CheckpointException) -> str | None:
    """The message of a CheckpointError among DCP's per-rank (exception, trace) failures."""
    for inner, _ in exc.failures.values():
        if isinstance(inner, CheckpointError):
            return str(inner)
    return None


def _shard_names(model: torch.nn.Module) -> dict[str, str]:
    """Checkpoint names of the parameters this rank holds a shard of."""
    names = {}
    for prefix, module in model.named_modules():
        sharded = getattr(module, "sharded_parameter_names", None)
        for name, unique in (sharded() if sharded else {}).items():
            names[f"{prefix}.{name}" if prefix else name] = (
                f"{prefix}.{unique}" if prefix else unique
            )
    return names


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(key, key): value for key, value in state.items()}


def _renamed_optim(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The flattened optimizer state (`state.<param>.<item>`, `param_groups.<param>.<key>`)
    with parameter names replaced."""
    if not names:
        return state
    out = {}
    for key, value in state.items():
        section, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{section}.{new}{rest[len(old) :]}"
                break
        out[key] = value
    return out


def _progress_state(progress: Progress) -> dict[str, Any]:
    # The cursor travels as one JSON string so the state's structure is the
    # same whatever keys the cursor has (DCP matches saved and loaded keys).
    return {"step": progress.step, "cursor": json.dumps(progress.cursor, sort_keys=True)}


def _progress_from_state(state: dict[str, Any]) -> Progress:
    return Progress(int(state["step"]), json.loads(state["cursor"]))


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when no_dist says so.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> torch.Tensor:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def _set_rng_state(state: torch.Tensor) -> None:
    cpu_size = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu_size].clone())
    if state.numel() > cpu_size:
        torch.cuda.set_rng_state(state[cpu_size:].clone())
