"""Varlen attention kernels and the LLaMA-style decoder over packed sequences."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from ray_zep.attention.kernels import (
    flash_attn_available,
    flash_varlen_attention,
    select_kernel,
    torch_varlen_attention,
)
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import ModelConfig
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.model.llama import Transformer
from ray_zep.model.shapes import PRESETS, build_shape

pytestmark = pytest.mark.unit

# fp32 on CPU; the kernel and the reference reduce in different orders.
ATOL = 1e-5


def _dense_reference(q, k, v, lengths):
    """Per-sequence SDPA with KV heads expanded: the textbook definition."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[start : start + n].transpose(0, 1)
        ks = k[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [[1], [5, 1, 7], [1, 1, 1, 2], [33, 2, 64, 3]])
def test_torch_kernel_matches_dense_attention_forward_and_backward(lengths: list[int]) -> None:
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 8, requires_grad=True)
    k = torch.randn(total, 2, 8, requires_grad=True)
    v = torch.randn(total, 2, 8, requires_grad=True)
    out, lse = torch_varlen_attention(q, k, v, PackedSeqs.from_lengths(lengths))
    ref = _dense_reference(q, k, v, lengths)
    assert lse.shape == (4, total) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_lse_is_the_log_normaliser() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    _, lse = torch_varlen_attention(q, k, v, PackedSeqs.from_lengths([6]))
    scores = torch.einsum("qhe,khe->hqk", q, k) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=ATOL, rtol=0)


def test_bottom_right_causal_and_fully_masked_rows() -> None:
    torch.manual_seed(2)
    q = torch.randn(4, 2, 8, requires_grad=True)
    k = torch.randn(2, 2, 8, requires_grad=True)
    v = torch.randn(2, 2, 8, requires_grad=True)
    out, lse = torch_varlen_attention(
        q, k, v, PackedSeqs.from_lengths([4]), PackedSeqs.from_lengths([2])
    )
    # query i sees key j iff j <= i + (2 - 4): rows 0 and 1 see nothing
    assert torch.isinf(lse[:, :2]).all() and (lse[:, :2] < 0).all()
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isfinite(lse[:, 2:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_zero_length_segments_are_refused() -> None:
    with pytest.raises(PlacementError, match="lengths must be >= 1"):
        PackedSeqs.from_lengths([3, 0, 2])


def _tiny_model(seed: int = 0) -> Transformer:
    shape = build_shape(ModelConfig(preset="tiny", n_layers=2))
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def _packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, PackedSeqs]:
    seqs = PackedSeqs.from_lengths([len(d) for d in docs])
    return torch.cat(docs), torch.from_numpy(seqs.positions()), seqs


def test_documents_do_not_see_each_other() -> None:
    model = _tiny_model()
    torch.manual_seed(3)
    a, b = torch.randint(0, 256, (9,)), torch.randint(0, 256, (7,))
    logits = model(*_packed([a, b]))
    changed = model(*_packed([a, torch.randint(0, 256, (7,))]))
    assert torch.equal(logits[:9], changed[:9])
    assert not torch.allclose(logits[9:], changed[9:])


def test_positions_restart_at_every_document() -> None:
    model = _tiny_model()
    torch.manual_seed(4)
    a, b = torch.randint(0, 256, (5,)), torch.randint(0, 256, (11,))
    packed = model(*_packed([a, b]))
    alone = model(*_packed([b]))
    torch.testing.assert_close(packed[5:], alone, atol=ATOL, rtol=0)


def test_layers_are_initialised_differently_and_reproducibly() -> None:
    first, again = _tiny_model(seed=5), _tiny_model(seed=5)
    for (name, p), q in zip(first.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    w0 = first.layers[0].attention.wq.weight
    w1 = first.layers[1].attention.wq.weight
    assert not torch.equal(w0, w1)


@pytest.mark.parametrize(
    ("preset", "billions"), [("3b", 3.4), ("7b", 6.7), ("13b", 13.0), ("30b", 32.5)]
)
def test_paper_presets_have_their_sizes_without_weights(preset: str, billions: float) -> None:
    assert PRESETS[preset].param_count() / 1e9 == pytest.approx(billions, rel=0.02)
    assert PRESETS[preset].n_kv_heads == PRESETS[preset].n_heads  # the paper uses MHA


def test_model_config_errors() -> None:
    with pytest.raises(ConfigError, match=re.escape("model.preset='70b'")):
        build_shape(ModelConfig(preset="70b"))
    with pytest.raises(
        ConfigError, match=re.escape("model.dim=100: must be divisible by model.n_heads=3")
    ):
        build_shape(ModelConfig(dim=100, n_heads=3))
    with pytest.raises(
        ConfigError, match=re.escape("model.n_kv_heads=3: must divide model.n_heads=4")
    ):
        build_shape(ModelConfig(n_kv_heads=3))


def test_kernel_selection_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert select_kernel("auto", cpu, torch.float32) is torch_varlen_attention
    assert select_kernel("torch", cpu, torch.float32) is torch_varlen_attention
    with pytest.raises(ConfigError, match="flash-attn needs a CUDA device"):
        select_kernel("flash", cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match=re.escape("expected auto | torch | flash")):
        select_kernel("xformers", cpu, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not flash_attn_available(), reason="needs flash-attn (pip install '.[gpu]')")
def test_flash_kernel_matches_torch_reference_on_gpu() -> None:
    torch.manual_seed(6)
    lengths = [1, 7, 130, 3, 512]
    total = sum(lengths)
    shape = (total, 8, 64)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16)
    seqs = PackedSeqs.from_lengths(lengths, "cuda")
    out, lse = flash_varlen_attention(q, k, v, seqs)
    ref_out, ref_lse = torch_varlen_attention(q, k, v, seqs)
    # bf16 output: one rounding of values of magnitude ~1
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
