"""Rules that span keys of several sections, checked when a Config is built.

Each section checks its own keys; these rules need two sections at once (whether the
parallel axes compose for the model, which packing a placement needs, where evaluation
reads). The rules that also need the topology's sizes are `ray_zep.config.sizes`.
"""

from __future__ import annotations

import re
from importlib import metadata

from ray_zep.config.parallelism import ParallelConfig
from ray_zep.config.rules import word
from ray_zep.config.training import DataConfig, ModelConfig, TrainConfig
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.options import BENEATH_SELECTIVE, ActivationCheckpointing, Packing
from ray_zep.parallel.axes import SEQUENCE_AXES, AxesChoice, refusal


def check_across_sections(
    train: TrainConfig, parallel: ParallelConfig, model: ModelConfig, data: DataConfig
) -> None:
    """Every rule across sections that needs no topology.

    Raises:
        ConfigError: naming the key to change: the parallel axes do not compose
            (`ray_zep.parallel.axes.refusal`) or the installed torch cannot shard
            experts over their replicas, a whole-sequence placement meets budget
            packing, or evaluation is asked for without held-out data.
    """
    check_axes(parallel, model)
    check_expert_sharding(parallel, model)
    check_packing(parallel, data)
    check_evaluation(train, data)
    check_checkpointing(train, model)


def check_axes(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The sequence placement, weights mode, EP degree and layers compose for the model."""
    choice = AxesChoice(
        parallel.sequence,
        parallel.weights,
        parallel.ep,
        build_shape(model).moe_experts > 0,
        parallel.routing,
        parallel.remap,
        parallel.reference_layout,
    )
    refused = refusal(choice)
    if refused is not None:
        key, why = refused
        value = getattr(parallel, key.split(".")[1])
        raise ConfigError(f"config key {key}={word(value)}: {why}")


def check_expert_sharding(parallel: ParallelConfig, model: ModelConfig) -> None:
    """Experts under an FSDP weights mode with `parallel.ep` > 1 are sharded over their
    own replicas, through `fully_shard`'s per-parameter mesh, which torch has from 2.12
    on: refused here with older torch, before any worker starts."""
    sharded = parallel.ep > 1 and parallel.weights_axis.fsdp
    if sharded and build_shape(model).moe_experts > 0 and not torch_shards_experts():
        raise ConfigError(
            f"config key parallel.ep={parallel.ep} with parallel.weights="
            f"{word(parallel.weights)}: sharding experts over their own mesh needs torch "
            f">= 2.12 (fully_shard's per-parameter mesh), this is {metadata.version('torch')}"
        )


def torch_shards_experts() -> bool:
    """Whether the installed torch (read from its metadata, not imported) is 2.12 or
    newer; True where it cannot tell (the worker's own check then speaks)."""
    try:
        found = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return True
    return found is None or (int(found[1]), int(found[2])) >= (2, 12)


def check_packing(parallel: ParallelConfig, data: DataConfig) -> None:
    """A placement that keeps each sequence on one rank packs documents per rank."""
    seq = parallel.sequence_axis
    if parallel.reference_layout is not None:
        seq = SEQUENCE_AXES[parallel.reference_layout]  # the packing of the mirrored run
    if seq.whole_sequences and not seq.one_process and data.packing is not Packing.RANK:
        raise ConfigError(
            f"config key data.packing='budget': parallel.sequence={seq.name} keeps each "
            "sequence on one rank and needs data.packing=rank"
        )


def check_evaluation(train: TrainConfig, data: DataConfig) -> None:
    """Evaluation during training reads held-out data."""
    if train.eval_every and not data.eval_source:
        raise ConfigError(
            f"config key train.eval_every={train.eval_every}: evaluation reads "
            "held-out data; set data.eval_source (a Parquet file, stdlib, synthetic:...)"
        )


def check_checkpointing(train: TrainConfig, model: ModelConfig) -> None:
    """`train.checkpoint_blocks` counts blocks the model has, under a checkpointing mode."""
    blocks = train.checkpoint_blocks
    rest = train.checkpoint_rest
    if rest is not ActivationCheckpointing.NONE and (
        rest is not ActivationCheckpointing.SELECTIVE
        or train.activation_checkpointing not in BENEATH_SELECTIVE
        or not blocks
    ):
        raise ConfigError(
            f"config key train.checkpoint_rest={rest.value}: only selective, beneath "
            "train.activation_checkpointing=full or linears on the first "
            "train.checkpoint_blocks (1 or more) blocks; or set it to none"
        )
    if not blocks:
        return
    if train.activation_checkpointing is ActivationCheckpointing.NONE:
        raise ConfigError(
            f"config key train.checkpoint_blocks={blocks}: train.activation_checkpointing="
            "none checkpoints no block; set it to full, linears or selective, or the key to 0"
        )
    layers = build_shape(model).n_layers
    if blocks > layers:
        raise ConfigError(
            f"config key train.checkpoint_blocks={blocks}: the model has {layers} blocks; "
            f"use 1..{layers} (or 0 for every block)"
        )
