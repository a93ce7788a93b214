"""Pure computation of ring attention steps: block forward/backward and fp32 LSE merge.

Shapes: P rows of a position layout, H' heads held after the Ulysses exchange,
K' key/value heads, E head dim. `kv_P2KE` packs K and V of a position.
"""

from __future__ import annotations

import torch

from ray_zep.attention.kernels import AttentionFn, BackwardInputs, BackwardKernel
from ray_zep.attention.schedule import StepMeta


def merge_(
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    rows: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Fold a block's (out, lse) into the fp32 accumulators at `rows`, in place.

    Rows a block leaves fully masked carry lse = -inf and change nothing.
    """
    old_lse = lse_HP[:, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(old_lse - safe), torch.zeros_like(safe))
    w_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(safe))
    merged = out_PHE[rows] * w_old.T.unsqueeze(-1) + block_out.float() * w_new.T.unsqueeze(-1)
    out_PHE[rows] = merged
    lse_HP[:, rows] = new_lse


def step_forward(
    q_PHE: torch.Tensor,
    kv_P2KE: torch.Tensor,
    step: StepMeta,
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    kernel: AttentionFn,
) -> None:
    """Attend this position's queries to one source's K and V and merge the result."""
    if step.q_rows.numel() == 0:
        return
    kv = kv_P2KE[step.k_rows]
    block_out, block_lse = kernel(
        q_PHE[step.q_rows], kv[:, 0], kv[:, 1], step.seqs_q, step.seqs_k, causal=step.causal
    )
    merge_(out_PHE, lse_HP, step.q_rows, block_out, block_lse)


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
    """Add one step's contributions to dq (this position) and dkv (the source), in place."""
    if step.q_rows.numel() == 0:
        return
    rows, k_rows = step.q_rows, step.k_rows
    kv = kv_P2KE[k_rows]
    dq, dk, dv = backward(
        BackwardInputs(
            dout_PHE[rows],
            q_PHE[rows],
            kv[:, 0],
            kv[:, 1],
            out_PHE[rows],
            lse_HP[:, rows],
            step.seqs_q,
            step.seqs_k,
            step.causal,
        )
    )
    dq_PHE.index_add_(0, rows, dq)
    dkv_P2KE.index_add_(0, k_rows, torch.stack((dk, dv), dim=1))
