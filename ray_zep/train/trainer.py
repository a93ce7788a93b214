"""One rank's training state and step.

`RankTrainer` builds the model (`ray_zep.train.build`), applies the parallel axes
to it, picks the step runner of its weights family (`ray_zep.train.runners`) and
turns each step into whole-job figures (`ray_zep.train.accounting`). It also
saves and restores the rank's part of a checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ray_zep.attention.links import Links
from ray_zep.collectives.switches import CompressionSwitches
from ray_zep.collectives.tally import per_stream
from ray_zep.config import Config, DkvWire
from ray_zep.data.shards import RankShard
from ray_zep.distributed import Comm
from ray_zep.host_usage import host_usage
from ray_zep.routing.relay import open_channels
from ray_zep.train import checkpoint, checkpoint_dirs
from ray_zep.train.accounting import (
    ZONES,
    StepStats,
    led_work,
    modelled_memory,
    rank_model_flops,
    rank_slots,
)
from ray_zep.train.accumulate import GradientSum
from ray_zep.train.build import (
    apply_axes,
    build_model,
    group_needs,
    resolve_device,
    resolve_dtype,
)
from ray_zep.train.memory_probe import PeakProbe
from ray_zep.train.optim import build_optimizer, lr_at, set_lr
from ray_zep.train.reductions import sum_over_ranks_
from ray_zep.train.runners import RUNNERS, StepContext

__all__ = ["RankTrainer", "StepStats", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)


class RankTrainer:
    """Model, optimizer and step of one rank.

    Args:
        config: the run's config.
        comm: this rank's process group and topology.
        device: compute device of this rank.
    """

    def __init__(self, config: Config, comm: Comm, device: torch.device) -> None:
        self.config = config
        self.comm = comm.with_groups(group_needs(config))
        self.device = device
        self.dtype = resolve_dtype(config.train.precision, device)
        self.model, kernel = build_model(config, device, self.dtype, deferred=True)
        self.shape = self.model.shape
        self.switches = CompressionSwitches(config, self.comm)
        self.axes = apply_axes(self.model, self.comm, config, device, self.dtype, self.switches)
        self.optimizer = build_optimizer(self.axes.state_module, config.train)
        self.steps_done = 0
        self.memory_probe = PeakProbe(
            device,
            config.metrics.memory_every,
            (self.axes.state_module, self.optimizer),
            whole_step=self.axes.pipeline is None,
        )
        self.zipped = self.switches.world
        ring_zip = self.zipped.ring_zipper() if self.zipped is not None else None
        routed = config.parallel.routing and comm.distributed
        routing = open_channels(self.comm, ring_zip) if routed else None
        wire = config.parallel.dkv_wire
        links = Links(self.comm, routing, ring_zip, wire is DkvWire.COMPUTE, wire is DkvWire.OWNER)
        self.ctx = StepContext(
            config, self.comm, device, self.dtype, self.model, kernel, self.axes, links, self.zipped
        )
        self.runner = RUNNERS[config.parallel.weights_axis.family](self.ctx)

    def close(self) -> None:
        """Stop the threads the routing layer runs for this trainer (the run is over, or
        failed): a process that builds another trainer keeps none of them."""
        self.ctx.links.close()

    # what tests and checkpoints look at
    @property
    def pipeline(self):
        return self.axes.pipeline

    @property
    def state_module(self) -> torch.nn.Module:
        """What this rank checkpoints and optimizes: the model, or its own weight shard."""
        return self.axes.state_module

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.axes.params

    @property
    def links(self) -> Links:
        return self.ctx.links

    def compute_gradients(self, shard: RankShard) -> tuple[tuple[float, float], int]:
        """Gradients of the global mean loss, summed over ranks, in `.grad`.

        Returns:
            This rank's sum of token losses and share of the balance loss, and
            the bytes all-reduced.
        """
        self.optimizer.zero_grad(set_to_none=True)
        return self.runner.compute_gradients(shard)

    def _switcher_profile(self) -> dict:
        """The job switch's measured costs, reported with the first step."""
        profile = self.zipped.switcher.profile if self.zipped is not None else None
        return profile.to_dict() if profile is not None and self.steps_done == 1 else {}

    def train_step(self, shards: RankShard | Sequence[RankShard]) -> StepStats:
        """Forward, backward, gradient sync, clip and update on this rank's shard, or
        on its shards of several micro-batches (`train.micro_batches`), one update."""
        shards = [shards] if isinstance(shards, RankShard) else list(shards)
        started = time.perf_counter()
        lr = lr_at(self.steps_done, self.config.train)
        set_lr(self.optimizer, lr)
        label_tokens = sum(s.global_label_tokens for s in shards)
        weights = [s.global_label_tokens / max(1, label_tokens) for s in shards]
        gradients = GradientSum(self.params) if len(shards) > 1 else None
        losses, grad_bytes = [], []
        with self.memory_probe.step(self.steps_done + 1):
            for shard, weight in zip(shards, weights, strict=True):
                loss, sent = self.compute_gradients(shard)
                losses.append(loss)
                grad_bytes.append(sent)
                if gradients is not None:
                    gradients.add(weight)
            if gradients is not None:
                gradients.restore()
            grad_norm = self.runner.clip()
            self.optimizer.step()
        self.steps_done += 1
        return self._stats(shards, weights, losses, grad_bytes, grad_norm, lr, started)

    def _stats(self, shards, weights, losses, grad_bytes, grad_norm, lr, started) -> StepStats:
        """The step's whole-job figures: micro-batches add up (the memory peak is the
        largest), the loss is their label-token-weighted mean (`weights`)."""
        ctx = self.ctx
        label_tokens = sum(s.global_label_tokens for s in shards)
        models = [modelled_memory(s, ctx) for s in shards]
        model = max(models, key=lambda m: m.total)
        peak = self.memory_probe.last.get("peak", 0.0)
        flops = sum(rank_model_flops(s, ctx) for s in shards)
        usage = host_usage()
        memory = rank_slots(ctx, model.total, peak, flops, usage.rss_bytes, usage.open_fds)
        streams = self.switches.tally.vector()
        led = [sum(values) for values in zip(*(led_work(s, ctx) for s in shards), strict=True)]
        loss_sum = sum(loss for loss, _ in losses)
        aux = sum(w * a for w, (_, a) in zip(weights, losses, strict=True))
        totals = torch.tensor([loss_sum, aux, *led, *streams, *memory], dtype=torch.float64)
        sum_over_ranks_(totals, self.comm, "the step loss")
        zone_tokens, attention_flops = totals[2:5].tolist(), float(totals[5])
        end = 6 + len(streams)
        job_streams, per_rank = totals[6:end].tolist(), totals[end:].view(5, -1).tolist()
        traffic = self.runner.traffic(shards[0], grad_bytes[0])
        for shard, sent in zip(shards[1:], grad_bytes[1:], strict=True):
            traffic = traffic + self.runner.traffic(shard, sent)
        tokens = sum(s.global_tokens for s in shards)
        linear_flops = self.shape.linear_flops_per_token() * tokens
        rank_tokens = [sum(n) for n in zip(*(s.rank_tokens for s in shards), strict=True)]
        return StepStats(
            step=self.steps_done,
            loss=float(totals[0]) / max(1, label_tokens) + float(totals[1]),
            tokens=tokens,
            label_tokens=label_tokens,
            grad_norm=grad_norm,
            lr=lr,
            step_seconds=time.perf_counter() - started,
            rank_tokens=rank_tokens,
            comm_bytes={"intra_node": traffic.intra_node, "inter_node": traffic.inter_node},
            nic_bytes=traffic.nic.tolist(),
            compression=per_stream(job_streams),
            switcher=self._switcher_profile(),
            moe_aux_loss=float(totals[1]),
            zone_tokens={z.value: int(n) for z, n in zip(ZONES, zone_tokens, strict=True)},
            model_flops=3.0 * (linear_flops + attention_flops),
            rank_flops=per_rank[2],
            memory={
                "modelled": per_rank[0],
                "measured": per_rank[1],
                "measured_by": self.memory_probe.method,
                "parts": {"modelled": model.to_dict(), "measured": self.memory_probe.last},
            },
            host={"rss_bytes": _ints(per_rank[3]), "open_fds": _ints(per_rank[4])},
        )

    def save(self, run_dir: Path, cursor: dict[str, Any]) -> Path:
        """Checkpoint the state after `steps_done` steps (collective)."""
        path = checkpoint_dirs.checkpoint_path(run_dir, self.steps_done)
        checkpoint.save_checkpoint(
            path,
            self.state_module,
            self.optimizer,
            checkpoint.Progress(self.steps_done, cursor),
            self.comm,
            ep=self.config.parallel.ep,
            weights=self.config.parallel.weights.value,
        )
        return path

    def load(self, path: Path) -> checkpoint.Progress:
        """Restore a checkpoint (collective); training continues after its step."""
        parallel = self.config.parallel
        progress = checkpoint.load_checkpoint(
            path, self.state_module, self.optimizer, self.comm, parallel.ep, parallel.weights.value
        )
        self.steps_done = progress.step
        return progress


def _ints(values: list[float]) -> list[int]:
    return [round(v) for v in values]
