"""Regional compilation (`model.compile`): a block whose q/k/v and feed-forward regions
run through torch.compile (inductor) equals the eager block, forward and every gradient,
for two token counts compiled once."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from ray_zep.attention.kernels import torch_varlen_attention
from ray_zep.attention.rope import rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.model.llama import Block
from ray_zep.model_shapes import ModelShape
from ray_zep.moe.layer import MoE
from ray_zep.train.build import build_model

pytestmark = pytest.mark.unit

# fp32 on CPU: inductor fuses the norms' reductions and RoPE into loops of its own,
# which sum in another order than eager's kernels; measured differences are below
# 3e-6 of the largest value, 1e-5 leaves room for other compilers' vectorisation.
REL = 1e-5
SHAPE = ModelShape(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)


def _compiler() -> str | None:
    return next(
        (shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++") if c), None
    )


def _run(block: Block, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """The block's output and the gradients of its input and parameters."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    positions_T = torch.cat([torch.arange(n) for n in lengths])
    rope = rope_tables(positions_T, SHAPE.head_dim, SHAPE.rope_theta)
    seqs = PackedSeqs.from_lengths(lengths, torch.device("cpu"))
    x_TD = torch.randn(tokens, SHAPE.dim, generator=gen).requires_grad_(True)
    out_TD = block(x_TD, rope, seqs, torch_varlen_attention)
    out_TD.backward(torch.randn(out_TD.shape, generator=gen))
    grads = [p.grad for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return [out_TD.detach(), x_TD.grad, *grads]


@pytest.mark.skipif(_compiler() is None, reason="torch.compile (inductor) needs a C++ compiler")
def test_a_compiled_block_equals_the_eager_block_and_compiles_once() -> None:
    torch._dynamo.reset()
    eager = Block(SHAPE)
    torch.nn.init.normal_(eager.ffn_norm.weight, 1.0, 0.2)  # norms that do scale
    compiled, other = copy.deepcopy(eager), copy.deepcopy(eager)
    compiled.compile_regions()
    other.compile_regions()
    assert set(compiled.compiled) == {"qkv", "ffn"}
    # scalar C++: vectorised codegen triples the compile time of this test; the graphs,
    # their fusion and their loops are the same
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        for seed, lengths in enumerate(([5, 7], [3, 4, 6])):
            want, got = _run(eager, lengths, seed), _run(compiled, lengths, seed)
            names = ["output", "d input", *(n for n, _ in eager.named_parameters())]
            for name, w, g in zip(names, want, got, strict=True):
                diff = (g - w).abs()
                assert float(diff.max()) <= REL * float(w.abs().max()), (
                    f"{name} at {sum(lengths)} tokens: max abs {float(diff.max()):.3g}, "
                    f"mean {float(diff.mean()):.3g}"
                )
        # another block runs the same graphs: its weights are the graphs' inputs
        for w, g in zip(_run(eager, [9], 7), _run(other, [9], 7), strict=True):
            assert float((g - w).abs().max()) <= REL * float(w.abs().max())
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 2, (
        f"one graph per region for both token counts and both blocks, no break: {stats}"
    )


def test_model_compile_compiles_every_block_and_leaves_moe_feed_forwards_eager() -> None:
    cpu = torch.device("cpu")
    dense, _ = build_model(load_config(None, ["model.n_layers=2", "model.compile=true"]), cpu,
                           torch.float32)  # fmt: skip
    assert [set(b.compiled) for b in dense.layers] == [{"qkv", "ffn"}] * 2
    moe, _ = build_model(load_config(None, ["model.preset=tiny_moe", "model.compile=true"]), cpu,
                         torch.float32)  # fmt: skip
    regions = [(isinstance(b.feed_forward, MoE), set(b.compiled)) for b in moe.layers]
    assert (True, {"qkv"}) in regions, "an MoE feed-forward communicates: it stays eager"
    assert all(r == {"qkv"} if is_moe else r == {"qkv", "ffn"} for is_moe, r in regions)
    plain, _ = build_model(load_config(None, ["model.n_layers=1"]), cpu, torch.float32)
    assert plain.layers[0].compiled == {}, "model.compile is off by default"
