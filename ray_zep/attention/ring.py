"""Pure computation of ring attention steps: block forward/backward and fp32 LSE merge.

A step whose query (key) rows are one run reads them as a view of the position's rows
(`StepMeta.query_rows`): nothing is gathered, and its outputs fold back in place. On a GPU
the merge is one fused kernel (`ray_zep.attention.merge_kernel`); elsewhere it runs in
torch ops.

Shapes: P rows of a position layout, H' heads held after the Ulysses exchange,
K' key/value heads, E head dim. `kv_P2KE` packs K and V of a position.
"""

from __future__ import annotations

import torch

from ray_zep.attention import merge_kernel
from ray_zep.attention.kernels import AttentionFn, BackwardInputs, BackwardKernel
from ray_zep.attention.schedule import StepMeta

Rows = torch.Tensor | slice
"""Rows of a position: int64 indices, or one run (a slice with step 1)."""


def merge_(
    out_PHE: torch.Tensor, lse_HP: torch.Tensor, rows: Rows, block: tuple[torch.Tensor, ...]
) -> None:
    """Fold a block's (out, lse), as a kernel returns them, into the fp32 accumulators at
    `rows`, in place.

    Rows a block leaves fully masked carry lse = -inf and change nothing. On a GPU with
    Triton this is one fused kernel (`merge_kernel.merge_rows_`), else torch ops.
    """
    fused = merge_kernel.unavailable_reason(out_PHE.device) is None and block[0].stride(-1) == 1
    merge = merge_kernel.merge_rows_ if fused else merge_reference_
    merge(out_PHE, lse_HP, rows, *block)


def merge_reference_(
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    rows: Rows,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """`merge_` in torch ops (any device; the reference of the fused kernel)."""
    old_lse = lse_HP[:, rows]
    block_lse = torch.where(block_lse == float("inf"), float("-inf"), block_lse)
    new_lse = torch.logaddexp(old_lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(old_lse - safe), torch.zeros_like(safe))
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(safe))
    merged = out_PHE[rows] * w_old.T.unsqueeze(-1) + block_out.float() * w_new.T.unsqueeze(-1)
    out_PHE[rows] = merged
    lse_HP[:, rows] = new_lse


def _take(t: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    """`t`'s rows along `dim`: a view for a run, a gather for listed rows."""
    if isinstance(rows, slice):
        return t[rows] if dim == 0 else t[:, rows]
    return t.index_select(dim, rows)


def _add_(acc: torch.Tensor, rows: Rows, grad: torch.Tensor) -> None:
    """acc[rows] += grad in acc's dtype: in place on a run; by index otherwise, in one fused
    kernel on a GPU."""
    if isinstance(rows, slice):
        acc[rows] += grad
    elif merge_kernel.unavailable_reason(acc.device) is None and grad.is_contiguous():
        merge_kernel.add_rows_(acc, rows, grad)
    else:
        acc.index_add_(0, rows, grad.to(acc.dtype))


def step_forward(
    q_PHE: torch.Tensor,
    kv_P2KE: torch.Tensor,
    step: StepMeta,
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    kernel: AttentionFn,
) -> None:
    """Attend this position's queries to one source's K and V and merge the result."""
    if step.empty:
        return
    kv = _take(kv_P2KE, step.key_rows)
    query = _take(q_PHE, step.query_rows)
    block = kernel(query, kv[:, 0], kv[:, 1], step.seqs_q, step.seqs_k, causal=step.causal)
    merge_(out_PHE, lse_HP, step.query_rows, block)


def step_backward(
    dout_PHE: torch.Tensor,
    q_PHE: torch.Tensor,
    kv_P2KE: torch.Tensor,
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    step: StepMeta,
    dq_PHE: torch.Tensor,
    dkv_P2KE: torch.Tensor,
    backward: BackwardKernel,
) -> None:
    """Add one step's contributions to dq (this position) and dkv (the source), in place.

    `out_PHE` is the queries' final output in the dtype the kernel takes (the engine casts
    it once per item, not once per step)."""
    if step.empty:
        return
    rows, k_rows = step.query_rows, step.key_rows
    kv = _take(kv_P2KE, k_rows)
    dq, dk, dv = backward(
        BackwardInputs(
            _take(dout_PHE, rows),
            _take(q_PHE, rows),
            kv[:, 0],
            kv[:, 1],
            _take(out_PHE, rows),
            _take(lse_HP, rows, dim=1),
            step.seqs_q,
            step.seqs_k,
            step.causal,
        )
    )
    _add_(dq_PHE, rows, dq)
    _add_(dkv_P2KE[:, 0], k_rows, dk)
    _add_(dkv_P2KE[:, 1], k_rows, dv)
