"""AdamW with decoupled weight decay on matrices, and the learning-rate schedule.

The schedule is a pure function of the step, so a resumed run needs no
scheduler state: linear warm-up to `train.lr` over `train.warmup_steps`, then
cosine decay to `train.lr x train.min_lr_ratio` at the last step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ray_zep.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on weights of rank >= 2 (matmuls, embeddings), not on norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": params, "weight_decay": decay_rate}
        for params, decay_rate in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params  # a checkpoint restores a group through its parameters' names
    ]
    params = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused_update(params) or None,
    )


def fused_update(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs fused (one kernel per dtype and device for the whole update): on
    GPU parameters, as TorchTitan's default `optimizer.implementation`. torch's multi-tensor
    update makes one pass per operation over the fp32 state, and on an H200 it took 13% of
    a 7B-width step (BENCHMARKS.md). On CPU the multi-tensor update stays: same numbers as
    every CPU test compares against."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
