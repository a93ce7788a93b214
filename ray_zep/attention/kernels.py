"""Variable-length attention kernels returning the output and the log-sum-exp.

Shapes (T tokens of a packed batch, H query heads, K key/value heads, E head dim):
    q_THE, k_TKE, v_TKE -> out_THE, lse_HT (float32)

Both kernels follow flash-attn's varlen conventions so callers never care which
one ran: queries and keys of a sequence may differ in length (ring attention
feeds a query block against a key block), and `causal` aligns the mask to the
bottom-right corner (query i of a block of Sq sees key j iff j <= i + Sk - Sq).
A query row that sees no key gets out = 0 and lse = -inf.

- `flash`: flash-attn's varlen kernel, for CUDA tensors in fp16/bf16 (an optional extra).
- `torch_flash`: the FlashAttention-2 kernels built into torch (`aten._flash_attention_*`,
  varlen, with the LSE; FA3 on Hopper where installed), for CUDA tensors in fp16/bf16 on
  sm_80+: the default on a GPU, nothing to compile. They draw the reference's mask on the
  same blocks as the fused CPU op below (a square block, causal or not, and any non-causal
  block); a causal block whose query and key lengths differ keeps the reference's explicit
  mask, forward and backward.
- `torch`: a reference in plain torch ops that accumulates in fp32; runs
  anywhere and is differentiable through autograd. On CPU, every block whose mask
  PyTorch's fused CPU flash-attention op draws the same way (a square block, causal
  or not, and a non-causal block of any shape: whole sequences and almost every ring
  block) goes through that op, forward and backward; a causal block whose query and
  key lengths differ keeps the explicit bottom-right mask.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ray_zep.attention import torch_flash
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.errors import ConfigError

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "flash", "torch_flash")


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""A forward kernel: `torch_varlen_attention`'s arguments, (output, LSE)."""


@dataclass(frozen=True)
class BackwardInputs:
    """What a backward kernel takes: one attention block with the *final* output and LSE
    of its queries.

    Ring attention splits a query's keys over several blocks; with the merged `out_THE`
    and `lse_HT` each block's probabilities are exp(S - lse), so the per-block gradients
    sum to the gradient of the whole attention.

    Attributes:
        dout_THE: gradient of the output.
        q_THE: queries of the block's sequences, packed.
        k_TKE, v_TKE: keys and values with their own head count K (H % K == 0).
        out_THE: the queries' final output, over all their key blocks.
        lse_HT: the queries' final LSE, float32; -inf where a row saw no key at all.
        seqs_q, seqs_k: boundaries of the query and the key sequences.
        causal: bottom-right aligned causal mask.
        softmax_scale: defaults to 1/sqrt(E).
    """

    dout_THE: torch.Tensor
    q_THE: torch.Tensor
    k_TKE: torch.Tensor
    v_TKE: torch.Tensor
    out_THE: torch.Tensor
    lse_HT: torch.Tensor
    seqs_q: PackedSeqs
    seqs_k: PackedSeqs
    causal: bool
    softmax_scale: float | None = None

    @property
    def scale(self) -> float:
        """The softmax scale: the one given, else 1 / sqrt(head dim)."""
        return _scale(self.q_THE, self.softmax_scale)

    def covered(self) -> BackwardInputs:
        """The block cut to the rows its sequences cover (the tensors may have more)."""
        tq, tk = self.seqs_q.total_tokens, self.seqs_k.total_tokens
        return replace(
            self,
            dout_THE=self.dout_THE[:tq],
            q_THE=self.q_THE[:tq],
            k_TKE=self.k_TKE[:tk],
            v_TKE=self.v_TKE[:tk],
            out_THE=self.out_THE[:tq],
            lse_HT=self.lse_HT[:, :tq],
        )

    def subset(self, keep: list[bool]) -> tuple[torch.Tensor, torch.Tensor, BackwardInputs]:
        """The block of the kept sequences, with the query rows and the key rows (int64)
        that it takes from this one."""
        rows_q, seqs_q = _subset(self.seqs_q, keep, self.q_THE.device)
        rows_k, seqs_k = _subset(self.seqs_k, keep, self.q_THE.device)
        block = replace(
            self,
            dout_THE=self.dout_THE.index_select(0, rows_q),
            q_THE=self.q_THE.index_select(0, rows_q),
            k_TKE=self.k_TKE.index_select(0, rows_k),
            v_TKE=self.v_TKE.index_select(0, rows_k),
            out_THE=self.out_THE.index_select(0, rows_q),
            lse_HT=self.lse_HT.index_select(1, rows_q),
            seqs_q=seqs_q,
            seqs_k=seqs_k,
        )
        return rows_q, rows_k, block


BackwardKernel = Callable[[BackwardInputs], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""A backward kernel: dq_THE, dk_TKE, dv_TKE of a block, in float32 or, from a GPU kernel
that covers the whole block in one launch, in q's dtype (callers add them up in float32)."""


@functools.cache
def flash_attn_available() -> bool:
    """Whether flash-attn's varlen kernel can be imported."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return False
    return True


def torch_varlen_attention(
    q_THE: torch.Tensor,
    k_TKE: torch.Tensor,
    v_TKE: torch.Tensor,
    seqs_q: PackedSeqs,
    seqs_k: PackedSeqs | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference varlen attention in torch, fp32 accumulation.

    Args:
        q_THE: queries of all sequences, packed.
        k_TKE, v_TKE: keys and values with their own head count K (H % K == 0).
        seqs_q: boundaries of the query sequences.
        seqs_k: boundaries of the key sequences (defaults to seqs_q).
        causal: bottom-right aligned causal mask.
        softmax_scale: defaults to 1/sqrt(E).

    Returns:
        out_THE in q's dtype and lse_HT in float32.
    """
    seqs_k = seqs_k or seqs_q
    if seqs_q.num_seqs != seqs_k.num_seqs:
        raise ValueError(f"{seqs_q.num_seqs} query sequences but {seqs_k.num_seqs} key sequences")
    heads, kv_heads = q_THE.shape[1], k_TKE.shape[1]
    scale = _scale(q_THE, softmax_scale)
    fused = q_THE.device.type == "cpu"
    outs, lses = [], []
    for qo, sq, ko, sk in zip(
        seqs_q.offsets, seqs_q.lengths, seqs_k.offsets, seqs_k.lengths, strict=True
    ):
        q_HSE = q_THE[qo : qo + sq].transpose(0, 1).float()
        k_HSE = k_TKE[ko : ko + sk].transpose(0, 1).float().repeat_interleave(heads // kv_heads, 0)
        v_HSE = v_TKE[ko : ko + sk].transpose(0, 1).float().repeat_interleave(heads // kv_heads, 0)
        if fused and _fused_op_draws_the_mask(sq, sk, causal):
            out, lse = _cpu_flash(q_HSE, k_HSE, v_HSE, causal, scale)
        else:
            scores = torch.matmul(q_HSE, k_HSE.transpose(1, 2)) * scale
            if causal:
                out, lse = _masked_softmax_matmul(scores, v_HSE, sq, sk)
            else:
                lse = torch.logsumexp(scores, dim=-1)
                out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v_HSE)
        outs.append(out.transpose(0, 1).to(q_THE.dtype))
        lses.append(lse)
    if not outs:
        return q_THE.new_zeros(q_THE.shape), q_THE.new_zeros((heads, 0), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _fused_op_draws_the_mask(sq: int, sk: int, causal: bool) -> bool:
    """Whether a fused op's mask is this block's (the CPU op and `torch_flash` alike): the
    CPU op's causal mask is aligned top-left, which agrees with the bottom-right one only on
    a square block; `torch_flash` is held to the same rule."""
    return sq > 0 and sk > 0 and (sq == sk or not causal)


def _cpu_flash(q_HSE, k_HSE, v_HSE, causal: bool, scale: float):
    """PyTorch's fused CPU flash attention, which also returns the log-sum-exp; about 7x
    faster than the explicit masked softmax on a 1k-token sequence, equal to it within
    fp32 rounding."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_HSE.unsqueeze(0), k_HSE.unsqueeze(0), v_HSE.unsqueeze(0), 0.0, causal, scale=scale
    )[:2]
    return out[0], lse[0]


def _cpu_flash_backward(do_HSE, q_HSE, k_HSE, v_HSE, o_HSE, lse_HS, causal: bool, scale: float):
    """The fused op's backward, fed the *final* output and LSE of the queries (it forms the
    probabilities as exp(S - lse) and delta from dout and out, as the explicit path does);
    2-6x faster than the explicit one on blocks of a few hundred rows."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.unsqueeze(0).contiguous() for t in (do_HSE, q_HSE, k_HSE, v_HSE, o_HSE, lse_HS)),
        0.0,
        causal,
        scale=scale,
    )
    return tuple(g[0] for g in grads)


def _masked_softmax_matmul(
    scores: torch.Tensor, v_HSE: torch.Tensor, sq: int, sk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(sq, device=scores.device).unsqueeze(1)
    cols = torch.arange(sk, device=scores.device).unsqueeze(0)
    visible = cols <= rows + (sk - sq)
    has_key = visible.any(dim=1)
    # Rows with no visible key would give exp(-inf - -inf) = nan in forward and
    # in backward; compute them on zeros and mask the results instead.
    safe = scores.masked_fill(~visible, float("-inf")).masked_fill(~has_key.unsqueeze(1), 0.0)
    lse = torch.logsumexp(safe, dim=-1)
    probs = torch.exp(safe - lse.unsqueeze(-1)) * visible
    out = torch.matmul(probs, v_HSE)
    lse = lse.masked_fill(~has_key, float("-inf"))
    return out, lse


def flash_varlen_attention(
    q_THE: torch.Tensor,
    k_TKE: torch.Tensor,
    v_TKE: torch.Tensor,
    seqs_q: PackedSeqs,
    seqs_k: PackedSeqs | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen kernel behind the same interface as the reference."""
    from flash_attn import flash_attn_varlen_func

    seqs_k = seqs_k or seqs_q
    out, lse, _ = flash_attn_varlen_func(
        q_THE,
        k_TKE,
        v_TKE,
        seqs_q.cu_seqlens,
        seqs_k.cu_seqlens,
        seqs_q.max_seqlen,
        seqs_k.max_seqlen,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        return_attn_probs=True,
    )
    return out, lse


def torch_flash_varlen_attention(
    q_THE: torch.Tensor,
    k_TKE: torch.Tensor,
    v_TKE: torch.Tensor,
    seqs_q: PackedSeqs,
    seqs_k: PackedSeqs | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's built-in flash kernels behind the reference's interface, differentiable
    through autograd (out; the LSE is not, as with flash-attn).

    Every block whose mask they draw (`_fused_op_draws_the_mask`) goes through one varlen
    launch; the others (causal, query and key lengths differ) through the reference. Tensors
    the kernels do not take (CPU, fp32, an odd head dim) go through the reference whole.
    """
    seqs_k = seqs_k or seqs_q
    if seqs_q.num_seqs != seqs_k.num_seqs:
        raise ValueError(f"{seqs_q.num_seqs} query sequences but {seqs_k.num_seqs} key sequences")
    drawn = [_fused_op_draws_the_mask(sq, sk, causal) for sq, sk in _pairs(seqs_q, seqs_k)]
    if not any(drawn) or not torch_flash.runs(q_THE, k_TKE):
        return torch_varlen_attention(q_THE, k_TKE, v_TKE, seqs_q, seqs_k, causal, softmax_scale)
    scale = _scale(q_THE, softmax_scale)
    q_THE, k_TKE, v_TKE = _packed(q_THE, k_TKE, v_TKE, seqs_q, seqs_k)
    if all(drawn):
        return _flash_apply(q_THE, k_TKE, v_TKE, seqs_q, seqs_k, causal, scale)
    # a mix: the drawn sequences in one launch, the others through the reference, each on
    # its own gathered rows, placed back (differentiably) at those rows
    out = q_THE.new_zeros(q_THE.shape)
    lse = q_THE.new_zeros((q_THE.shape[1], q_THE.shape[0]), dtype=torch.float32)
    for keep, kernel in ((drawn, _flash_apply), ([not d for d in drawn], torch_varlen_attention)):
        rows_q, sub_q = _subset(seqs_q, keep, q_THE.device)
        rows_k, sub_k = _subset(seqs_k, keep, q_THE.device)
        o, lse_sub = kernel(
            q_THE.index_select(0, rows_q),
            k_TKE.index_select(0, rows_k),
            v_TKE.index_select(0, rows_k),
            sub_q,
            sub_k,
            causal,
            scale,
        )
        out = out.index_copy(0, rows_q, o.to(out.dtype))
        lse = lse.index_copy(1, rows_q, lse_sub)
    return out, lse


def _varlen(
    seqs_q: PackedSeqs, seqs_k: PackedSeqs, causal: bool, scale: float
) -> torch_flash.Varlen:
    cu_q, cu_k = seqs_q.cu_seqlens, seqs_k.cu_seqlens
    return torch_flash.Varlen(cu_q, cu_k, seqs_q.max_seqlen, seqs_k.max_seqlen, causal, scale)


def _flash_apply(q_THE, k_TKE, v_TKE, seqs_q, seqs_k, causal, scale):
    """The kernel with autograd where a gradient is wanted, else the bare call (the ring
    engine's steps run inside its own autograd function: no graph to record per call)."""
    call = _varlen(seqs_q, seqs_k, causal, scale)
    wanted = torch.is_grad_enabled() and any(t.requires_grad for t in (q_THE, k_TKE, v_TKE))
    run = torch_flash.FlashVarlen.apply if wanted else torch_flash.forward
    return run(q_THE, k_TKE, v_TKE, call)


def _pairs(seqs_q: PackedSeqs, seqs_k: PackedSeqs):
    return zip(seqs_q.lengths, seqs_k.lengths, strict=True)


def _packed(q_THE, k_TKE, v_TKE, seqs_q, seqs_k):
    """The rows the sequences cover (the reference's output has as many rows)."""
    tq, tk = seqs_q.total_tokens, seqs_k.total_tokens
    return q_THE[:tq], k_TKE[:tk], v_TKE[:tk]


def _subset(
    seqs: PackedSeqs, keep: list[bool], device: torch.device
) -> tuple[torch.Tensor, PackedSeqs]:
    """The packed rows of the kept sequences (int64, on `device`) and their boundaries."""
    kept = [(o, n) for o, n, k in zip(seqs.offsets, seqs.lengths, keep, strict=True) if k]
    rows = np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in kept])
    seqs = PackedSeqs.from_lengths([n for _, n in kept], device)
    return torch.as_tensor(rows, device=device), seqs


def select_kernel(name: str, device: torch.device, dtype: torch.dtype) -> AttentionFn:
    """The kernel to use for `model.attention_kernel` on this device and dtype.

    `auto` takes torch's built-in flash kernels on a CUDA device and fp16/bf16 compute where
    torch has them for the GPU (`torch_flash`, sm_80+; routed to FA3 on Hopper where
    FlashAttention-3 is installed, `torch_flash.use_fastest_impl`); else flash-attn where it
    is importable on such a device and dtype (an older GPU); else the torch reference.
    `flash` asks for flash-attn (the optional extra `ray-zep[flash]`). The choice is logged.

    Raises:
        ConfigError: unknown name, `flash` where flash-attn cannot run, or `torch_flash`
            where torch's flash kernels cannot.
    """
    if name not in KERNELS:
        raise ConfigError(
            f"config key model.attention_kernel={name!r}: expected auto | torch | flash"
            " | torch_flash"
        )
    flash_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if name == "flash" and not (flash_ok and flash_attn_available()):
        raise ConfigError(
            "config key model.attention_kernel='flash': flash-attn needs a CUDA device, "
            "fp16/bf16 compute and the flash-attn package (pip install 'ray-zep[flash]')"
        )
    torch_flash_ok = flash_ok and torch_flash.available(device)
    if name == "torch_flash" and not torch_flash_ok:
        raise ConfigError(
            "config key model.attention_kernel='torch_flash': torch's flash kernels need a "
            "CUDA device of compute capability 8.0 or newer, a torch built with them and "
            "fp16/bf16 compute"
        )
    chosen = name
    if name == "auto":
        if torch_flash_ok:
            chosen = "torch_flash"
        else:
            chosen = "flash" if flash_ok and flash_attn_available() else "torch"
    impl = f", {torch_flash.use_fastest_impl(device)}" if chosen == "torch_flash" else ""
    log.info("attention kernel: %s (device %s, %s%s)", chosen, device.type, dtype, impl)
    return {
        "flash": flash_varlen_attention,
        "torch_flash": torch_flash_varlen_attention,
        "torch": torch_varlen_attention,
    }[chosen]


def tiled(kernel: AttentionFn) -> bool:
    """Whether a kernel from `select_kernel` works in tiles (flash-attn, torch's flash
    kernels: memory and rate follow the length) rather than materialising each block's
    scores (the torch reference on a GPU)."""
    return kernel in (flash_varlen_attention, torch_flash_varlen_attention)


def _scale(q_THE: torch.Tensor, softmax_scale: float | None) -> float:
    """The softmax scale: the one given, else 1 / sqrt(head dim)."""
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_THE.shape[-1])


def _float32_zeros(*like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradient accumulators of the tensors' shapes, on their device, in float32."""
    return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in like)


def torch_varlen_attention_backward(
    block: BackwardInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one attention block given the *final* output and LSE of its queries
    (`BackwardInputs`), in torch ops.

    Returns:
        dq_THE, dk_TKE, dv_TKE in float32.
    """
    b, causal, scale = block, block.causal, block.scale
    heads, kv_heads = b.q_THE.shape[1], b.k_TKE.shape[1]
    group = heads // kv_heads
    fused = b.q_THE.device.type == "cpu"
    dq, dk, dv = _float32_zeros(b.q_THE, b.k_TKE, b.v_TKE)
    for qo, sq, ko, sk in zip(
        b.seqs_q.offsets, b.seqs_q.lengths, b.seqs_k.offsets, b.seqs_k.lengths, strict=True
    ):
        rows_q, rows_k = slice(qo, qo + sq), slice(ko, ko + sk)
        q_HSE, do_HSE, o_HSE = (
            t[rows_q].transpose(0, 1).float() for t in (b.q_THE, b.dout_THE, b.out_THE)
        )
        k_HSE, v_HSE = (
            t[rows_k].transpose(0, 1).float().repeat_interleave(group, 0)
            for t in (b.k_TKE, b.v_TKE)
        )
        lse = b.lse_HT[:, rows_q]
        # a row that saw no key anywhere (lse = -inf) gets zero gradients: explicit path
        fits = fused and _fused_op_draws_the_mask(sq, sk, causal) and torch.isfinite(lse).all()
        per_block = _cpu_flash_backward if fits else _explicit_backward
        dq_HSE, dk_HSE, dv_HSE = per_block(do_HSE, q_HSE, k_HSE, v_HSE, o_HSE, lse, causal, scale)
        dq[rows_q] = dq_HSE.transpose(0, 1)
        dk[rows_k] += dk_HSE.unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
        dv[rows_k] += dv_HSE.unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
    return dq, dk, dv


def _explicit_backward(do_HSE, q_HSE, k_HSE, v_HSE, o_HSE, lse_HS, causal: bool, scale: float):
    """dq, dk, dv of one block (heads expanded) from its final output and LSE, in torch ops."""
    sq, sk = q_HSE.shape[1], k_HSE.shape[1]
    scores = torch.matmul(q_HSE, k_HSE.transpose(1, 2)) * scale
    keep = torch.isfinite(lse_HS).unsqueeze(-1).expand_as(scores)
    if causal:
        rows = torch.arange(sq, device=scores.device).unsqueeze(1)
        cols = torch.arange(sk, device=scores.device).unsqueeze(0)
        keep = keep & (cols <= rows + (sk - sq))
    safe_lse = torch.where(torch.isfinite(lse_HS), lse_HS, torch.zeros_like(lse_HS))
    probs = torch.where(keep, torch.exp(scores - safe_lse.unsqueeze(-1)), 0.0)
    delta = (do_HSE * o_HSE).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(do_HSE, v_HSE.transpose(1, 2)) - delta)
    dq_HSE = torch.matmul(dscores, k_HSE) * scale
    dk_HSE = torch.matmul(dscores.transpose(1, 2), q_HSE) * scale
    dv_HSE = torch.matmul(probs.transpose(1, 2), do_HSE)
    return dq_HSE, dk_HSE, dv_HSE


def flash_varlen_attention_backward(
    block: BackwardInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn's varlen backward behind the reference's interface (GPU only)."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    q_THE, k_TKE, v_TKE = block.q_THE, block.k_TKE, block.v_TKE
    dq, dk, dv = torch.empty_like(q_THE), torch.empty_like(k_TKE), torch.empty_like(v_TKE)
    _flash_attn_varlen_backward(
        block.dout_THE.to(q_THE.dtype).contiguous(),
        q_THE,
        k_TKE,
        v_TKE,
        block.out_THE.to(q_THE.dtype),
        block.lse_HT.contiguous(),
        dq,
        dk,
        dv,
        block.seqs_q.cu_seqlens,
        block.seqs_k.cu_seqlens,
        block.seqs_q.max_seqlen,
        block.seqs_k.max_seqlen,
        0.0,
        block.scale,
        block.causal,
        -1,
        -1,
        0.0,
        None,
        False,
    )
    return dq.float(), dk.float(), dv.float()


def torch_flash_varlen_attention_backward(
    block: BackwardInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's flash backward behind the reference's interface: the drawn blocks in one
    launch from the *final* output and LSE of their queries, the others through the
    reference's backward (see `torch_flash_varlen_attention`).

    Returns:
        dq_THE, dk_TKE, dv_TKE: as the kernel computed them, in q's dtype, where one launch
        covers every row; else in float32 (the drawn blocks' computed in q's dtype).
    """
    drawn = [
        _fused_op_draws_the_mask(sq, sk, block.causal)
        for sq, sk in _pairs(block.seqs_q, block.seqs_k)
    ]
    if not any(drawn) or not torch_flash.runs(block.q_THE, block.k_TKE):
        return torch_varlen_attention_backward(block)
    tq, tk = block.seqs_q.total_tokens, block.seqs_k.total_tokens
    rows_q = {t.shape[0] for t in (block.dout_THE, block.q_THE, block.out_THE)}
    if all(drawn) and rows_q == {tq} and block.k_TKE.shape[0] == tk:
        return _flash_backward(block)  # in q's dtype: the caller adds them up in fp32
    dq, dk, dv = _float32_zeros(block.q_THE, block.k_TKE, block.v_TKE)
    if all(drawn):
        for full, g in zip((dq, dk, dv), _flash_backward(block.covered()), strict=True):
            full[: g.shape[0]] = g
        return dq, dk, dv
    for keep, backward in (
        (drawn, _flash_backward),
        ([not d for d in drawn], torch_varlen_attention_backward),
    ):
        rows_q, rows_k, sub = block.subset(keep)
        gq, gk, gv = backward(sub)
        dq.index_copy_(0, rows_q, gq.float())
        dk.index_copy_(0, rows_k, gk.float())
        dv.index_copy_(0, rows_k, gv.float())
    return dq, dk, dv


def _flash_backward(block: BackwardInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = (block.dout_THE, block.q_THE, block.k_TKE, block.v_TKE, block.out_THE, block.lse_HT)
    call = _varlen(block.seqs_q, block.seqs_k, block.causal, block.scale)
    return torch_flash.backward(*tensors, call)


def select_backward(forward: AttentionFn) -> BackwardKernel:
    """The backward that pairs with a forward kernel from `select_kernel`."""
    if forward is flash_varlen_attention:
        return flash_varlen_attention_backward
    if forward is torch_flash_varlen_attention:
        return torch_flash_varlen_attention_backward
    return torch_varlen_attention_backward
