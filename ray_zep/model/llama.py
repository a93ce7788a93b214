"""LLaMA-style decoder over packed variable-length batches.

RMSNorm, rotary position embeddings computed from per-token position ids (which
restart at every document), grouped-query attention and SwiGLU; the norms and SwiGLU
keep only their inputs for backward (`ray_zep.lean_ops`), and under autocast a norm's
output is cast once for all the projections reading it (`RMSNorm.forward`). Documents
never attend to each other: attention runs per sequence through a varlen kernel.

The model is plain PyTorch and runs in one process as is; parallelising it is
done outside, by the strategy.

MoE models (`ModelShape.moe_experts` > 0) put a `ray_zep.moe.layer.MoE` in
place of the feed-forward of every `moe_every`-th block; `ray_zep.moe.parallel`
spreads its experts over ranks and may give the block a pipelined forward.

Activation checkpointing (`Block.checkpointing`) keeps a block's input (`full`)
or its attention output (`selective`) and runs the rest of its forward again in
backward. The recomputation runs to the end of the checkpointed region even
after the tensors backward needs are back (no early stop), so a recomputed
forward posts every transfer the first one posted, on every rank alike.

Given labels, the model returns the loss instead of the logits (`OutputHead`),
chunk by chunk of tokens when `Transformer.loss_chunk_tokens` > 0
(`ray_zep.model.loss`). The head computes it inside its own forward so that
FSDP2's hooks have gathered the whole output weight when it runs.

`Transformer.compile_blocks` compiles regions of every block with torch.compile
(as TorchTitan compiles per block, not the whole model): the attention norm,
q/k/v projections and RoPE as one graph, the feed-forward norm and SwiGLU as
another (dense blocks only: an MoE feed-forward communicates). The attention
call between them, which may run the distributed engine, stays eager and is
never traced, so there is no graph break inside a region.

Shape legend: T tokens of the packed batch, D model dim, H query heads,
K key/value heads, E head dim, F feed-forward dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ray_zep.attention.kernels import AttentionFn, torch_varlen_attention
from ray_zep.attention.rope import apply_rope, rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.constants import IGNORE_INDEX
from ray_zep.lean_ops import rms_norm, swiglu
from ray_zep.model.loss import chunked_cross_entropy
from ray_zep.model_shapes import ModelShape
from ray_zep.moe.gate import Balance
from ray_zep.moe.layer import MoE
from ray_zep.options import ActivationCheckpointing

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The normed input; under autocast in its dtype, cast once here: the projections
        reading it then keep one copy between them for backward where each would cast and
        keep its own (q, k and v: three; w1 and w3: two), as blocks whose activations are
        bf16 throughout keep one. Their input gradients sum in that dtype before the cast
        back, as in those blocks."""
        out_TD = rms_norm(x_TD, self.weight, self.eps)
        device = out_TD.device.type
        if torch.is_autocast_enabled(device):
            return out_TD.to(torch.get_autocast_dtype(device))
        return out_TD


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = shape.n_heads, shape.n_kv_heads
        self.head_dim = shape.head_dim
        bias = shape.qkv_bias
        self.wq = nn.Linear(shape.dim, shape.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.dim, bias=False)

    def forward(
        self,
        x_TD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seqs: PackedSeqs,
        attention: AttentionFn,
    ) -> torch.Tensor:
        out_THE, _ = attention(*self.project(x_TD, rope), seqs, causal=True)
        return self.output(out_THE)

    def project(
        self, x_TD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_THE and k_TKE (rotated) and v_TKE of the normed input."""
        tokens = x_TD.shape[0]
        q_THE = apply_rope(self.wq(x_TD).view(tokens, self.n_heads, self.head_dim), *rope)
        k_TKE = apply_rope(self.wk(x_TD).view(tokens, self.n_kv_heads, self.head_dim), *rope)
        v_TKE = self.wv(x_TD).view(tokens, self.n_kv_heads, self.head_dim)
        return q_THE, k_TKE, v_TKE

    def output(self, out_THE: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's out_THE."""
        return self.wo(out_THE.reshape(out_THE.shape[0], self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.w2 = nn.Linear(shape.ffn_dim, shape.dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x_TD), self.w3(x_TD)))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward: nn.Module = FeedForward(shape)
        if shape.is_moe_block(index):
            self.feed_forward = MoE(
                shape.dim,
                shape.expert_hidden,
                shape.moe_experts,
                shape.moe_top_k,
                shape.moe_capacity_factor,
            )
        self.pipeline = None
        """A forward that overlaps this block's all-to-alls with computation
        (`ray_zep.moe.pipeline`), or None."""
        self.checkpointing = ActivationCheckpointing.NONE
        """What backward recomputes (`train.activation_checkpointing`). A pipelined
        block interleaves attention and experts, so `selective` and `linears` recompute
        it whole."""
        self.compiled: dict[str, Callable] = {}
        """The regions `compile_regions` compiled, by name (`qkv`, `ffn`)."""

    def compile_regions(self) -> None:
        """torch.compile the q/k/v region and, in a dense block, the feed-forward region.

        Token counts vary from step to step: the regions compile with dynamic
        shapes, once. The attention call between them stays eager.
        """
        self.compiled["qkv"] = torch.compile(self.attention_inputs, dynamic=True)
        if isinstance(self.feed_forward, FeedForward):
            self.compiled["ffn"] = torch.compile(self._feed_forward, dynamic=True)

    def forward(
        self,
        x_TD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seqs: PackedSeqs,
        attention: AttentionFn,
    ) -> torch.Tensor:
        mode = self.active_checkpointing()
        whole = mode is ActivationCheckpointing.FULL or (
            mode is not ActivationCheckpointing.NONE and self.pipeline is not None
        )
        if whole:
            return _recomputed(self._forward, x_TD, rope, seqs, attention)
        return self._forward(x_TD, rope, seqs, attention)

    def _forward(self, x_TD, rope, seqs, attention) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline(self, x_TD, rope, seqs, attention)
        return self.plain_forward(x_TD, rope, seqs, attention)

    def plain_forward(self, x_TD, rope, seqs, attention) -> torch.Tensor:
        """Attention, then the feed-forward. An attention offering `around_projections`
        (the engine's, `ray_zep.train.runners.EngineAttention`) takes the projections
        too, to overlap its exchanges with them; not where `linears` recomputes them."""
        qkv = self.compiled.get("qkv", self.attention_inputs)
        mode = self.active_checkpointing()
        if mode is ActivationCheckpointing.LINEARS:
            out_THE, _ = attention(*_recomputed(qkv, x_TD, rope), seqs, causal=True)
            return _recomputed(self._after_attention, x_TD, out_THE)
        overlapped = getattr(attention, "around_projections", None)
        if overlapped is not None:  # the attention overlaps its exchanges with projections
            h_TD = x_TD + overlapped(x_TD, rope, qkv, self.attention.output)
        else:
            out_THE, _ = attention(*qkv(x_TD, rope), seqs, causal=True)
            h_TD = x_TD + self.attention.output(out_THE)
        ffn = self.compiled.get("ffn", self._feed_forward)
        if mode is ActivationCheckpointing.SELECTIVE:
            return h_TD + _recomputed(ffn, h_TD)
        return h_TD + ffn(h_TD)

    def active_checkpointing(self) -> ActivationCheckpointing:
        """The block's checkpointing where autograd records (none under `no_grad`)."""
        return self.checkpointing if torch.is_grad_enabled() else ActivationCheckpointing.NONE

    def _after_attention(self, x_TD: torch.Tensor, out_THE: torch.Tensor) -> torch.Tensor:
        """The output projection, the residuals and the feed-forward, after the attention."""
        h_TD = x_TD + self.attention.output(out_THE)
        return h_TD + self.compiled.get("ffn", self._feed_forward)(h_TD)

    def attention_inputs(
        self, x_TD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_THE, k_TKE and v_TKE of the block's input (attention norm, projections, RoPE)."""
        return self.attention.project(self.attention_norm(x_TD), rope)

    def _feed_forward(self, h_TD: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(h_TD))


class OutputHead(nn.Linear):
    """The output projection (no bias); given labels, the loss instead of the logits."""

    def forward(
        self,
        h_TD: torch.Tensor,
        labels_T: torch.Tensor | None = None,
        chunk_tokens: int = 0,
        reduction: str = "sum",
    ) -> torch.Tensor:
        """logits_TV, or the fp32 token cross-entropies of `labels_T` (IGNORE_INDEX: none).

        Args:
            h_TD: the final norm's output.
            labels_T: next-token ids; None returns the logits.
            chunk_tokens: > 0 computes the loss that many tokens at a time
                (`chunked_cross_entropy`); 0 from the whole batch's logits.
            reduction: `sum` or `none` (losses_T), as `F.cross_entropy` takes it.
        """
        if labels_T is None:
            return super().forward(h_TD)
        if chunk_tokens:
            return chunked_cross_entropy(
                h_TD, self.weight, labels_T, chunk_tokens, IGNORE_INDEX, reduction
            )
        logits_TV = super().forward(h_TD)
        return F.cross_entropy(
            logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction=reduction
        )


def _recomputed(fn, *args) -> torch.Tensor:
    """`fn(*args)` whose activations backward recomputes (non-reentrant, no early stop)."""
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False)


class Transformer(nn.Module):
    """Decoder-only LLaMA-style language model.

    Args:
        shape: model dimensions.
        attention: varlen attention kernel (defaults to the torch reference).
    """

    def __init__(self, shape: ModelShape, attention: AttentionFn = torch_varlen_attention) -> None:
        super().__init__()
        self.shape = shape
        self.attention_fn = attention
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(Block(shape, i) for i in range(shape.n_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.output = OutputHead(shape.dim, shape.vocab_size, bias=False)
        self.loss_chunk_tokens = 0
        """Tokens per chunk of the loss given labels (`model.loss_chunk_tokens`); 0: whole."""

    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, 0.02) weights, output projections scaled by 1/sqrt(2 x layers),
        zero biases (`ModelShape.qkv_bias`).

        Drawn from `generator` in parameter order, so every layer differs and
        every rank that uses the same seed builds the same model.
        """
        params = dict(self.named_parameters())
        shapes = {name: param.shape for name, param in params.items()}
        with torch.no_grad():
            for name, value in self.initial_values(generator, shapes):
                params[name].copy_(value)

    def initial_values(
        self, generator: torch.Generator, shapes: dict[str, torch.Size]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`init_weights`' value of each parameter of `shapes` (its name and whole shape,
        in parameter order), one at a time on the host: what a rank whose parameters are
        already split or sharded copies its own part of."""
        residual_std = INIT_STD / math.sqrt(2 * self.shape.n_layers)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape)
            elif name.endswith(".bias"):
                yield name, torch.zeros(shape)
            else:
                residual = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
                std = residual_std if residual else INIT_STD
                yield name, torch.randn(shape, generator=generator) * std

    def set_checkpointing(
        self,
        mode: ActivationCheckpointing,
        blocks: int = 0,
        rest: ActivationCheckpointing = ActivationCheckpointing.NONE,
    ) -> None:
        """Activation checkpointing (`train.activation_checkpointing`) of the first
        `blocks` blocks (`train.checkpoint_blocks`; 0: every block); the others run
        `rest` (`train.checkpoint_rest`; none: they keep every activation)."""
        for index, block in enumerate(self.layers):
            block.checkpointing = mode.on_block(index, blocks, rest)

    def compile_blocks(self) -> None:
        """Compile every block's regions (`model.compile`; see `Block.compile_regions`)."""
        for block in self.layers:
            block.compile_regions()

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards, block by block."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def balance(self) -> list[Balance]:
        """Load-balancing statistics of every MoE block's last forward."""
        return [m.balance for m in self.moe_layers() if m.balance is not None]

    def forward(
        self,
        tokens_T: torch.Tensor,
        positions_T: torch.Tensor,
        seqs: PackedSeqs | None,
        attention: AttentionFn | None = None,
        labels_T: torch.Tensor | None = None,
        reduction: str = "sum",
    ) -> torch.Tensor:
        """Logits of the next token at every position, or the loss against `labels_T`.

        Args:
            tokens_T: int64 token ids of the packed batch.
            positions_T: position of each token inside its own sequence.
            seqs: sequence boundaries (sum of lengths == T); None when `attention`
                knows the layout itself (the distributed engine).
            attention: overrides the model's kernel for this call, e.g. the
                attention engine of a parallel strategy.
            labels_T: next-token ids (IGNORE_INDEX where there is none); given,
                the head returns the fp32 cross-entropy instead of the logits,
                `loss_chunk_tokens` tokens at a time when that is > 0.
            reduction: with labels: `sum` of the token losses, or `none` (losses_T).

        Returns:
            logits_TV, or the loss.
        """
        rope = rope_tables(positions_T, self.shape.head_dim, self.shape.rope_theta)
        h_TD = self.tok_embeddings(tokens_T)
        attention = attention or self.attention_fn
        for layer in self.layers:
            h_TD = layer(h_TD, rope, seqs, attention)
        h_TD = self.norm(h_TD)
        if labels_T is None:
            return self.output(h_TD)
        return self.output(h_TD, labels_T, self.loss_chunk_tokens, reduction)
