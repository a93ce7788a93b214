"""Building a rank's model and applying the parallel axes to it.

`build_model` makes the Transformer every rank starts from (the same seed, the
same weights); `apply_axes` then splits the experts (`parallel.ep`), shards
the weights with FSDP2 (`fsdp`, `hsdp`) or hands them to the weight-passing
pipeline (`tawpipe`, `ring_relay`), and says which parameters this rank sums,
optimizes and checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ray_zep.attention.kernels import AttentionFn, select_kernel
from ray_zep.collectives.switches import CompressionSwitches
from ray_zep.config import Config, Device, Precision
from ray_zep.distributed import Comm, GroupNeeds
from ray_zep.errors import ConfigError
from ray_zep.model.hf import hf_values
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.moe.parallel import ExpertParallel, parallelize_experts
from ray_zep.parallel.axes import Family, Passing
from ray_zep.partition.node_reshard import reshards_to_node
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
        fsdp_shard_nodes=config.parallel.shard_nodes,
    )


def build_model(
    config: Config, device: torch.device, dtype: torch.dtype, deferred: bool = False
) -> tuple[Transformer, AttentionFn]:
    """The seeded model on `device` with its attention kernel, activation checkpointing,
    chunked loss (`model.loss_chunk_tokens`) and compiled block regions (`model.compile`).

    `deferred`: the weights are not made yet (meta tensors, no memory) but by
    `apply_axes`, after it splits and shards them: each rank draws every parameter of
    the seeded model on the host (or takes it from `model.init_from`'s checkpoint), one
    at a time, and keeps its own part on the device. No process then holds the whole
    model in its parameters (the 30b preset's 32.5 billion fp32 parameters are 130 GB:
    more than an 80 GB GPU, and a node's host memory eight times over), and the values
    are those of the whole model made at once.

    Compilation comes before the axes apply, as TorchTitan compiles each block before
    `fully_shard`: FSDP2's hooks stay on the blocks, outside the compiled regions.

    With `model.init_from` the weights are the Hugging Face checkpoint's, every rank
    reading each whole tensor (so every composition starts from the whole checkpoint).
    """
    shape = build_shape(config.model)
    kernel = select_kernel(config.model.attention_kernel, device, dtype)
    with torch.device("meta"):
        model = Transformer(shape, kernel)
    if not deferred:  # the whole model's weights, made as a deferred one's are
        draw_own_parts(model, _whole_values(model, config, _unmade_shapes(model)), device)
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
        node_shards: FSDP2 keeps each unit sharded over the node from its forward to its
            backward (`parallel.reshard_to_node`, resolved once here).
    """

    experts: ExpertParallel
    sharded: bool
    pipeline: WeightPipeline | None
    state_module: torch.nn.Module
    params: list[torch.nn.Parameter]
    unsharded_bytes: tuple[int, int]
    node_shards: bool = False


def apply_axes(
    model: Transformer,
    comm: Comm,
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    switches: CompressionSwitches | None = None,
) -> AppliedAxes:
    """Split, shard or pass the model's weights as `config.parallel` says (collective).
    A model built `deferred` gets its weights here, each rank its own part of each
    (`draw_own_parts`), once they are split and sharded; one built whole was already on
    `device`, and FSDP2 shards it there.

    With `switches`, FSDP2's collectives go through the shard group's switch.
    """
    parallel = config.parallel
    shapes = _unmade_shapes(model)  # the whole model's, before any split
    experts = parallelize_experts(model, comm, config, switches)
    sharded = bool(parallel.weights_axis.fsdp and comm.distributed)
    in_node = sharded and reshards_to_node(config, comm.topology, model.shape)
    unsharded = _parameter_bytes(model, dtype)
    if sharded:
        split = [m.experts for m in model.moe_layers()] if experts.groups else []
        zipped = switches.for_group(comm.groups.fsdp_shard) if switches else None
        late = run_gathers_after_attention(config, comm.topology, model.shape, dtype.itemsize)
        depth = run_prefetch_depth(config, comm.topology, model.shape, dtype.itemsize)
        resolved = dataclasses.replace(parallel, prefetch_after_attention=late,
                                       prefetch_depth=depth, reshard_to_node=in_node)  # fmt: skip
        shard_model(model, comm, resolved, device, dtype, split, zipped)
    if shapes:
        draw_own_parts(model, _whole_values(model, config, shapes), device)
    if experts.groups:  # sharding and drawing replaced the parameters
        experts.expert_params = [p for m in model.moe_layers() for p in m.experts.parameters()]
    split_ids = {id(p) for p in experts.expert_params}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in split_ids]
    if parallel.weights_axis.family is not Family.WEIGHT_PASSING:
        return AppliedAxes(experts, sharded, None, model, params, unsharded, in_node)
    world = switches.world if switches is not None else None
    zipper = world.ring_zipper() if world is not None else None
    pipeline = WeightPipeline(
        model, comm, parallel.weights, parallel.shard_recompute, dtype, zipper
    )
    own = pipeline.weights
    return AppliedAxes(
        experts, sharded, pipeline, own.own_module(), own.own_parameters(), unsharded
    )


def seeded(config: Config) -> torch.Generator:
    """The host generator every rank draws the model's weights from."""
    return torch.Generator().manual_seed(config.train.seed)


def _unmade_shapes(model: Transformer) -> dict[str, torch.Size]:
    """Each parameter's name and shape where the model's weights are not made yet (meta
    tensors: `build_model(deferred=True)`), in parameter order; empty otherwise."""
    params = dict(model.named_parameters())
    if not any(p.is_meta for p in params.values()):
        return {}
    return {name: param.shape for name, param in params.items()}


def _whole_values(
    model: Transformer, config: Config, shapes: dict[str, torch.Size]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter of the whole model (`shapes`), one at a time on the host: read from
    `model.init_from`'s checkpoint, or drawn as `Transformer.init_weights` draws them."""
    if config.model.init_from:
        return hf_values(config.model.init_from, model.shape, shapes)
    return model.initial_values(seeded(config), shapes)


def draw_own_parts(
    model: Transformer, values: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> None:
    """Makes the split and sharded `model`'s weights on `device` from `values`, each
    parameter of the whole model in turn (`_whole_values`), keeping this rank's part of
    each: its experts' rows where the experts are split (`shard_experts`), its shard
    where FSDP2 shards it."""
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, whole in values:
            param = params[name]
            value = _own_rows(model, name, whole, param.shape)
            if isinstance(param, DTensor):  # a checkpoint's bf16 cast before it is split
                value = value.to(device, param.dtype)
                value = distribute_tensor(value, param.device_mesh, param.placements,
                                          src_data_rank=None)  # fmt: skip
            param.copy_(value)


def _own_rows(model: Transformer, name: str, whole: torch.Tensor, shape: torch.Size):
    """`whole`, or this rank's rows of it where its experts are split over ranks (`shape`
    has fewer experts: `MoE.first_expert` is the first of them)."""
    if whole.shape == shape:
        return whole
    moe = model.get_submodule(name.rsplit(".", 2)[0])  # layers.i.feed_forward.experts.w1
    return whole[moe.first_expert : moe.first_expert + shape[0]]


def _parameter_bytes(model: Transformer, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of the transformer blocks' parameters and of the others, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    blocks = sum(p.numel() for p in model.layers.parameters()) * size
    return blocks, sum(p.numel() for p in model.parameters()) * size - blocks
