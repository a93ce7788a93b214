"""`torch_flash` (torch's built-in flash kernels) against the torch reference.

The GPU tests run the kernel itself; the unit tests stand the kernels' ops in by the
reference on the CPU to check what the choice of blocks does around them (which blocks go
where, gathering, placing back, autograd), which CI can run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ray_zep.attention import torch_flash
from ray_zep.attention.kernels import (
    BackwardInputs,
    flash_attn_available,
    select_backward,
    select_kernel,
    torch_flash_varlen_attention,
    torch_flash_varlen_attention_backward,
    torch_varlen_attention,
    torch_varlen_attention_backward,
)
from ray_zep.attention.ring import merge_
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.errors import ConfigError

HAS_TORCH_FLASH = torch.cuda.is_available() and torch_flash.available(torch.device("cuda"))
if HAS_TORCH_FLASH:  # the kernels under test are those the process routes to (FA2/FA3/FA4)
    torch_flash.use_fastest_impl(torch.device("cuda"))
needs_torch_flash = pytest.mark.skipif(
    not HAS_TORCH_FLASH,
    reason="needs a CUDA GPU of compute capability >= 8.0 and a torch built with its flash "
    "attention kernels (aten._flash_attention_forward)",
)

# the length mixes of tests/test_model.py's CPU kernel tests, and a longer one
LENGTH_MIXES = [[1], [5, 1, 7], [1, 1, 1, 2], [33, 2, 64, 3], [1, 7, 130, 3, 512]]
QUERY_LENGTHS = [5, 1, 7, 96]
RING_BLOCKS = {
    # key lengths per sequence and causality of a block the queries see
    "diagonal": ([5, 1, 7, 96], True),  # square causal: all through the flash kernel
    "earlier": ([3, 2, 9, 64], False),  # non-causal, any shape: all through the flash kernel
    "short causal": ([2, 1, 4, 40], True),  # causal, Sq != Sk but one: mostly the reference
    "mixed causal": ([5, 3, 7, 50], True),  # square and not: a flash launch and the reference
}
HEADS = {"gqa 32/8": (32, 8), "mha 8/8": (8, 8)}
DIM = 128


def _assert_near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Max abs error within `rel` of the reference's largest magnitude (low-precision
    kernels: errors scale with the values, not with each element), or within 1e-4 where
    the reference is exactly zero (dk of a one-token sequence: the kernel leaves ~1e-6 of
    rounding; H200, torch 2.11)."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape, what
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= rel * scale + 1e-4, f"{what}: max abs err {err:.3g}, max |ref| {scale:.3g}"


def _qkv(lengths_q, lengths_k, heads, kv_heads, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, DIM, generator=g, device=device).to(dtype)
    k = torch.randn(sum(lengths_k), kv_heads, DIM, generator=g, device=device).to(dtype)
    v = torch.randn(sum(lengths_k), kv_heads, DIM, generator=g, device=device).to(dtype)
    return q, k, v


@pytest.mark.gpu
@needs_torch_flash
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths", LENGTH_MIXES, ids=str)
def test_torch_flash_matches_reference_forward_and_autograd(lengths, causal, heads) -> None:
    """Whole sequences (every block drawn): out, LSE and the autograd gradients."""
    h, kv = HEADS[heads]
    q, k, v = _qkv(lengths, lengths, h, kv, torch.bfloat16, "cuda", 11)
    seqs = PackedSeqs.from_lengths(lengths, "cuda")
    results = []
    for kernel in (torch_flash_varlen_attention, torch_varlen_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = kernel(*leaves, seqs, causal=causal)
        probe = torch.randn(
            out.shape, generator=torch.Generator("cuda").manual_seed(5), device="cuda"
        )
        (out.float() * probe).sum().backward()
        results.append((out.detach(), lse.detach(), *(t.grad for t in leaves)))
    (out, lse, dq, dk, dv), (ref_out, ref_lse, ref_dq, ref_dk, ref_dv) = results
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert lse.shape == (h, sum(lengths))
    _assert_near(out, ref_out, 1e-2, "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        _assert_near(got, want, 2e-2, name)


@pytest.mark.gpu
@needs_torch_flash
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("blocks", [list(RING_BLOCKS), ["mixed causal"], ["earlier"]], ids=str)
def test_torch_flash_ring_blocks_match_reference(blocks, heads) -> None:
    """Ring blocks, as the engine runs them: each block's out and LSE, then each block's
    dq, dk, dv from the merged (final) out and LSE, against the reference's."""
    h, kv = HEADS[heads]
    g = torch.Generator("cuda").manual_seed(3)
    seqs_q = PackedSeqs.from_lengths(QUERY_LENGTHS, "cuda")
    q = torch.randn(sum(QUERY_LENGTHS), h, DIM, generator=g, device="cuda").bfloat16()
    out = torch.zeros(q.shape, device="cuda")
    lse = torch.full((h, q.shape[0]), float("-inf"), device="cuda")
    everything = torch.arange(q.shape[0], device="cuda")
    kvs = {}
    for name in blocks:
        lengths, causal = RING_BLOCKS[name]
        seqs_k = PackedSeqs.from_lengths(lengths, "cuda")
        kv_ = torch.randn(sum(lengths), 2, kv, DIM, generator=g, device="cuda").bfloat16()
        kvs[name] = kv_
        got = torch_flash_varlen_attention(q, kv_[:, 0], kv_[:, 1], seqs_q, seqs_k, causal)
        want = torch_varlen_attention(q, kv_[:, 0], kv_[:, 1], seqs_q, seqs_k, causal)
        _assert_near(got[0], want[0], 1e-2, f"{name} out")
        finite = torch.isfinite(want[1])
        assert torch.equal(finite, torch.isfinite(got[1])), f"{name}: rows that see no key"
        assert (got[1][~finite] == float("-inf")).all()
        torch.testing.assert_close(got[1][finite], want[1][finite], atol=1e-3, rtol=0)
        merge_(out, lse, everything, want)
    probe = torch.randn(q.shape, generator=g, device="cuda")
    for name in blocks:
        lengths, causal = RING_BLOCKS[name]
        seqs_k = PackedSeqs.from_lengths(lengths, "cuda")
        block = BackwardInputs(
            probe, q, kvs[name][:, 0], kvs[name][:, 1], out, lse, seqs_q, seqs_k, causal
        )
        got = torch_flash_varlen_attention_backward(block)
        want = torch_varlen_attention_backward(block)
        for grad, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert a.dtype in (torch.float32, q.dtype) and a.shape == b.shape
            _assert_near(a, b, 2e-2, f"{name} {grad}")


@pytest.mark.gpu
@needs_torch_flash
def test_torch_flash_fp16_and_rows_past_the_sequences() -> None:
    """fp16, and packed tensors with padding rows after the last sequence: the output has
    the sequences' rows (as the reference's), the backward's gradients the inputs' rows."""
    lengths = [33, 2, 64, 3]
    q, k, v = _qkv([*lengths, 4], [*lengths, 4], 32, 8, torch.float16, "cuda", 7)
    seqs = PackedSeqs.from_lengths(lengths, "cuda")
    out, lse = torch_flash_varlen_attention(q, k, v, seqs)
    ref_out, ref_lse = torch_varlen_attention(q, k, v, seqs)
    assert out.shape == ref_out.shape == (sum(lengths), 32, DIM)
    _assert_near(out, ref_out, 1e-2, "out")
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    dout = torch.randn(q.shape, device="cuda")
    full_out = torch.cat((ref_out.float(), torch.zeros(4, 32, DIM, device="cuda")))
    full_lse = torch.cat((ref_lse, torch.zeros(32, 4, device="cuda")), dim=1)
    block = BackwardInputs(dout, q, k, v, full_out, full_lse, seqs, seqs, True)
    got = torch_flash_varlen_attention_backward(block)
    want = torch_varlen_attention_backward(block)
    for grad, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape
        _assert_near(a, b, 2e-2, grad)


@pytest.mark.gpu
@needs_torch_flash
def test_auto_takes_torch_flash_on_a_gpu_without_flash_attn() -> None:
    cuda = torch.device("cuda")
    kernel = select_kernel("torch_flash", cuda, torch.bfloat16)
    assert kernel is torch_flash_varlen_attention
    assert select_backward(kernel) is torch_flash_varlen_attention_backward
    if not flash_attn_available():
        assert select_kernel("auto", cuda, torch.bfloat16) is torch_flash_varlen_attention
    assert select_kernel("auto", cuda, torch.float32) is torch_varlen_attention


# --- the choice of blocks, on the CPU, the kernels' ops stood in by the reference ---------


@pytest.fixture
def reference_ops(monkeypatch):
    """torch_flash's ops replaced by the reference (fp32, CPU): what is left to test is the
    code around them. Records the sequence lengths each launch took."""
    launches: list[tuple[str, list[int], list[int]]] = []

    def seqs_of(cu):
        lengths = (cu[1:] - cu[:-1]).tolist()
        return PackedSeqs.from_lengths(lengths), lengths

    def forward(q, k, v, call):
        (sq, lq), (sk, lk) = seqs_of(call.cu_q), seqs_of(call.cu_k)
        assert call.max_q == max(lq) and call.max_k == max(lk)
        launches.append(("forward", lq, lk))
        with torch.no_grad():
            return torch_varlen_attention(q, k, v, sq, sk, call.causal, call.scale)

    def backward(dout, q, k, v, out, lse, call):
        (sq, lq), (sk, lk) = seqs_of(call.cu_q), seqs_of(call.cu_k)
        launches.append(("backward", lq, lk))
        block = BackwardInputs(dout, q, k, v, out, lse, sq, sk, call.causal, call.scale)
        return torch_varlen_attention_backward(block)

    monkeypatch.setattr(torch_flash, "runs", lambda q, k: True)
    monkeypatch.setattr(torch_flash, "forward", forward)
    monkeypatch.setattr(torch_flash, "backward", backward)
    return launches


@pytest.mark.unit
@pytest.mark.parametrize("blocks", [list(RING_BLOCKS), ["short causal"]], ids=str)
def test_drawn_blocks_go_to_the_kernel_and_the_rest_to_the_reference(reference_ops, blocks) -> None:
    torch.manual_seed(4)
    seqs_q = PackedSeqs.from_lengths(QUERY_LENGTHS)
    q = torch.randn(sum(QUERY_LENGTHS), 4, 8)
    out, lse = torch.zeros(q.shape), torch.full((4, q.shape[0]), float("-inf"))
    everything = torch.arange(q.shape[0])
    for name in blocks:
        lengths, causal = RING_BLOCKS[name]
        seqs_k = PackedSeqs.from_lengths(lengths)
        kv = torch.randn(sum(lengths), 2, 2, 8)
        reference_ops.clear()
        got = torch_flash_varlen_attention(q, kv[:, 0], kv[:, 1], seqs_q, seqs_k, causal)
        want = torch_varlen_attention(q, kv[:, 0], kv[:, 1], seqs_q, seqs_k, causal)
        pairs = zip(QUERY_LENGTHS, lengths, strict=True)
        drawn = [(a, b) for a, b in pairs if a == b or not causal]
        if drawn:
            lengths_q, lengths_k = ([p[i] for p in drawn] for i in (0, 1))
            assert reference_ops == [("forward", lengths_q, lengths_k)]
        else:
            assert reference_ops == []
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        merge_(out, lse, everything, want)
        probe = torch.randn(q.shape)
        block = BackwardInputs(probe, q, kv[:, 0], kv[:, 1], out, lse, seqs_q, seqs_k, causal)
        got = torch_flash_varlen_attention_backward(block)
        want = torch_varlen_attention_backward(block)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_mixed_block_is_differentiable_through_autograd(reference_ops) -> None:
    torch.manual_seed(5)
    lengths_k, causal = RING_BLOCKS["mixed causal"]
    seqs_q, seqs_k = PackedSeqs.from_lengths(QUERY_LENGTHS), PackedSeqs.from_lengths(lengths_k)
    q = torch.randn(sum(QUERY_LENGTHS), 4, 8)
    k, v = torch.randn(sum(lengths_k), 2, 8), torch.randn(sum(lengths_k), 2, 8)
    probe = torch.randn(q.shape)
    grads = []
    for kernel in (torch_flash_varlen_attention, torch_varlen_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = kernel(*leaves, seqs_q, seqs_k, causal)
        (out * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    assert [kind for kind, *_ in reference_ops] == ["forward", "backward"]
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_auto_prefers_torch_flash_over_flash_attn_on_a_gpu(monkeypatch) -> None:
    """The GPU default is torch's own kernels even where flash-attn is installed: nothing to
    compile; `flash` still asks for flash-attn."""
    import ray_zep.attention.kernels as kernels

    monkeypatch.setattr(torch_flash, "available", lambda device: True)
    monkeypatch.setattr(torch_flash, "use_fastest_impl", lambda device: "FA2 (test)")
    monkeypatch.setattr(kernels, "flash_attn_available", lambda: True)
    cuda = torch.device("cuda")
    assert select_kernel("auto", cuda, torch.bfloat16) is torch_flash_varlen_attention
    assert select_kernel("flash", cuda, torch.bfloat16) is kernels.flash_varlen_attention
    monkeypatch.setattr(torch_flash, "available", lambda device: False)
    assert select_kernel("auto", cuda, torch.bfloat16) is kernels.flash_varlen_attention


@pytest.mark.unit
def test_fa3_and_fa4_are_taken_only_where_torch_can_route_to_them(monkeypatch) -> None:
    """`use_fastest_impl` names FA2 with every reason wherever neither FA3 nor FA4 can run
    (here: the chip is an A100, or their packages are missing) and never raises under
    `auto`."""
    from torch.nn import attention

    fastest = torch_flash.use_fastest_impl.__wrapped__
    monkeypatch.delenv(torch_flash.IMPL_ENV, raising=False)
    monkeypatch.setattr(torch_flash, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    reason = fastest(torch.device("cuda", 0))
    assert reason.startswith("FA2 (")
    listed = getattr(attention, "list_flash_attention_impls", list)()
    if "FA3" in listed and "FA4" in listed:
        assert "FA3 runs on sm_9x; this GPU is sm_80" in reason
        assert "FA4 runs on sm_9x, sm_10x; this GPU is sm_80" in reason
        monkeypatch.setattr(torch_flash, "_capability", lambda index: (9, 0))
        monkeypatch.setattr(attention, "activate_flash_attention_impl", _refuse_activation)
        missing = {
            impl.name: importlib.util.find_spec(impl.module.split(".")[0]) is None
            for impl in torch_flash.SWITCHABLE
        }
        if all(missing.values()):
            activated = fastest(torch.device("cuda", 0))
            assert "FA3 not activated" in activated and "flash_attn_interface" in activated
            assert "FA4 not activated" in activated and "pip install flash-attn-4" in activated


def _refuse_activation(name: str) -> None:  # pragma: no cover - reached only with a package
    raise AssertionError(f"{name} activated although its package is missing")


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, expected",
    [(None, "auto"), ("", "auto"), ("FA4", "fa4"), (" fa2 ", "fa2")],
)
def test_the_flash_implementation_is_read_from_the_environment(
    monkeypatch, value, expected
) -> None:
    if value is None:
        monkeypatch.delenv(torch_flash.IMPL_ENV, raising=False)
    else:
        monkeypatch.setenv(torch_flash.IMPL_ENV, value)
    assert torch_flash.requested_impl() == expected


@pytest.mark.unit
def test_a_forced_fa2_touches_no_gpu_and_a_bad_value_names_the_variable(monkeypatch) -> None:
    fastest = torch_flash.use_fastest_impl.__wrapped__
    monkeypatch.setenv(torch_flash.IMPL_ENV, "fa2")
    assert fastest(torch.device("cpu")) == "FA2 (RAY_ZEP_FLASH_IMPL=fa2)"
    monkeypatch.setenv(torch_flash.IMPL_ENV, "fa5")
    with pytest.raises(ConfigError, match="RAY_ZEP_FLASH_IMPL='fa5': expected auto"):
        fastest(torch.device("cpu"))


@pytest.mark.unit
def test_an_implementation_asked_for_by_name_that_cannot_run_is_an_error(monkeypatch) -> None:
    fastest = torch_flash.use_fastest_impl.__wrapped__
    monkeypatch.setenv(torch_flash.IMPL_ENV, "fa3")
    monkeypatch.setattr(torch_flash, "_capability", lambda index: (8, 6))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError, match="RAY_ZEP_FLASH_IMPL=fa3: "):
        fastest(torch.device("cuda", 0))


@pytest.mark.unit
def test_fa4_glue_is_pointed_at_the_adapter_that_returns_out_and_lse(monkeypatch) -> None:
    """flash-attn-4 4.0.0b36's forward returns five values where torch's FA4 glue unpacks
    two: once FA4 is activated, the glue imports `fa4_adapter`, which returns out and LSE of
    the package's forward and passes the backward through (here with stand-in kernels)."""
    import sys
    import types

    fa4 = pytest.importorskip("torch.nn.attention._fa4", reason="torch without FA4 glue")
    from torch.nn import attention

    kernels = types.ModuleType("flash_attn.cute.interface")
    kernels._flash_attn_fwd = lambda q, k, v, **kw: (q + 1, k.sum(), None, None, None)
    kernels._flash_attn_bwd = lambda *args, **kw: ("dq", "dk", "dv")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", kernels)
    monkeypatch.setattr(attention, "activate_flash_attention_impl", lambda name: None)
    monkeypatch.setattr(attention, "list_flash_attention_impls", lambda: ["FA3", "FA4"])
    monkeypatch.setattr(fa4, "_FA4_MODULE_PATH", None, raising=False)
    monkeypatch.setattr(torch_flash, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv(torch_flash.IMPL_ENV, "fa4")
    assert torch_flash.use_fastest_impl.__wrapped__(torch.device("cuda", 0)) == "FA4"
    assert fa4._FA4_MODULE_PATH == torch_flash.ADAPTER
    module = importlib.import_module(fa4._FA4_MODULE_PATH)
    q, k = torch.zeros(2), torch.ones(3)
    out, lse = module._flash_attn_fwd(q, k, k, causal=True)
    assert torch.equal(out, q + 1) and float(lse) == 3.0
    assert module._flash_attn_bwd(q, k, k, out, q, lse) == ("dq", "dk", "dv")


@pytest.mark.unit
@pytest.mark.parametrize(
    "capability, impl, dim, expected",
    [
        ((9, 0), "FA4", 192, True),
        ((9, 0), "FA4", 256, True),
        ((10, 0), "FA4", 128, True),
        ((10, 0), "FA4", 136, False),
        ((10, 0), "FA2 (test)", 192, True),
        ((10, 0), "FA2 (test)", 256, False),
        ((8, 6), "FA2 (test)", 256, False),
    ],
)
def test_head_dims_go_to_the_flash_kernels_only_where_the_routed_one_takes_them(
    monkeypatch, capability, impl, dim, expected
) -> None:
    """FA2 takes head dims over 192 on A100/H100 only; FA4 on Blackwell takes up to 128
    (the rest go to the reference kernel)."""
    monkeypatch.setattr(torch_flash, "available", lambda device: True)
    monkeypatch.setattr(torch_flash, "_capability", lambda index: capability)
    monkeypatch.setattr(torch_flash, "use_fastest_impl", lambda device: impl)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.zeros(4, 8, dim, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, dim, dtype=torch.bfloat16)
    assert torch_flash.runs(q, k) is expected
