"""One fused pass that folds an attention block's output and LSE into the fp32 accumulators.

The merge of a ring step (`ray_zep.attention.ring.merge_`) in torch ops reads and writes the
accumulators in about six element-wise passes (gather the rows, log-add-exp, two weights, two
products and a sum, scatter back). Here one Triton kernel does it in one: each program takes
one query row and a block of its heads, reads the old and the block's LSE, forms both weights
and writes the merged row and LSE in place. The rows are either a contiguous run of the
accumulators (`start`) or listed (`rows`, int64), so a step whose queries are one run reads
nothing it does not write.

Rows where neither side saw a key stay at out = 0, lse = -inf, as in the torch merge; a block
LSE of +inf (flash kernels' mark for a row with no key) counts as -inf.

On a CUDA device the kernel is compiled by Triton; `interpret=True` runs the same kernel
source through Triton's interpreter on CPU tensors, which is how CI checks it.

Shapes: P accumulator rows, n block rows, H heads, E head dim.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def unavailable_reason(device: torch.device, interpret: bool = False) -> str | None:
    """None when the fused merge can run for tensors on `device`, else why not."""
    if triton is None:
        return "Triton is not installed (it comes with torch's CUDA builds)"
    if interpret:
        return None if device.type == "cpu" else "Triton's interpreter runs on CPU tensors"
    if device.type != "cuda":
        return f"the fused merge runs on CUDA tensors, not {device.type}"
    return None


if triton is not None:

    def _merge_rows(
        out_ptr,
        lse_ptr,
        block_ptr,
        block_lse_ptr,
        rows_ptr,
        start,
        heads,
        dim,
        out_row,
        out_head,
        lse_head,
        lse_row,
        block_row,
        block_head,
        block_lse_head,
        block_lse_row,
        INDEXED: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        e = tl.arange(0, BLOCK_E)
        in_h = h < heads
        if INDEXED:
            row = tl.load(rows_ptr + i)
        else:
            row = start + i
        old = tl.load(lse_ptr + h * lse_head + row * lse_row, mask=in_h, other=float("-inf"))
        new = tl.load(
            block_lse_ptr + h * block_lse_head + i * block_lse_row,
            mask=in_h,
            other=float("-inf"),
        )
        new = tl.where(new == float("inf"), float("-inf"), new)
        top = tl.maximum(old, new)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(old - top)
        w_new = tl.exp(new - top)
        total = w_old + w_new
        seen = total > 0
        merged = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        w_old = tl.where(seen, w_old / tl.where(seen, total, 1.0), 0.0)
        w_new = tl.where(seen, w_new / tl.where(seen, total, 1.0), 0.0)
        tile = in_h[:, None] & (e[None, :] < dim)
        at_out = out_ptr + row * out_row + h[:, None] * out_head + e[None, :]
        at_block = block_ptr + i * block_row + h[:, None] * block_head + e[None, :]
        acc = tl.load(at_out, mask=tile, other=0.0)
        part = tl.load(at_block, mask=tile, other=0.0).to(tl.float32)
        tl.store(at_out, acc * w_old[:, None] + part * w_new[:, None], mask=tile)
        tl.store(lse_ptr + h * lse_head + row * lse_row, merged, mask=in_h)

    def _add_rows(acc_ptr, src_ptr, rows_ptr, width, acc_row, src_row, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < width
        row = tl.load(rows_ptr + i)
        grad = tl.load(src_ptr + i * src_row + at, mask=inside, other=0.0).to(tl.float32)
        acc = tl.load(acc_ptr + row * acc_row + at, mask=inside, other=0.0)
        tl.store(acc_ptr + row * acc_row + at, acc + grad, mask=inside)

    @functools.cache
    def _kernel(fn, interpret: bool):
        """`fn` compiled by Triton, or run through its interpreter (CPU tensors)."""
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            return InterpretedFunction(fn)
        return triton.jit(fn)


def merge_rows_(
    out_PHE: torch.Tensor,
    lse_HP: torch.Tensor,
    rows: torch.Tensor | slice,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    interpret: bool = False,
) -> None:
    """Fold a block's (out, lse) into the accumulators at `rows`, in place, in one launch.

    Args:
        out_PHE: float32 accumulators; the last dim must be contiguous.
        lse_HP: float32 LSE accumulators (any strides).
        rows: the accumulator rows of the block's rows: a slice with step 1, or int64 rows.
        block_out: (n, H, E) in any float dtype, last dim contiguous.
        block_lse: (H, n) float32.
        interpret: run through Triton's interpreter (CPU tensors).

    Raises:
        RuntimeError: the fused merge cannot run here (`unavailable_reason`).
    """
    reason = unavailable_reason(out_PHE.device, interpret)
    if reason is not None:
        raise RuntimeError(reason)
    n, heads, dim = block_out.shape
    if n == 0:
        return
    if out_PHE.dtype != torch.float32 or lse_HP.dtype != torch.float32:
        raise TypeError("the accumulators of the fused merge are float32")
    if out_PHE.stride(-1) != 1 or block_out.stride(-1) != 1:
        raise ValueError("the fused merge needs the head dim of both outputs contiguous")
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise ValueError("the fused merge takes a contiguous run of rows (step 1)")
        start, indexed, listed = rows.start or 0, False, block_lse  # listed: unread
    else:
        start, indexed, listed = 0, True, rows
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(dim)))
    grid = (n, triton.cdiv(heads, block_h))
    _kernel(_merge_rows, interpret)[grid](
        out_PHE,
        lse_HP,
        block_out,
        block_lse,
        listed,
        start,
        heads,
        dim,
        out_PHE.stride(0),
        out_PHE.stride(1),
        lse_HP.stride(0),
        lse_HP.stride(1),
        block_out.stride(0),
        block_out.stride(1),
        block_lse.stride(0),
        block_lse.stride(1),
        INDEXED=indexed,
        BLOCK_H=block_h,
        BLOCK_E=triton.next_power_of_2(dim),
    )


def add_rows_(
    acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, interpret: bool = False
) -> None:
    """acc[rows[i]] += grad[i] in one launch, grad cast to acc's float32 on the way (the
    torch way takes a cast and an index_add_). Rows must be distinct, as a step's are.

    Args:
        acc: float32 (P, ...) whose every row is contiguous (a view such as dkv[:, 0] is).
        rows: int64 (n,) distinct rows of acc.
        grad: (n, ...) contiguous, the shape of acc's rows.
    """
    reason = unavailable_reason(acc.device, interpret)
    if reason is not None:
        raise RuntimeError(reason)
    n = grad.shape[0]
    width = grad[0].numel() if n else 0
    if n == 0 or width == 0:
        return
    if acc.dtype != torch.float32 or not acc[0].is_contiguous() or not grad.is_contiguous():
        raise ValueError("add_rows_ takes float32 accumulators with contiguous rows")
    block = min(4096, triton.next_power_of_2(width))
    grid = (n, triton.cdiv(width, block))
    _kernel(_add_rows, interpret)[grid](acc, grad, rows, width, acc.stride(0), width, BLOCK=block)
