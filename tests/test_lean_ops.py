"""RMSNorm and SwiGLU that keep only their inputs (`ray_zep.lean_ops`): the plain
operations' values and gradients, fewer bytes kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_zep.attention.kernels import select_kernel, tiled
from ray_zep.attention.rope import rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.lean_ops import rms_norm, swiglu
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.memory import FP32, _block_halves
from ray_zep.run_memory import memory_inputs
from ray_zep.topology import build_topology

EPS = 1e-5
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)  # fmt: skip


def _plain_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * weight


def _kept_bytes(fn, *inputs) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for `fn(*inputs)`'s backward, counting each storage once,
    the parameters' and inputs' own among them; and the output."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(storages.values()), out


def _leaves(*shapes, dtype=torch.float32, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=generator).to(device, dtype).requires_grad_()
            for s in shapes]  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_plain_norm_and_keeps_its_input_and_inverse_rms(dtype, device) -> None:
    tokens, dim = 48, 64
    x, weight = _leaves((tokens, dim), (dim,), dtype=dtype, device=device)
    weight = (1 + 0.1 * weight.detach().float()).requires_grad_()
    grad = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(3)).to(device)
    kept, out = _kept_bytes(rms_norm, x, weight, EPS)
    kept_plain, want = _kept_bytes(_plain_norm, x, weight)
    assert torch.equal(out, want)
    got = torch.autograd.grad(out, (x, weight), grad)
    expected = torch.autograd.grad(want, (x, weight), grad)
    # fp32: the closed form against autograd's chain, to rounding; bf16 input: its
    # gradient rounds once where the plain chain rounds g w to bf16 first
    tolerance = 1e-6 if dtype is torch.float32 else 2e-2
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()
    x_bytes = tokens * dim * x.element_size()
    assert kept == x_bytes + tokens * FP32 + dim * FP32  # x, the inverse RMS, the weight
    assert kept_plain >= kept + tokens * dim * FP32  # and the normalised input besides


@pytest.mark.unit
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_the_plain_product_bit_for_bit_and_keeps_its_two_inputs(
    dtype, device
) -> None:
    tokens, width = 40, 96
    a, b = _leaves((tokens, width), (tokens, width), dtype=dtype, seed=1, device=device)
    grad = torch.randn(tokens, width, generator=torch.Generator().manual_seed(4))
    grad = grad.to(device, dtype)
    kept, out = _kept_bytes(swiglu, a, b)
    kept_plain, want = _kept_bytes(lambda p, q: F.silu(p) * q, a, b)
    assert torch.equal(out, want)
    for got, expected in zip(torch.autograd.grad(out, (a, b), grad),
                             torch.autograd.grad(want, (a, b), grad), strict=True):  # fmt: skip
        assert torch.equal(got, expected)
    assert kept == 2 * tokens * width * a.element_size()
    assert kept_plain == 3 * tokens * width * a.element_size()


@pytest.mark.unit
def test_without_grad_they_record_nothing_and_compute_the_same() -> None:
    x, weight = _leaves((8, 16), (16,))
    a, b = _leaves((8, 32), (8, 32), seed=2)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, EPS), _plain_norm(x, weight))
        assert torch.equal(swiglu(a, b), F.silu(a) * b)
        assert rms_norm(x, weight, EPS).grad_fn is None


@pytest.mark.unit
def test_a_block_keeps_what_the_memory_model_counts_for_its_norms_and_swiglu() -> None:
    """fp32 on the CPU: a dense block's saved bytes beyond the attention kernel's and the
    projections' own (the same with plain and lean operations) fall by two D-wide fp32
    vectors and one F-wide one per token, as `_block_halves` counts."""
    config = load_config(None, ["model.preset=tiny"])
    shape = build_shape(config.model)
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(0))
    block = model.layers[0]
    lengths = [40, 24, 64]
    tokens = sum(lengths)
    x = torch.randn(tokens, shape.dim, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    rope = rope_tables(torch.cat([torch.arange(n) for n in lengths]), shape.head_dim,
                       shape.rope_theta)  # fmt: skip
    seqs = PackedSeqs.from_lengths(lengths)
    lean, _ = _kept_bytes(block, x, rope, seqs, model.attention_fn)
    inputs = memory_inputs(config, build_topology(config.topology), tokens)
    attention, feed_forward = _block_halves(shape, 0, inputs)
    per_token = attention + feed_forward
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    rope_bytes = sum(t.numel() * t.element_size() for t in rope)
    # what autograd keeps per token, the parameters and rope tables aside, is the model's
    kept_per_token = (lean - params - rope_bytes) / tokens
    assert abs(kept_per_token / per_token - 1) <= 0.05, (kept_per_token, per_token)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_a_7b_block_keeps_per_token_what_the_memory_model_counts() -> None:
    """bf16 autocast and the GPU's attention kernel, as a run on a GPU computes: the bytes
    autograd keeps per token (the slope between two token counts, so that the weights'
    bf16 casts and other fixed costs drop out; the RoPE tables, passed in, aside) are
    `_block_halves`'s at the 7B width, within 5%."""
    cuda = torch.device("cuda")
    config = load_config(None, ["model.preset=7b", "model.n_layers=1"])
    shape = build_shape(config.model)
    kernel = select_kernel(config.model.attention_kernel, cuda, torch.bfloat16)
    block = Transformer(shape, kernel).layers[0].to(cuda)
    kept = {}
    for tokens in (2048, 6144):
        lengths = [tokens // 2, tokens // 4, tokens // 4]
        rope = rope_tables(torch.cat([torch.arange(n) for n in lengths]).to(cuda),
                           shape.head_dim, shape.rope_theta)  # fmt: skip
        x = torch.randn(tokens, shape.dim, device=cuda, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, _ = _kept_bytes(block, x, rope, PackedSeqs.from_lengths(lengths, cuda), kernel)
        kept[tokens] = total - sum(t.numel() * t.element_size() for t in rope)
    (t1, k1), (t2, k2) = kept.items()
    per_token = (k2 - k1) / (t2 - t1)
    inputs = memory_inputs(config, build_topology(config.topology), t2, dtype=torch.bfloat16,
                           flash=tiled(kernel), on_cpu=False)  # fmt: skip
    modelled = sum(_block_halves(shape, 0, inputs))
    assert abs(per_token / modelled - 1) <= 0.05, (
        f"kept {per_token / 1e3:.1f} KB a token, modelled {modelled / 1e3:.1f} KB "
        f"(flash kernel: {tiled(kernel)})"
    )


@pytest.mark.unit
def test_under_autocast_each_norm_output_is_cast_once_for_all_its_projections() -> None:
    """bf16 autocast (on the CPU here, as on a GPU): the block keeps three bf16 copies of
    a D-wide activation per token, the two norms' outputs (each shared by the projections
    reading it: q, k and v; w1 and w3) and the output projection's input, where a cast per
    projection kept six; the block's output is the same either way."""
    config = load_config(None, ["model.preset=tiny"])
    shape = build_shape(config.model)
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(0))
    block = model.layers[0]
    lengths = [40, 56]
    tokens = sum(lengths)
    rope = rope_tables(torch.cat([torch.arange(n) for n in lengths]), shape.head_dim,
                       shape.rope_theta)  # fmt: skip
    seqs = PackedSeqs.from_lengths(lengths)
    x = torch.randn(tokens, shape.dim, generator=torch.Generator().manual_seed(1))
    kept: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x, rope, seqs, model.attention_fn)
        norm = block.attention_norm
        per_projection = F.linear(rms_norm(x, norm.weight, norm.eps), block.attention.wq.weight)
        shared = block.attention.wq(norm(x))
    copies = [k for k in kept.values() if k == (torch.bfloat16, tokens * shape.dim * 2)]
    assert len(copies) == 3, kept
    assert out.dtype == torch.float32 and torch.equal(shared, per_projection)
