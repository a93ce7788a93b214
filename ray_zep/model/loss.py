"""Cross-entropy of the output projection, chunk by chunk of tokens.

The eager head materialises logits_TV in the compute dtype, an fp32 copy for the
log-softmax and its fp32 gradient: at 64k tokens and a 32k vocabulary that is
over 16 GiB at the memory peak. `chunked_cross_entropy` never holds more than
one chunk's logits: for each chunk of `chunk_tokens` tokens it computes the
logits, their fp32 log-softmax, the token losses and (when a gradient is
wanted) the gradient of the summed loss with respect to the hidden states and
the weight, in forward. It keeps only dh_TD (the hidden states' dtype) and
dw_VD (the weight's dtype, summed over chunks in fp32) for backward, which
scales them by the incoming gradient; no logits are recomputed.

The numerics follow the eager path `F.cross_entropy(linear(h, w).float(), ...)`:
under autocast the projection runs in the autocast dtype and the log-softmax in
fp32; the logits' gradient goes back to the autocast dtype for the two matmuls.

Shape legend: T tokens, C tokens of one chunk, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch

from ray_zep.constants import IGNORE_INDEX

DEFAULT_CHUNK_TOKENS = 4096
"""Tokens per chunk when the chunked loss is on: 4096 x 32k fp32 logits are 0.5 GiB."""


def chunked_cross_entropy(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
) -> torch.Tensor:
    """Token cross-entropies of `h_TD @ weight_VD.T` against `labels_T`, chunk by chunk.

    Args:
        h_TD: final hidden states (after the last norm).
        weight_VD: the output projection's weight.
        labels_T: int64 next-token ids; `ignore_index` marks tokens without a label.
        chunk_tokens: tokens per chunk (the last chunk may be shorter).
        ignore_index: label of tokens that add nothing to the loss.
        reduction: `sum` (an fp32 scalar, differentiable) or `none` (fp32 losses_T,
            zero at ignored tokens; no gradient).

    Returns:
        The fp32 sum of the token losses, or losses_T.

    Raises:
        ValueError: `chunk_tokens` < 1, an unknown `reduction`, or `none` asked
            for with a gradient.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction={reduction!r}: must be 'sum' or 'none'")
    wants_grad = torch.is_grad_enabled() and (h_TD.requires_grad or weight_VD.requires_grad)
    dtype = _compute_dtype(h_TD)
    if reduction == "none":
        if wants_grad:
            raise ValueError("reduction='none' keeps no gradient: call it under torch.no_grad()")
        return _losses(h_TD, weight_VD, labels_T, chunk_tokens, ignore_index, dtype)
    if not wants_grad:
        return _losses(h_TD, weight_VD, labels_T, chunk_tokens, ignore_index, dtype).sum()
    return _ChunkedCrossEntropy.apply(h_TD, weight_VD, labels_T, chunk_tokens, ignore_index, dtype)


def _compute_dtype(h_TD: torch.Tensor) -> torch.dtype:
    """The projection's dtype: autocast's where it is on, else the hidden states'."""
    device = h_TD.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return h_TD.dtype


def _chunk_logits(h_CD, w_VD, dtype) -> torch.Tensor:
    """fp32 logits_CV of a chunk, the matmul in `dtype` (autocast is off here)."""
    return (h_CD.to(dtype) @ w_VD.T).float()


def _token_losses(logits_CV, labels_C, ignore_index) -> tuple[torch.Tensor, ...]:
    """(losses_C, logsumexp_C, labelled_C, safe labels_C) of one chunk's fp32 logits."""
    labelled_C = labels_C != ignore_index
    safe_C = torch.where(labelled_C, labels_C, 0)
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    target_C = logits_CV.gather(1, safe_C[:, None])[:, 0]
    return (lse_C - target_C) * labelled_C, lse_C, labelled_C, safe_C


def _losses(h_TD, w_VD, labels_T, chunk_tokens, ignore_index, dtype) -> torch.Tensor:
    """fp32 losses_T without a graph."""
    out_T = torch.empty(labels_T.shape, dtype=torch.float32, device=h_TD.device)
    with torch.no_grad(), torch.autocast(h_TD.device.type, enabled=False):
        w_VD = w_VD.to(dtype)
        for start in range(0, h_TD.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits_CV = _chunk_logits(h_TD[start:end], w_VD, dtype)
            out_T[start:end] = _token_losses(logits_CV, labels_T[start:end], ignore_index)[0]
    return out_T


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token losses; its gradients are computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, labels_T, chunk_tokens, ignore_index, dtype):
        want_h, want_w = ctx.needs_input_grad[:2]
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        dh_TD = torch.empty_like(h_TD) if want_h else None
        dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if want_w else None
        with torch.autocast(h_TD.device.type, enabled=False):
            wc_VD = w_VD.to(dtype)
            for start in range(0, h_TD.shape[0], chunk_tokens):
                end = start + chunk_tokens
                hc_CD = h_TD[start:end].to(dtype)
                logits_CV = _chunk_logits(hc_CD, wc_VD, dtype)
                losses_C, lse_C, labelled_C, safe_C = _token_losses(
                    logits_CV, labels_T[start:end], ignore_index
                )
                total += losses_C.sum()
                # d(loss)/d(logits) = softmax - one_hot(label), zero at unlabelled tokens
                grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
                grad_CV.scatter_add_(1, safe_C[:, None], grad_CV.new_full((len(safe_C), 1), -1.0))
                grad_CV.mul_(labelled_C[:, None])
                g_CV = grad_CV.to(dtype)
                del logits_CV, grad_CV
                if want_h:
                    dh_TD[start:end] = g_CV @ wc_VD
                if want_w:
                    _accumulate(dw_VD, g_CV, hc_CD)
        ctx.save_for_backward(dh_TD, None if dw_VD is None else dw_VD.to(w_VD.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dh_TD, dw_VD = ctx.saved_tensors
        dh = None if dh_TD is None else dh_TD * grad_total.to(dh_TD.dtype)
        dw = None if dw_VD is None else dw_VD * grad_total.to(dw_VD.dtype)
        return dh, dw, None, None, None, None


def _accumulate(dw_VD: torch.Tensor, g_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """dw_VD += g_CV.T @ h_CD, summed in fp32 whatever the matmul's dtype."""
    if g_CV.dtype == torch.float32:
        dw_VD.addmm_(g_CV.T, h_CD)
    else:
        dw_VD += (g_CV.T @ h_CD).float()
