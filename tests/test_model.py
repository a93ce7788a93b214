"""Varlen attention kernels and the LLaMA-style decoder over packed sequences."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from ray_zep.attention.kernels import (
    BackwardInputs,
    flash_attn_available,
    flash_varlen_attention,
    select_kernel,
    torch_varlen_attention,
    torch_varlen_attention_backward,
)
from ray_zep.attention.ring import merge_
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import ModelConfig
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import PRESETS, build_shape

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


QUERY_LENGTHS = [5, 1, 7, 96]
RING_BLOCKS = {
    # key lengths per sequence and causality of one block a query sees
    "diagonal": ([5, 1, 7, 96], True),  # square causal: the fused CPU op
    "earlier": ([3, 2, 9, 64], False),  # fully visible, any shape: the fused CPU op
    "short causal": ([2, 1, 4, 40], True),  # bottom-right causal, Sq != Sk: explicit mask
}


@pytest.mark.parametrize(
    "blocks", [["diagonal", "earlier", "short causal"], ["short causal"], ["earlier"]]
)
def test_ring_block_backward_equals_autograd_of_the_whole_attention(blocks: list[str]) -> None:
    """Blocks merged as a ring merges them; each block's backward from the merged out and
    LSE; summed, they are the gradients of one attention over every block's keys. With the
    short causal block alone, early rows see no key at all and get exactly zero."""
    torch.manual_seed(3)
    heads, kv_heads, dim = 4, 2, 8
    seqs_q = PackedSeqs.from_lengths(QUERY_LENGTHS)
    q = torch.randn(sum(QUERY_LENGTHS), heads, dim, requires_grad=True)
    kvs = {name: torch.randn(sum(RING_BLOCKS[name][0]), 2, kv_heads, dim) for name in blocks}
    kvs = {name: kv.requires_grad_() for name, kv in kvs.items()}
    out = torch.zeros(q.shape)
    lse = torch.full((heads, q.shape[0]), float("-inf"))
    everything = torch.arange(q.shape[0])
    with torch.no_grad():
        for name in blocks:
            lengths, causal = RING_BLOCKS[name]
            seqs_k, kv = PackedSeqs.from_lengths(lengths), kvs[name]
            block = torch_varlen_attention(q, kv[:, 0], kv[:, 1], seqs_q, seqs_k, causal=causal)
            merge_(out, lse, everything, block)
    probe = torch.randn(q.shape)
    dq = torch.zeros(q.shape)
    dkvs = {}
    for name in blocks:
        lengths, causal = RING_BLOCKS[name]
        kv = kvs[name].detach()
        grads = torch_varlen_attention_backward(
            BackwardInputs(
                probe,
                q.detach(),
                kv[:, 0],
                kv[:, 1],
                out,
                lse,
                seqs_q,
                PackedSeqs.from_lengths(lengths),
                causal,
            )
        )
        dq += grads[0]
        dkvs[name] = torch.stack(grads[1:], dim=1)

    ref = _dense_over_blocks(q, [(kvs[n], *RING_BLOCKS[n]) for n in blocks])
    torch.testing.assert_close(out, ref.detach(), atol=ATOL, rtol=0)
    want = torch.autograd.grad((ref * probe).sum(), (q, *kvs.values()))
    for got, expected in zip((dq, *dkvs.values()), want, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    if blocks == ["short causal"]:
        assert torch.equal(dq[:3], torch.zeros_like(dq[:3])), "rows that saw no key"


def _dense_over_blocks(q, blocks):
    """Each sequence's queries against the keys of every block, each block's mask as the
    kernels draw it (causal: bottom-right aligned), in one masked softmax."""
    group = q.shape[1] // blocks[0][0].shape[2]
    outs, starts = [], [0] * len(blocks)
    for i, sq in enumerate(QUERY_LENGTHS):
        keys, values, masks = [], [], []
        for b, (kv, lengths, causal) in enumerate(blocks):
            sk = lengths[i]
            seg = kv[starts[b] : starts[b] + sk].permute(1, 2, 0, 3)  # 2 K S E
            keys.append(seg[0].repeat_interleave(group, 0))
            values.append(seg[1].repeat_interleave(group, 0))
            rows, cols = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
            masks.append(cols <= rows + (sk - sq) if causal else torch.ones(sq, sk, dtype=bool))
            starts[b] += sk
        start = sum(QUERY_LENGTHS[:i])
        q_HSE = q[start : start + sq].transpose(0, 1)
        scores = q_HSE @ torch.cat(keys, 1).transpose(1, 2) / math.sqrt(q.shape[-1])
        visible = torch.cat(masks, 1)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        probs = torch.nan_to_num(probs) * visible  # rows that see nothing: zero
        outs.append((probs @ torch.cat(values, 1)).transpose(0, 1))
    return torch.cat(outs)


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
    with pytest.raises(ConfigError, match="torch's flash kernels need a CUDA device"):
        select_kernel("torch_flash", cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match=re.escape("expected auto | torch | flash")):
        select_kernel("xformers", cpu, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not flash_attn_available(), reason="needs flash-attn (pip install '.[flash]')")
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


def _optimizer_of(device: str) -> torch.optim.AdamW:
    from ray_zep.config import TrainConfig
    from ray_zep.train.optim import build_optimizer

    return build_optimizer(torch.nn.Linear(8, 4).to(device), TrainConfig())


def test_the_update_runs_fused_on_gpu_parameters_only() -> None:
    from ray_zep.train.optim import fused_update

    assert not _optimizer_of("cpu").defaults["fused"], "CPU keeps the multi-tensor update"
    assert not fused_update([])
    if torch.cuda.is_available():
        assert _optimizer_of("cuda").defaults["fused"]
