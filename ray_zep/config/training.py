"""What a run trains, on which data, for how long: the `train`, `model` (with `model.moe`)
and `data` sections of the schema. Each checks its own keys in `__post_init__`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ray_zep.config.rules import require
from ray_zep.options import (
    ActivationCheckpointing,
    Device,
    MoEDispatch,
    Overlong,
    Packing,
    Precision,
    ResumeMode,
)


@dataclass
class TrainConfig:
    steps: int = 100
    """Number of optimizer steps of the whole run (a resumed run continues up to it)."""
    seed: int = 0
    """Seeds model initialisation and data order."""
    out_dir: str = "runs/demo"
    """Run directory: resolved config, metrics.jsonl, checkpoints. Shared by all nodes."""
    tokens_per_rank: int = 1024
    """L, the token capacity of one GPU per step; a global batch holds nodes x GPUs x L."""
    micro_batches: int = 1
    """Global batches per optimizer step (gradient accumulation): a step trains on k
    consecutive batches of the stream, one after the other, and updates once with the
    gradient of the mean token loss over all of them (as one process training on their
    union would). k > 1 keeps one more copy of the gradients."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr x min_lr_ratio on the last step."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    checkpoint_every: int = 0
    """Save a checkpoint every k steps; 0 saves only at the end of the run."""
    save_last: bool = True
    """Save a checkpoint after the last step. False: a throwaway run (a smoke test, a
    timing) ends without one; `checkpoint_every` and `eval_every` still save theirs."""
    keep_checkpoints: int = 0
    """Complete checkpoints kept: after each save, older ones beyond the newest k are
    deleted (with interrupted saves older than the newest); 0 keeps every one."""
    resume: ResumeMode = ResumeMode.AUTO
    sample_ledger: bool = True
    """Every rank records the document pieces it trains on, step by step, in
    `<out_dir>/samples/` (see ray_zep.train.ledger)."""
    device: Device = Device.AUTO
    precision: Precision = Precision.AUTO
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    """Per transformer block: `full` recomputes the block in backward, `selective` its
    feed-forward part only (attention outputs kept); results equal `none`."""
    checkpoint_blocks: int = 0
    """How many blocks, the first ones, `activation_checkpointing` applies to; the others
    keep every activation (as Megatron-LM's `--recompute-num-layers` with
    `--recompute-method block`). 0: every block."""
    checkpoint_rest: ActivationCheckpointing = ActivationCheckpointing.NONE
    """What the blocks after the first `checkpoint_blocks` do: `none` keeps every
    activation; `selective`, beneath `activation_checkpointing=full`, recomputes their
    feed-forward part (a GPU that fits neither `selective` on every block nor `full` on
    few may fit `full` on a few and `selective` on the rest, which recomputes less)."""
    eval_every: int = 0
    """Every k steps, the validation loss on `data.eval_source` (a checkpoint is saved
    at those steps; rank 0 evaluates it as `ray-zep eval` does); 0: never."""
    eval_batches: int = 8
    """Batches of `data.eval_source` each evaluation reads (the same ones every time);
    0 reads it all once."""

    def checkpointed(self, n_layers: int) -> int:
        """Blocks that `activation_checkpointing` applies to, of `n_layers`."""
        mode, blocks = self.activation_checkpointing, self.checkpoint_blocks
        none = ActivationCheckpointing.NONE
        return sum(mode.on_block(index, blocks) is not none for index in range(n_layers))

    def rest_checkpointed(self, n_layers: int) -> int:
        """Blocks that `checkpoint_rest` applies to, of `n_layers`."""
        if self.checkpoint_rest is ActivationCheckpointing.NONE:
            return 0
        return n_layers - self.checkpointed(n_layers)

    def __post_init__(self) -> None:
        require(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        require(self.micro_batches >= 1, "train.micro_batches", self.micro_batches, "must be >= 1")
        require(self.eval_every >= 0, "train.eval_every", self.eval_every, "must be >= 0")
        require(self.eval_batches >= 0, "train.eval_batches", self.eval_batches, "must be >= 0")
        require(
            self.checkpoint_blocks >= 0,
            "train.checkpoint_blocks",
            self.checkpoint_blocks,
            "must be >= 0 (0: every block)",
        )
        require(
            self.tokens_per_rank >= 2, "train.tokens_per_rank", self.tokens_per_rank, "must be >= 2"
        )
        require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        require(
            0 <= self.min_lr_ratio <= 1,
            "train.min_lr_ratio",
            self.min_lr_ratio,
            "must be in [0, 1]",
        )
        require(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            require(0 <= value < 1, f"train.{key}", value, "must be in [0, 1)")
        require(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "must be > 0")
        require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        require(
            self.checkpoint_every >= 0,
            "train.checkpoint_every",
            self.checkpoint_every,
            "must be >= 0",
        )
        require(bool(self.out_dir), "train.out_dir", self.out_dir, "must not be empty")
        require(
            self.keep_checkpoints >= 0,
            "train.keep_checkpoints",
            self.keep_checkpoints,
            "must be >= 0 (0 keeps every checkpoint)",
        )


@dataclass
class MoEConfig:
    num_experts: int | None = None
    """Experts per MoE block; 0 = dense. Unset: the model preset's."""
    top_k: int | None = None
    """Experts per token, 1 or 2 (preset)."""
    capacity_factor: float | None = None
    """Expert slots = ceil(CF · top_k · tokens / experts) per rank; <= 0: dropless (preset)."""
    hidden_dim: int | None = None
    """Each expert's SwiGLU inner dimension; 0 = model.ffn_dim (preset)."""
    every: int | None = None
    """Every n-th block is an MoE block (preset)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (GShard's, over the whole global batch)."""
    dispatch: MoEDispatch = MoEDispatch.AUTO
    """auto | padded | varlen: how tokens reach the experts (see MoEDispatch)."""

    def __post_init__(self) -> None:
        require(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", self.aux_loss_coef, ">= 0")

    def overrides(self) -> dict[str, Any]:
        """The MoE fields of the model shape that are set explicitly, by shape name."""
        names = {
            "num_experts": "moe_experts",
            "top_k": "moe_top_k",
            "capacity_factor": "moe_capacity_factor",
            "hidden_dim": "moe_hidden",
            "every": "moe_every",
        }
        return {
            shape_name: getattr(self, key)
            for key, shape_name in names.items()
            if getattr(self, key) is not None
        }


MODEL_RUN_KEYS = ("preset", "attention_kernel", "init_from", "moe", "loss_chunk_tokens", "compile")
"""`model` keys that are not shape fields."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """tiny or tiny_moe (CPU demos) or a paper shape: 3b, 7b, 13b, 30b, 8x550m,
    gpt_moe_s, gpt_moe_m, gpt_moe_l."""
    vocab_size: int | None = None
    """Override the preset's vocabulary size (likewise the fields below)."""
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    rope_theta: float | None = None
    attention_kernel: str = "auto"
    """auto (on a GPU: torch's flash kernel for fp16/bf16, FA3 on Hopper where installed;
    flash-attn where torch has none for the GPU; else torch) | torch | flash | torch_flash."""
    init_from: str | None = None
    """A local Hugging Face checkpoint directory (config.json + model.safetensors, or
    shards with model.safetensors.index.json) of a LlamaForCausalLM or
    Qwen2ForCausalLM: the model takes its shape and initial weights (see
    ray_zep.model.hf); `model.preset` is not used and a size key set here must
    repeat the checkpoint's value. Unset: a preset, randomly initialised."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts blocks (the preset's unless set)."""
    loss_chunk_tokens: int = 0
    """> 0: the training and evaluation loss runs the output projection and its
    cross-entropy this many tokens at a time (`ray_zep.model.loss`; 4096 is a good
    value on a GPU), never holding fp32 logits of the whole batch; 0: the whole
    batch's logits at once. Equal up to fp32 rounding, not bit for bit, so off by
    default."""
    compile: bool = False
    """torch.compile each transformer block's norm, projections, RoPE and SwiGLU
    (regional compilation; attention and its communication stay eager). Equal to
    eager up to fp32 rounding; needs a C++ compiler on CPU."""

    def __post_init__(self) -> None:
        require(
            self.loss_chunk_tokens >= 0,
            "model.loss_chunk_tokens",
            self.loss_chunk_tokens,
            "must be >= 0 (0: off)",
        )
        require(
            self.init_from is None or bool(self.init_from.strip()),
            "model.init_from",
            self.init_from,
            "must name a checkpoint directory, or be null",
        )

    def overrides(self) -> dict[str, Any]:
        """The dense shape fields set explicitly, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in MODEL_RUN_KEYS and getattr(self, f.name) is not None
        }


def batch_budget(fill: float, ranks: int, tokens_per_rank: int) -> int:
    """Tokens of one batch under budget packing: `data.batch_fill` x ranks x L, at least 1
    (what the data actor fills, `ray_zep.data.batching`)."""
    return max(1, int(fill * ranks * tokens_per_rank))


@dataclass
class DataConfig:
    source: str = "stdlib"
    """stdlib (built-in text), synthetic:arxiv|github|prolong64k, or a Parquet file/folder."""
    packing: Packing = Packing.RANK
    """rank | budget (parallel.sequence=whole needs rank)."""
    overlong: Overlong = Overlong.SPLIT
    """split | drop | error, for documents longer than data.max_doc_tokens."""
    max_doc_tokens: int | None = None
    """Longest sequence in a batch; defaults to L under rank packing, nodes x GPUs x L otherwise."""
    shuffle: bool = True
    """Visit documents in a seeded random order, new each epoch."""
    length_scale: float = 1.0
    """Multiply synthetic lengths by this (e.g. 1/64 to run paper distributions on a CPU)."""
    prefetch: int = 2
    """Steps of shards the data actor prepares ahead."""
    eval_source: str | None = None
    """Held-out data for `train.eval_every` (any form `data.source` takes), never
    trained on; null: no evaluation during training."""
    batch_fill: float = 1.0
    """Share of nodes x GPUs x L a batch fills under packing=budget; below 1 every rank
    may hold more tokens than the mean (up to L), room `parallel.zone_policy=work` uses
    to balance work."""
    outlier_tokens: int = 0
    """Documents of at least this many tokens are outliers that may wait for a later
    batch (`ray_zep.data.batching`); 0: off."""
    outlier_group: int = 2
    """Outliers released together: held ones open the next batch once this many wait."""
    outlier_max_delay: int = 4
    """Batches an outlier waits at most before it is released anyway."""

    def __post_init__(self) -> None:
        require(bool(self.source), "data.source", self.source, "must not be empty")
        require(
            self.max_doc_tokens is None or self.max_doc_tokens >= 1,
            "data.max_doc_tokens",
            self.max_doc_tokens,
            "must be >= 1",
        )
        require(self.length_scale > 0, "data.length_scale", self.length_scale, "must be > 0")
        require(self.prefetch >= 1, "data.prefetch", self.prefetch, "must be >= 1")
        require(0 < self.batch_fill <= 1, "data.batch_fill", self.batch_fill, "must be in (0, 1]")
        require(
            self.batch_fill == 1 or self.packing is Packing.BUDGET,
            "data.batch_fill",
            self.batch_fill,
            "below 1 needs data.packing=budget (rank packing fills L-token bins)",
        )
        require(
            self.outlier_tokens >= 0,
            "data.outlier_tokens",
            self.outlier_tokens,
            "must be >= 0 (0: off)",
        )
        require(self.outlier_group >= 1, "data.outlier_group", self.outlier_group, "must be >= 1")
        require(
            self.outlier_max_delay >= 1,
            "data.outlier_max_delay",
            self.outlier_max_delay,
            "must be >= 1",
        )
