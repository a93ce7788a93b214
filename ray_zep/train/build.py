"""Building a rank's model and applying the parallel axes to it.

`build_model` makes the Transformer every rank starts from (the same seed, the
same weights); `apply_axes` then splits the experts (`parallel.ep`), shards
the weights with FSDP2 (`fsdp`, `hsdp`) or hands them to the weight-passing
pipeline (`tawpipe`, `ring_relay`), and says which parameters this rank sums,
optimizes and checkpoints.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ray_zep.attention.kernels import AttentionFn, select_kernel
from ray_zep.collectives.switches import CompressionSwitches
from ray_zep.config import Config, Device, Precision
from ray_zep.distributed import Comm, GroupNeeds
from ray_zep.errors import ConfigError
from ray_zep.model.hf import load_hf_weights
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.moe.parallel import ExpertParallel, parallelize_experts
from ray_zep.parallel.axes import Family, Passing
from ray_zep.pipeline.runner import WeightPipeline
from ray_zep.prefetch_plan import run_gathers_after_attention, run_prefetch_depth
from ray_zep.train.fsdp import mesh_shape, shard_model


def resolve_device(device: Device) -> torch.device:
    """`train.device` on this process: auto picks CUDA when it is available."""
    if device is Device.CPU or (device is Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("config key train.device=cuda: no CUDA device is visible to this process")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """Compute dtype: fp32 on CPU, bf16 autocast on GPU unless `train.precision` says otherwise."""
    if precision is Precision.FP32 or (precision is Precision.AUTO and device.type == "cpu"):
        return torch.float32
    if device.type == "cpu":
        raise ConfigError(
            "config key train.precision=bf16: bf16 autocast is for GPU runs; use fp32"
        )
    return torch.bfloat16


def group_needs(config: Config) -> GroupNeeds:
    """The process groups a run needs besides the world group."""
    weights = config.parallel.weights_axis
    return GroupNeeds(
        node_and_rail=weights.passing is Passing.GROUPED,
        fsdp=mesh_shape(config.parallel),
        routing=config.parallel.routing,
        ep=config.parallel.ep,
    )


def build_model(
    config: Config, device: torch.device, dtype: torch.dtype, to_device: bool = True
) -> tuple[Transformer, AttentionFn]:
    """The seeded model on `device` with its attention kernel, activation checkpointing,
    chunked loss (`model.loss_chunk_tokens`) and compiled block regions (`model.compile`).
    With `to_device` False the weights stay on the host for `apply_axes` to place: where
    FSDP2 shards them, each unit reaches the device as it is sharded, so a rank never
    holds the whole model there (32.5 billion fp32 parameters of the 30b preset are 130
    GB, more than an 80 GB GPU).

    Compilation comes before the axes apply, as TorchTitan compiles each block before
    `fully_shard`: FSDP2's hooks stay on the blocks, outside the compiled regions.

    With `model.init_from` the weights are the Hugging Face checkpoint's, read on
    every rank before the axes split or shard anything (so every composition
    starts from the whole checkpoint).
    """
    shape = build_shape(config.model)
    kernel = select_kernel(config.model.attention_kernel, device, dtype)
    model = Transformer(shape, kernel)
    if config.model.init_from:
        load_hf_weights(model, config.model.init_from)
    else:
        model.init_weights(torch.Generator().manual_seed(config.train.seed))
    if to_device:
        model.to(device)
    train = config.train
    model.set_checkpointing(
        train.activation_checkpointing, train.checkpoint_blocks, train.checkpoint_rest
    )
    model.loss_chunk_tokens = config.model.loss_chunk_tokens
    if config.model.compile:
        model.compile_blocks()
    return model, kernel


@dataclass
class AppliedAxes:
    """What the axes made of a rank's model.

    Attributes:
        experts: the expert-parallel groups and the split experts' parameters.
        sharded: parameters, gradients and optimizer state are sharded by FSDP2.
        pipeline: the weight-passing pipeline, or None.
        state_module: what this rank optimizes and checkpoints (the model, or its
            own weight shard).
        params: parameters whose gradients are summed over all ranks (all but the
            split experts), or the own shard's under weight passing.
        unsharded_bytes: (block, other) bytes of the whole model's parameters in the
            compute dtype (for the FSDP2 traffic model).
    """

    experts: ExpertParallel
    sharded: bool
    pipeline: WeightPipeline | None
    state_module: torch.nn.Module
    params: list[torch.nn.Parameter]
    unsharded_bytes: tuple[int, int]


def apply_axes(
    model: Transformer,
    comm: Comm,
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    switches: CompressionSwitches | None = None,
) -> AppliedAxes:
    """Split, shard or pass the model's weights as `config.parallel` says (collective),
    and place them on `device`: FSDP2 moves each unit's weights there as it shards them
    (`fully_shard`), the rest (every weight where none are sharded, the experts FSDP2
    leaves to their own groups) follows.

    With `switches`, FSDP2's collectives go through the shard group's switch.
    """
    parallel = config.parallel
    experts = parallelize_experts(model, comm, config, switches)
    sharded = bool(parallel.weights_axis.fsdp and comm.distributed)
    unsharded = _parameter_bytes(model, dtype)
    if sharded:
        split = [m.experts for m in model.moe_layers()] if experts.groups else []
        zipped = switches.for_group(comm.groups.fsdp_shard) if switches else None
        late = run_gathers_after_attention(config, comm.topology, model.shape, dtype.itemsize)
        depth = run_prefetch_depth(config, comm.topology, model.shape, dtype.itemsize)
        resolved = dataclasses.replace(parallel, prefetch_after_attention=late,
                                       prefetch_depth=depth)  # fmt: skip
        shard_model(model, comm, resolved, device, dtype, split, zipped)
        _place_rest(model, device)
        # fully_shard replaced the parameters with sharded ones
        experts.expert_params = [p for m in split for p in m.parameters()]
    else:
        model.to(device)
    split_ids = {id(p) for p in experts.expert_params}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in split_ids]
    if parallel.weights_axis.family is not Family.WEIGHT_PASSING:
        return AppliedAxes(experts, sharded, None, model, params, unsharded)
    world = switches.world if switches is not None else None
    zipper = world.ring_zipper() if world is not None else None
    pipeline = WeightPipeline(
        model, comm, parallel.weights, parallel.shard_recompute, dtype, zipper
    )
    own = pipeline.weights
    return AppliedAxes(
        experts, sharded, pipeline, own.own_module(), own.own_parameters(), unsharded
    )


def _place_rest(model: torch.nn.Module, device: torch.device) -> None:
    """Moves the parameters and buffers FSDP2 left where they were (the experts it leaves
    to their own groups) to `device`, in place, as FSDP2 moves its own."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if tensor.device != device:
                tensor.data = tensor.to(device)


def _parameter_bytes(model: Transformer, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of the transformer blocks' parameters and of the others, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    blocks = sum(p.numel() for p in model.layers.parameters()) * size
    return blocks, sum(p.numel() for p in model.parameters()) * size - blocks
