"""Per-rank memory of a training step, modelled from the axes, the shape and the tokens.

The model counts the tensors ray_zep's own step keeps, category by category:

- parameters: fp32 masters, split as the weights mode says (`replicated`: all,
  experts divided by `parallel.ep`; `fsdp`: 1/ranks; `hsdp`: 1/GPUs of a node;
  weight passing: the owned shard plus two borrowed ones), plus FSDP2's gathered
  copies in the compute dtype of the unit being differentiated (the embedding, a
  block or the head, or with `parallel.fsdp_unit=linear` a projection; two with
  prefetch; a checkpointed region's projections all at once; under
  `parallel.reshard_after_forward=false` every unit, from its forward until its own
  backward, and under `parallel.reshard_to_node` 1/G of every unit as long);
- gradients: fp32, sharded like the parameters (with `train.micro_batches` above 1,
  their running sum too, through every micro-batch's backward);
- optimizer: AdamW's two fp32 moments of the parameters a rank owns;
- activations: what autograd keeps for the rank's tokens (below), the logits (with
  `model.loss_chunk_tokens`, one chunk's and the gradients the chunked loss holds),
  the gradients of a block's widest intermediate and of its input while it runs
  backward, and, for a checkpointed block, its recomputed activations; with the torch kernel
  off the CPU, the backward's H x chunk x chunk score matrices of a ring block (flash-attn,
  and on the CPU PyTorch's fused flash-attention op, tile them away);
- buffers: the flat gradient all-reduce buffer (`replicated`, more than one process),
  the ring attention's K/V receive buffers (placements that spread sequences), an
  FSDP2 unit's unsharded gradients before its reduce-scatter.

A step's peak is the largest of three moments: the loss's backward (parameters,
optimizer state, every kept activation, the head's, the logits and the loss's two
vocabulary-wide fp32 gradients: with a large vocabulary the peak, measured on one
H200 within 1%), the first block's backward in reverse order (parameters, optimizer
state, every kept activation, the logits, the gradients that block's backward
computes, the weights gathered or borrowed for it) and the end of backward
(parameters, optimizer state, every gradient, the reduction buffers). Optimizer
state exists from the second step on; the model describes that steady state. Under
bf16 autocast with unsharded weights, each matmul keeps a bf16 copy of its fp32
weight for backward, so the copies of every projection and of the head count with
the parameters until their backward (none are left at the end of backward).

Activations per token and block, in elements, as the block computes them (D model
dim, H heads, K KV heads, E head dim, F SwiGLU dim): the attention half keeps 2D + 1
for its norm (its input and inverse RMS, `ray_zep.lean_ops`) and projection
input, H·E for the rotated queries, the keys and values the kernel saw, H·E for the
output and H for the log-sum-exp; the torch kernel (CPU) sees keys and values
expanded to H heads and keeps its output apart from the output projection's input
(5·H·E + H in all), flash-attn keeps them once (2·H·E + 2·K·E + H). The feed-forward
half keeps 2D + 1 for its norm and 3F for SwiGLU (its two inputs and the down
projection's input). An MoE feed-forward keeps 2D + 1, 2X for the gate and, per chosen
expert, 2D + 3F' (an estimate: the gathered rows, the expert's SwiGLU and its output).
`selective` keeps the attention half and the feed-forward's input (D); `linears` keeps
what the attention kernel keeps and the block input (D); `full` keeps the block input
(D). In bf16 the residual stream and norms stay fp32 (4 bytes), matmul and attention
results take 2 bytes, a norm keeps its fp32 input and inverse RMS (D + 1; its fp32
output is not kept) and the projections reading it keep one bf16 copy of it between
them (D: the norm casts its output once, `ray_zep.model.llama.RMSNorm`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass

from ray_zep.model_shapes import ModelShape
from ray_zep.options import ActivationCheckpointing, FsdpUnit
from ray_zep.parallel.axes import Family, Sharding, WeightsAxis
from ray_zep.parallel.pipeline_layout import cut_shards

FP32 = 4
ADAM_MOMENTS = 2
SCORE_MATRICES = 3
"""H x Sq x Sk matrices the torch kernel's backward holds at once (scores,
probabilities, their gradient); flash kernels tile them away."""
GB = 1e9


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the model needs besides the shape.

    Attributes:
        weights: the weights axis.
        ep: expert-parallel degree.
        ranks: processes of the run; gpus_per_node: ranks of one node.
        tokens: tokens this rank holds (the plan's placement of the batch).
        ring_tokens: tokens whose K/V this rank receives from ring peers at once
            (0 where attention never communicates).
        checkpointing: `train.activation_checkpointing`.
        checkpoint_blocks: `train.checkpoint_blocks` (the first blocks `checkpointing`
            applies to; 0: every block).
        compute_bytes: 4 (fp32) or 2 (bf16 autocast).
        flash_kernel: attention by flash-attn (keys and values kept unexpanded).
        on_cpu: the rank computes on the CPU, where the torch kernel runs every block the
            ring engine makes through PyTorch's fused op (no whole score matrix held, as
            with flash-attn).
        prefetch: FSDP2 gathers the next unit while one computes.
        prefetch_depth: with `prefetch`, how many units ahead it gathers
            (`parallel.prefetch_depth` as `ray_zep.prefetch_plan.prefetch_depth` resolves
            it: 1 for projection units).
        fsdp_unit: what one FSDP2 unit gathers (`parallel.fsdp_unit`).
        loss_chunk_tokens: `model.loss_chunk_tokens` (0: the loss of the whole batch's
            logits).
        kept_kv_tokens: tokens of ring peers' K/V this rank keeps from each layer's
            forward for its backward (`Exchange.RING_KEPT`), counted as token rows of
            every K/V head (a Ulysses member of U keeps 1/U of them).
        micro_batches: `train.micro_batches`; above 1 the step keeps the sum of the
            micro-batches' gradients beside the next one's (`GradientSum`), one more copy
            of the rank's gradients through every micro-batch's backward.
        reshard_after_forward: `parallel.reshard_after_forward`; false, FSDP2 keeps
            every unit gathered from its forward until its own backward.
        reshard_to_node: `parallel.reshard_to_node` as the run resolves it: each unit
            stays sharded over the node's GPUs (1/`gpus_per_node` of it on each) from
            its forward until its own backward.
        shard_ranks: ranks in one FSDP2 shard group under `Sharding.ALL_RANKS`
            (`ray_zep.parallel.shard_groups`; 0: every rank).
    """

    weights: WeightsAxis
    ep: int
    ranks: int
    gpus_per_node: int
    tokens: int
    ring_tokens: int = 0
    checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    checkpoint_blocks: int = 0
    checkpoint_rest: ActivationCheckpointing = ActivationCheckpointing.NONE
    compute_bytes: int = FP32
    flash_kernel: bool = False
    on_cpu: bool = True
    prefetch: bool = True
    prefetch_depth: int = 1
    fsdp_unit: FsdpUnit = FsdpUnit.BLOCK
    loss_chunk_tokens: int = 0
    kept_kv_tokens: float = 0.0
    micro_batches: int = 1
    reshard_after_forward: bool = True
    reshard_to_node: bool = False
    shard_ranks: int = 0

    def block_checkpointing(self, index: int) -> ActivationCheckpointing:
        """What block `index`'s backward recomputes."""
        return self.checkpointing.on_block(index, self.checkpoint_blocks, self.checkpoint_rest)


@dataclass(frozen=True)
class RankMemory:
    """Bytes a rank holds at its step's peak, by category."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    moment: str = "in backward"
    """When the peak happens: `in backward` (activations at their fullest) or `end of
    backward` (every gradient and the reduction buffers)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        parts = ", ".join(
            f"{k} {v / GB:.1f}" for k, v in asdict(self).items() if not isinstance(v, str)
        )
        return f"{self.total / GB:.1f} GB {self.moment} ({parts})"


def model_memory(shape: ModelShape, m: MemoryInputs) -> RankMemory:
    """The modelled peak of one rank (bytes, see the module docstring)."""
    owned = owned_params(shape, m)
    work = _working_set(shape, _per_token_inputs(m))
    optimizer = ADAM_MOMENTS * owned * FP32
    activations = activation_bytes(shape, m)
    ring = 2 * 2 * shape.n_kv_heads * shape.head_dim * m.ring_tokens * m.compute_bytes
    activations += kept_kv_bytes(shape, m)
    grads = _gradient_elements(shape, m) * FP32
    summed = _gradient_sum_bytes(owned, m)
    # one process all-reduces nothing (`ray_zep.train.reductions`): no flat buffer
    replicated = m.weights.family is Family.AUTOGRAD and not m.weights.fsdp
    flat = grads if replicated and m.ranks > 1 else 0
    params = owned * FP32 + work.gathered
    if activations + ring + work.copies + work.left_gathered >= grads + flat + work.unit_grads:
        held = params + work.left_gathered + work.copies
        return RankMemory(held, summed, optimizer, activations, ring)
    return RankMemory(params, grads + summed, optimizer, 0.0, flat + work.unit_grads,
                      "end of backward")  # fmt: skip


def kept_kv_bytes(shape: ModelShape, m: MemoryInputs) -> float:
    """The K/V a kept ring holds from the forward until the backward: every layer's, but
    of the blocks under full checkpointing only the one whose forward the backward runs
    again."""
    layers = _kept_kv_layers(shape, _per_token_inputs(m))
    return 2 * shape.n_kv_heads * shape.head_dim * m.kept_kv_tokens * m.compute_bytes * layers


@functools.lru_cache(maxsize=1024)
def _kept_kv_layers(shape: ModelShape, m: MemoryInputs) -> int:
    """The layers whose K/V a kept ring holds at once (`kept_kv_bytes`)."""
    full = sum(m.block_checkpointing(i) is ActivationCheckpointing.FULL
               for i in range(shape.n_layers))  # fmt: skip
    return shape.n_layers - full + min(full, 1)


def state_bytes(shape: ModelShape, m: MemoryInputs) -> float:
    """Parameters + gradients + optimizer state at their own peak, late in backward:
    every gradient exists and the borrowed or gathered weights of that moment."""
    owned = owned_params(shape, m)
    grads = _gradient_elements(shape, m) * FP32
    summed = _gradient_sum_bytes(owned, m)
    return (
        owned * FP32
        + _working_set(shape, _per_token_inputs(m)).gathered
        + grads
        + summed
        + ADAM_MOMENTS * owned * FP32
    )


@dataclass(frozen=True)
class _WorkingSet:
    """Weights held in backward beyond the owned ones (`gathered`: through its end too;
    `left_gathered`: more at its start, the units the forward left gathered under
    `parallel.reshard_after_forward=false`; `copies`: autocast's, each freed by its
    matmul's backward, so none at its end), and one FSDP2 unit's unsharded gradients
    before their reduce-scatter (bytes)."""

    gathered: float = 0.0
    unit_grads: float = 0.0
    copies: float = 0.0
    left_gathered: float = 0.0


@functools.lru_cache(maxsize=1024)
def _working_set(shape: ModelShape, m: MemoryInputs) -> _WorkingSet:
    """What `_WorkingSet` holds (`m` as `_per_token_inputs` gives it: no token changes it)."""
    if m.weights.sharding is Sharding.OWNER:
        borrowed = 2 * owned_params(shape, m) * FP32  # the shard computing and the next
        return _WorkingSet(borrowed)
    if not m.weights.fsdp:
        return _WorkingSet(copies=autocast_weight_copies(shape, m))
    # backward gathers one unit at a time, with prefetch also the `prefetch_depth` before
    # it (1 for projection units, as `ray_zep.prefetch_plan` resolves it): the fullest
    # such window
    units = fsdp_units(shape, m.fsdp_unit)
    largest = max(units)
    ahead = m.prefetch_depth if m.prefetch else 0
    window = min(len(units), 1 + ahead)
    gathered = max(sum(units[i : i + window]) for i in range(len(units) - window + 1))
    if m.fsdp_unit is FsdpUnit.LINEAR:
        # a region recomputed in backward gathers its projections together and holds
        # them until their own backward (FSDP2 does not reshard in backward)
        gathered = max(gathered, _recompute_gathered(shape, m.checkpointing))
    # not resharded after forward, every unit stays gathered until its own backward, after
    # which FSDP2 reshards it: at the start of backward all of them are
    left = 0 if m.reshard_after_forward else max(0, sum(units) - gathered)
    if m.reshard_after_forward and m.reshard_to_node:  # resharded to the node: 1/G each
        left = max(0, sum(units) - gathered) / m.gpus_per_node
    return _WorkingSet(gathered * m.compute_bytes, largest * FP32,
                       left_gathered=left * m.compute_bytes)  # fmt: skip


def autocast_weight_copies(shape: ModelShape, m: MemoryInputs) -> float:
    """Bytes of the compute-dtype copies autocast makes of the fp32 weights a rank's matmuls
    read (every projection and the output head; not the embedding, which is looked up,
    nor the norms' scales): each matmul keeps its copy for backward, so all of them are
    held at the start of backward and none at its end (one H200, 7B width, eight blocks:
    the measured peak at 4k tokens is the start's, within 1.5%). None in fp32, nor under
    FSDP2, which gathers its weights in the compute dtype already."""
    if m.compute_bytes == FP32:
        return 0.0
    norms = (2 * shape.n_layers + 1) * shape.dim
    return (owned_params(shape, m) - shape.vocab_size * shape.dim - norms) * m.compute_bytes


def fsdp_units(shape: ModelShape, unit: FsdpUnit) -> list[int]:
    """Parameters of each FSDP2 unit (`ray_zep.train.fsdp.shard_model`)."""
    units = model_units(shape)
    if unit is FsdpUnit.BLOCK:
        return units
    out = [units[0]]
    for index in range(shape.n_layers):
        if shape.is_moe_block(index):
            out.append(block_params(shape, index))
        else:
            out.extend([2 * shape.dim, *_projections(shape)])
    return [*out, units[-1]]


def _projections(shape: ModelShape) -> list[int]:
    """Parameters of a dense block's projections: q, k, v, o, then w1, w3, w2."""
    d, q, kv = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    return [d * q, d * kv, d * kv, q * d, *[d * shape.ffn_dim] * 3]


def _recompute_gathered(shape: ModelShape, mode: ActivationCheckpointing) -> int:
    """Projection parameters a dense block's checkpointed region holds gathered at once."""
    if mode is ActivationCheckpointing.NONE or shape.moe_blocks == shape.n_layers:
        return 0
    projections = _projections(shape)
    if mode is ActivationCheckpointing.LINEARS:  # q, k, v; then o and the feed-forward
        return max(sum(projections[:3]), sum(projections[3:]))
    return sum(projections if mode is ActivationCheckpointing.FULL else projections[4:])


def owned_params(shape: ModelShape, m: MemoryInputs) -> float:
    """fp32 parameters a rank stores between steps (elements)."""
    return _owned_params(shape, m.weights.sharding, m.ep, m.shard_ranks or m.ranks, m.gpus_per_node)


@functools.lru_cache(maxsize=1024)
def _owned_params(
    shape: ModelShape, sharding: Sharding, ep: int, ranks: int, gpus_per_node: int
) -> float:
    """`owned_params`, once per weights layout (the same for every rank a plan holds);
    `ranks`: the shard group's under `Sharding.ALL_RANKS`."""
    total = shape.param_count()
    experts = expert_params(shape)
    if sharding is Sharding.NONE:
        return total - experts + experts / ep
    if sharding is Sharding.ALL_RANKS:
        return total / ranks
    if sharding is Sharding.NODE:
        return (total - experts) / gpus_per_node + experts / ranks
    return max(_weight_shards(shape, ranks))  # the largest shard bounds every rank's


def expert_params(shape: ModelShape) -> int:
    """Weights of every expert of every MoE block."""
    return shape.moe_blocks * shape.moe_experts * 3 * shape.dim * shape.expert_hidden


def _gradient_sum_bytes(owned: float, m: MemoryInputs) -> float:
    """The micro-batches' gradient sum (`MemoryInputs.micro_batches`): a copy of the
    gradients of the `owned` parameters, none for one batch a step."""
    return owned * FP32 if m.micro_batches > 1 else 0.0


def _gradient_elements(shape: ModelShape, m: MemoryInputs) -> float:
    if m.weights.sharding is Sharding.OWNER:
        return 2 * max(_weight_shards(shape, m.ranks))  # own shard's and the one in flight
    return owned_params(shape, m)


def _weight_shards(shape: ModelShape, ranks: int) -> list[int]:
    """Parameters of each weight-passing shard (whole units)."""
    units = model_units(shape)
    return [sum(units[i] for i in shard) for shard in cut_shards(units, ranks)]


def model_units(shape: ModelShape) -> list[int]:
    """Parameters of the units weights are sharded or passed in, in forward order: the
    embedding, each block, the head (final norm and output)."""
    blocks = [block_params(shape, i) for i in range(shape.n_layers)]
    return [shape.vocab_size * shape.dim, *blocks, shape.vocab_size * shape.dim + shape.dim]


def block_params(shape: ModelShape, index: int) -> int:
    """Parameters of block `index` (every expert of an MoE block)."""
    ffn = 3 * shape.dim * shape.ffn_dim
    if shape.is_moe_block(index):
        ffn = shape.moe_experts * (3 * shape.dim * shape.expert_hidden + shape.dim)
    return shape.attention_params_per_layer() + ffn + 2 * shape.dim


def mean_block_params(shape: ModelShape) -> float:
    """Parameters of one block, averaged over dense and MoE blocks."""
    return sum(block_params(shape, i) for i in range(shape.n_layers)) / shape.n_layers


def activation_bytes(shape: ModelShape, m: MemoryInputs) -> float:
    """Bytes of activations at the fuller of two moments of backward: the loss's backward
    (every kept activation, the head's, the logits and the loss's two vocabulary-wide
    gradients) and a block's backward (the kept activations of the blocks up to it, whose
    backward has not run yet, the logits, that block's recomputed activations and the
    gradients it computes)."""
    kept, recomputed, widest = _blocks_per_token(shape, _per_token_inputs(m))
    c, vocab = m.compute_bytes, shape.vocab_size
    logits = vocab * c  # the model's logits, which the step holds until its end
    # the head: its norm, its projection's input (a cast under autocast), and the
    # log-softmax output the loss keeps
    head = _norm_kept(shape, m) + _casts(shape, m) + vocab * FP32
    loss_grads = 2 * vocab * FP32  # the loss's backward: its output's and input's gradients
    # a block's backward: gradients of its widest intermediate and of its input
    working = (widest + shape.dim) * FP32
    scores = 0.0
    if m.ring_tokens and not (m.flash_kernel or m.on_cpu):
        # the torch kernel's backward of a ring block: scores, probabilities and their
        # gradient, H x chunk x chunk in fp32 (the rank's ring tokens bound the chunk)
        scores = SCORE_MATRICES * shape.n_heads * float(m.ring_tokens) ** 2 * FP32
    if m.loss_chunk_tokens:
        return _chunked_loss_peak(shape, m, kept, recomputed + working) + scores
    # while blocks run backward: as measured on CPU, the head's norm and the logits in
    # fp32 (and in the compute dtype) still count
    held = _norm_kept(shape, m) + vocab * FP32 + (logits if c != FP32 else 0.0)
    # in fp32 the logits are the log-softmax's input itself (`.float()` copies nothing)
    at_loss = kept + head + (logits if c != FP32 else 0.0) + loss_grads
    in_blocks = kept + recomputed + held + working
    return m.tokens * max(at_loss, in_blocks) + scores


@functools.lru_cache(maxsize=4096)
def _per_token_inputs(m: MemoryInputs) -> MemoryInputs:
    """`m` without what a rank holds: what its blocks keep per token is the same for
    every rank of a plan (`_blocks_per_token`'s key)."""
    return dataclasses.replace(m, tokens=0, ring_tokens=0, kept_kv_tokens=0.0)


@functools.lru_cache(maxsize=1024)
def _blocks_per_token(shape: ModelShape, m: MemoryInputs) -> tuple[float, float, int]:
    """Bytes per token the blocks keep for backward, the most a checkpointed block's
    backward recomputes beyond them, and the widest intermediate of a block's backward
    (elements), for `activation_bytes`."""
    kept, recomputed = 0.0, 0.0  # per token; recomputed: the fullest block's moment
    for index in range(shape.n_layers):
        attention, feed_forward = _block_halves(shape, index, m)
        mode = m.block_checkpointing(index)
        if mode is ActivationCheckpointing.NONE:
            kept += attention + feed_forward
            continue
        if mode is ActivationCheckpointing.SELECTIVE:
            kept += attention + shape.dim * FP32
            again = feed_forward
        elif mode is ActivationCheckpointing.LINEARS:
            kernel = _kernel_kept(shape, m)
            kept += kernel + shape.dim * FP32
            # the feed-forward half is recomputed as the block's backward starts, the
            # attention's norm and projections after the attention's backward: apart
            again = max(attention - kernel, feed_forward)
        else:
            kept += shape.dim * FP32
            again = attention + feed_forward
        recomputed = max(recomputed, kept + again)
    # the last block's backward holds every kept activation, recomputing nothing beyond
    recomputed = max(recomputed - kept, 0.0)
    widest = max(
        shape.moe_top_k * shape.expert_hidden if shape.is_moe_block(i) else shape.ffn_dim
        for i in range(shape.n_layers)
    )
    return kept, recomputed, widest


def _chunked_loss_peak(shape: ModelShape, m: MemoryInputs, kept: float, backward: float) -> float:
    """Activation bytes of the step's fuller moment under the chunked loss
    (`ray_zep.model.loss`), which never holds the batch's logits: its forward computes
    the gradients chunk by chunk (one chunk's fp32 logits, turned into their gradient in
    place, and its compute-dtype copy where that is not fp32) into the hidden states'
    gradient (fp32, every token) and the head weight's fp32 gradient sum; its backward
    scales both (a second copy of each). Blocks then run backward with the head's norm
    alone still held.
    `backward`: per token, a block's recomputed activations and working gradients."""
    vocab, dim = shape.vocab_size, shape.dim
    chunk = min(m.loss_chunk_tokens, m.tokens)
    head = _norm_kept(shape, m) + _casts(shape, m)
    weight_grads = vocab * dim * FP32
    at_loss = (
        m.tokens * (kept + head + 2 * dim * FP32)
        + weight_grads
        + max(chunk * vocab * (FP32 + _copy_bytes(m)), weight_grads)
    )
    in_blocks = m.tokens * (kept + backward + _norm_kept(shape, m))
    return max(at_loss, in_blocks)


def _copy_bytes(m: MemoryInputs) -> int:
    """Bytes of a compute-dtype copy of an fp32 value: none in fp32 (`.to` copies nothing)."""
    return 0 if m.compute_bytes == FP32 else m.compute_bytes


def _norm_kept(shape: ModelShape, m: MemoryInputs) -> float:
    """Bytes per token an RMSNorm keeps: its fp32 input and inverse RMS
    (`ray_zep.lean_ops`), and in fp32 its output, which the next matmuls keep as
    their input (under autocast they keep its bf16 cast instead, `_casts`)."""
    kept = 2 if m.compute_bytes == FP32 else 1
    return (kept * shape.dim + 1) * FP32


def _casts(shape: ModelShape, m: MemoryInputs) -> float:
    """Bytes per token of the compute-dtype copy of a norm's output under autocast, cast
    once for every projection reading it (`ray_zep.model.llama.RMSNorm`; none in fp32)."""
    return 0.0 if m.compute_bytes == FP32 else shape.dim * m.compute_bytes


def _kernel_kept(shape: ModelShape, m: MemoryInputs) -> float:
    """Bytes per token the attention kernel keeps for its backward (with the output
    projection's input): q, k, v as it saw them, its output and the log-sum-exp."""
    c, he = m.compute_bytes, shape.n_heads * shape.head_dim
    if m.flash_kernel:
        return (2 * he + 2 * shape.n_kv_heads * shape.head_dim) * c + shape.n_heads * FP32
    return 5 * he * c + shape.n_heads * FP32


def _block_halves(shape: ModelShape, index: int, m: MemoryInputs) -> tuple[float, float]:
    """Bytes per token the attention half and the feed-forward half of a block keep."""
    c, d = m.compute_bytes, shape.dim
    norm = _norm_kept(shape, m)
    attention = norm + _kernel_kept(shape, m) + _casts(shape, m)  # one for q, k and v
    if shape.is_moe_block(index):
        per_choice = 2 * d + 3 * shape.expert_hidden
        ffn = norm + _casts(shape, m) + 2 * shape.moe_experts * FP32
        ffn += shape.moe_top_k * per_choice * c
    else:
        ffn = norm + _casts(shape, m) + 3 * shape.ffn_dim * c  # one for w1 and w3
    return attention, ffn
