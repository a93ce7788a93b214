"""The fused merge of a ring step (`ray_zep.attention.merge_kernel`) against the torch merge,
and ring steps whose rows are one run (views, nothing gathered) against listed rows.

The kernel's source runs through Triton's interpreter on CPU (CI); the GPU test compiles it.
"""

from __future__ import annotations

import pytest
import torch

from ray_zep.attention import merge_kernel, ring
from ray_zep.attention.kernels import torch_varlen_attention, torch_varlen_attention_backward
from ray_zep.attention.schedule import StepMeta

CPU = torch.device("cpu")
INTERPRETER = merge_kernel.unavailable_reason(CPU, interpret=True)
needs_interpreter = pytest.mark.skipif(INTERPRETER is not None, reason=str(INTERPRETER))
needs_gpu = pytest.mark.skipif(
    merge_kernel.unavailable_reason(torch.device("cuda")) is not None
    or not torch.cuda.is_available(),
    reason="the compiled fused merge needs a CUDA GPU and Triton",
)


def _accumulators(rows: int, heads: int, dim: int, device, seed: int):
    """Accumulators half merged already (finite), half untouched (out 0, lse -inf)."""
    g = torch.Generator(device).manual_seed(seed)
    out = torch.randn(rows, heads, dim, generator=g, device=device)
    lse = torch.randn(heads, rows, generator=g, device=device)
    out[rows // 2 :] = 0.0
    lse[:, rows // 2 :] = float("-inf")
    return out, lse


def _block(n: int, heads: int, dim: int, device, dtype, seed: int):
    """A block's output and LSE with rows that saw no key (-inf, and flash's +inf mark)."""
    g = torch.Generator(device).manual_seed(seed)
    block_out = torch.randn(n, heads, dim, generator=g, device=device).to(dtype)
    block_lse = torch.randn(heads, n, generator=g, device=device)
    block_lse[:, ::5] = float("-inf")
    block_lse[0, 1::7] = float("inf")
    block_out[block_lse.T.isinf()] = 0.0
    return block_out, block_lse


CASES = {
    "listed rows": lambda rows: torch.randperm(rows, generator=torch.Generator().manual_seed(2))[
        : rows - 3
    ],
    "a run": lambda rows: slice(2, rows - 1),
    "every row": lambda rows: slice(0, rows),
}


@pytest.mark.unit
@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [4, 6], ids=["h4", "h6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_merge_equals_the_torch_merge(case, heads, dtype) -> None:
    rows, dim = 24, 12  # a head dim that is not a power of two: masked lanes
    chosen = CASES[case](rows)
    n = len(range(rows)[chosen]) if isinstance(chosen, slice) else chosen.numel()
    block_out, block_lse = _block(n, heads, dim, CPU, dtype, seed=3)
    results = []
    for merge in (ring.merge_reference_, _interpreted):
        out, lse = _accumulators(rows, heads, dim, CPU, seed=1)
        lse_view = lse.T.contiguous().T  # the LSE accumulators with other strides
        merge(out, lse_view, chosen, block_out, block_lse)
        results.append((out, lse_view))
    (want_out, want_lse), (got_out, got_lse) = results
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    untouched = torch.isinf(want_lse)
    assert (got_lse[untouched] == float("-inf")).all()


def _interpreted(out, lse, rows, block_out, block_lse) -> None:
    merge_kernel.merge_rows_(out, lse, rows, block_out, block_lse, interpret=True)


@pytest.mark.unit
def test_fused_merge_refuses_what_it_cannot_take() -> None:
    out, lse = _accumulators(8, 2, 4, CPU, seed=0)
    block_out, block_lse = _block(4, 2, 4, CPU, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        merge_kernel.merge_rows_(out, lse, slice(0, 4), block_out, block_lse)
    if INTERPRETER is None:
        with pytest.raises(ValueError, match="contiguous run"):
            merge_kernel.merge_rows_(out, lse, slice(0, 8, 2), block_out, block_lse, True)
        with pytest.raises(TypeError, match="float32"):
            merge_kernel.merge_rows_(out.half(), lse, slice(0, 4), block_out, block_lse, True)


def _step(q_runs, k_runs, causal, device=CPU, listed: bool = False) -> StepMeta:
    segments = [(a, n, b, m) for (a, n), (b, m) in zip(q_runs, k_runs, strict=True)]
    step = StepMeta.of_segments(0, segments, causal, device)
    if listed:  # the same step, its rows gathered
        step = StepMeta(**{**step.__dict__, "q_span": None, "k_span": None})
    return step


@pytest.mark.unit
def test_runs_are_found_and_only_runs() -> None:
    step = _step([(3, 4), (7, 5)], [(0, 2), (2, 6)], causal=False)
    assert step.query_rows == slice(3, 12) and step.key_rows == slice(0, 8)
    gap = _step([(3, 4), (8, 5)], [(0, 2), (2, 6)], causal=False)
    assert gap.q_span is None and torch.equal(gap.query_rows, gap.q_rows)
    assert gap.key_rows == slice(0, 8)


@pytest.mark.unit
@pytest.mark.parametrize(
    "q_runs,k_runs,causal",
    [
        ([(0, 9)], [(0, 9)], True),  # a ring's first step: the whole position, causal
        ([(5, 9)], [(0, 4)], False),  # a later chunk against an earlier one
        ([(2, 3), (5, 4)], [(1, 2), (3, 6)], False),  # two sequences, both sides one run
    ],
    ids=["diagonal", "late-early", "two seqs"],
)
def test_a_step_on_one_run_equals_the_gathered_step(q_runs, k_runs, causal) -> None:
    """Forward (merged out and LSE) and backward (dq, dK/dV accumulated) of a step read
    through views equal the same step with its rows gathered and scattered by index."""
    g = torch.Generator().manual_seed(9)
    rows = 14
    q = torch.randn(rows, 4, 8, generator=g)
    kv = torch.randn(rows, 2, 2, 8, generator=g)
    dout = torch.randn(rows, 4, 8, generator=g)
    results = []
    for listed in (False, True):
        step = _step(q_runs, k_runs, causal, listed=listed)
        out, lse = _accumulators(rows, 4, 8, CPU, seed=5)
        ring.step_forward(q, kv, step, out, lse, torch_varlen_attention)
        dq = torch.zeros(rows, 4, 8)
        dkv = torch.zeros(rows, 2, 2, 8)
        ring.step_backward(dout, q, kv, out, lse, step, dq, dkv, torch_varlen_attention_backward)
        results.append((out, lse, dq, dkv))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_merge_equals_the_torch_merge(case) -> None:
    cuda = torch.device("cuda")
    rows, heads, dim = 4096, 32, 128
    chosen = CASES[case](rows)
    if not isinstance(chosen, slice):
        chosen = chosen.to(cuda)
    n = len(range(rows)[chosen]) if isinstance(chosen, slice) else chosen.numel()
    block_out, block_lse = _block(n, heads, dim, cuda, torch.bfloat16, seed=3)
    results = []
    for fused in (False, True):
        out, lse = _accumulators(rows, heads, dim, cuda, seed=1)
        merge = merge_kernel.merge_rows_ if fused else ring.merge_reference_
        merge(out, lse, chosen, block_out, block_lse)
        results.append((out, lse))
    (want_out, want_lse), (got_out, got_lse) = results
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_row_add_equals_index_add(dtype) -> None:
    """dK into the K half of a packed dK/dV accumulator (rows of a strided view), by index."""
    g = torch.Generator().manual_seed(6)
    dkv = torch.randn(20, 2, 3, 5, generator=g)
    rows = torch.randperm(20, generator=g)[:11]
    grad = torch.randn(11, 3, 5, generator=g).to(dtype)
    want = dkv.clone()
    want[:, 0].index_add_(0, rows, grad.float())
    merge_kernel.add_rows_(dkv[:, 0], rows, grad, interpret=True)
    torch.testing.assert_close(dkv, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
def test_compiled_row_add_equals_index_add() -> None:
    cuda = torch.device("cuda")
    g = torch.Generator(cuda).manual_seed(6)
    dkv = torch.randn(5000, 2, 8, 128, generator=g, device=cuda)
    rows = torch.randperm(5000, generator=g, device=cuda)[:3001]
    grad = torch.randn(3001, 8, 128, generator=g, device=cuda).bfloat16()
    want = dkv.clone()
    want[:, 0].index_add_(0, rows, grad.float())
    merge_kernel.add_rows_(dkv[:, 0], rows, grad)
    torch.testing.assert_close(dkv, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "later"])
def test_gpu_ring_step_on_a_run_equals_the_gathered_step(causal) -> None:
    """On the GPU's kernels (torch's flash in bf16, the fused merge and row add): a step
    read through views (K and V strided inside the packed K/V) equals the gathered step."""
    from ray_zep.attention.kernels import select_backward, select_kernel

    cuda = torch.device("cuda")
    kernel = select_kernel("auto", cuda, torch.bfloat16)
    backward = select_backward(kernel)
    g = torch.Generator(cuda).manual_seed(9)
    rows = 3000
    q = torch.randn(rows, 32, 128, generator=g, device=cuda).bfloat16()
    kv = torch.randn(rows, 2, 8, 128, generator=g, device=cuda).bfloat16()
    dout = torch.randn(rows, 32, 128, generator=g, device=cuda).bfloat16()
    q_runs = [(0, 1000), (1000, 2000)] if causal else [(500, 1000), (1500, 1500)]
    k_runs = [(0, 1000), (1000, 2000)] if causal else [(0, 700), (700, 900)]
    results = []
    for listed in (False, True):
        step = _step(q_runs, k_runs, causal, cuda, listed)
        out, lse = _accumulators(rows, 32, 128, cuda, seed=5)
        ring.step_forward(q, kv, step, out, lse, kernel)
        dq = torch.zeros(rows, 32, 128, device=cuda)
        dkv = torch.zeros(rows, 2, 8, 128, device=cuda)
        ring.step_backward(dout, q, kv, out.bfloat16(), lse, step, dq, dkv, backward)
        results.append((out, lse, dq, dkv))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
