"""Activation checkpointing (`train.activation_checkpointing`) keeps less and changes nothing.

One block keeps fewer saved bytes with `selective`, fewer still with `linears` (the
attention's inputs and outputs and the block's input) and fewest with `full`, with the
same output and gradients; and on the virtual 2x2, runs that compose it with the
other axes (zeppelin with routing and remap, FSDP2, experts with FoldMoE, TawPipe)
train to the same losses and parameters as without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_zep.attention.rope import rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import ActivationCheckpointing, load_config
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from tests.helpers.procs import run_ranks
from tests.helpers.training import NEEDS_EXPERT_MESH, SMALL_RUN, train_rank_each

REL_TOL = 1e-5
MODES = [m.value for m in ActivationCheckpointing]


def _block_run(mode: ActivationCheckpointing) -> tuple[int, torch.Tensor, dict]:
    """Saved bytes during one block's forward, its output and its gradients."""
    shape = build_shape(load_config(None, ["model.preset=tiny"]).model)
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(0))
    model.set_checkpointing(mode)
    block = model.layers[0]
    lengths = [40, 24, 64]
    x = torch.randn(sum(lengths), shape.dim, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    positions = torch.cat([torch.arange(n) for n in lengths])
    rope = rope_tables(positions, shape.head_dim, shape.rope_theta)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, rope, PackedSeqs.from_lengths(lengths), model.attention_fn)
    kept = sum(saved)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return kept, out.detach(), {"x": x.grad.clone(), **grads}


@pytest.mark.unit
def test_checkpointing_keeps_less_and_computes_the_same() -> None:
    runs = {mode: _block_run(mode) for mode in ActivationCheckpointing}
    none, full, selective, linears = (runs[mode] for mode in ActivationCheckpointing)
    kept = [run[0] for run in (full, linears, selective, none)]
    assert kept == sorted(set(kept)), {m.value: r[0] for m, r in runs.items()}
    for mode, (_, out, grads) in runs.items():
        assert torch.equal(out, none[1]), mode
        for name, grad in grads.items():
            assert torch.allclose(grad, none[2][name], rtol=1e-6, atol=1e-7), (mode, name)


@pytest.mark.unit
def test_checkpointing_the_first_blocks_only_keeps_the_rest_and_computes_the_same() -> None:
    """train.checkpoint_blocks=1 of 2: the first block recomputes, the second keeps every
    activation (or, with train.checkpoint_rest=selective under full or linears,
    recomputes its feed-forward); the model's loss and gradients equal those of no
    checkpointing."""
    shape = build_shape(load_config(None, ["model.preset=tiny", "model.n_layers=2"]).model)
    tokens = torch.randint(0, shape.vocab_size, (96,), generator=torch.Generator().manual_seed(2))
    seqs = PackedSeqs.from_lengths([40, 56])
    results = {}
    none, full, selective, linears = ActivationCheckpointing
    for mode, blocks, rest in ((none, 0, none), (full, 1, none), (selective, 1, none),
                               (linears, 1, none), (full, 1, selective),
                               (linears, 1, selective)):  # fmt: skip
        model = Transformer(shape)
        model.init_weights(torch.Generator().manual_seed(0))
        model.set_checkpointing(mode, blocks, rest)
        assert [b.checkpointing for b in model.layers] == [mode, rest]
        positions = torch.cat([torch.arange(n) for n in (40, 56)])
        loss = model(tokens, positions, seqs, labels_T=tokens.roll(-1))
        loss.backward()
        results[(mode, rest)] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    want_loss, want = results.pop((none, none))
    for mode, (loss, grads) in results.items():
        assert torch.equal(loss, want_loss), mode
        for name, grad in grads.items():
            assert torch.allclose(grad, want[name], rtol=1e-6, atol=1e-7), (mode, name)


BASE = [
    *SMALL_RUN,
    "topology.nodes=2",
    "topology.gpus_per_node=2",
    "train.steps=2",
    "train.save_last=false",
]
MOE = ["model.preset=tiny_moe", "model.n_layers=2", "model.moe.capacity_factor=0"]
CASES = {
    "zeppelin+fsdp+routing+remap": [
        "parallel.sequence=zeppelin", "parallel.weights=fsdp", "data.packing=budget",
        "parallel.routing=true", "parallel.remap=true", "parallel.remap_policy=always",
    ],
    "whole+moe+ep2+1a1m+fsdp per projection": [
        *MOE, "parallel.ep=2", "parallel.moe_pipeline=1a1m", "parallel.weights=fsdp",
        "parallel.fsdp_unit=linear",
    ],
    "zeppelin+moe+ep2": [*MOE, "parallel.sequence=zeppelin", "parallel.ep=2",
                         "data.packing=budget"],
    "zeppelin+fsdp ulysses pieces": [
        "parallel.sequence=zeppelin", "parallel.weights=fsdp", "data.packing=budget",
        "parallel.ulysses_chunks=3",
    ],
    "whole+tawpipe": [
        "parallel.weights=tawpipe", "model.n_layers=4", "parallel.shard_recompute=false",
    ],
}  # fmt: skip


@NEEDS_EXPERT_MESH
@pytest.mark.dist
def test_checkpointing_composes_with_every_axis_and_trains_the_same(tmp_path: Path) -> None:
    runs, names = [], []
    first = next(iter(CASES))
    variants = {mode: [f"train.activation_checkpointing={mode}"] for mode in MODES}
    # a FoldMoE-pipelined block recomputes whole under `linears`, as under `full`
    linears = {"zeppelin+fsdp+routing+remap", "zeppelin+moe+ep2", "whole+tawpipe"}
    # full on the first block only, the second recomputing its feed-forward
    # (train.checkpoint_blocks, train.checkpoint_rest)
    first_block = ["train.activation_checkpointing=full", "train.checkpoint_blocks=1",
                   "train.checkpoint_rest=selective"]  # fmt: skip
    for case, overrides in CASES.items():
        extra = {"full on the first block, selective after": first_block} if case == first else {}
        modes = {m: k for m, k in variants.items() if m != "linears" or case in linears}
        for mode, keys in {**modes, **extra}.items():
            names.append((case, mode))
            runs.append([*BASE, *overrides, *keys, f"train.out_dir={tmp_path / str(len(runs))}"])
    per_rank = run_ranks(train_rank_each, 4, runs)
    results = dict(zip(names, per_rank[0], strict=True))
    for case, mode in (name for name in names if name[1] != "none"):
        want, got = results[(case, "none")], results[(case, mode)]
        for step, loss in want["losses"].items():
            assert got["losses"][step] == pytest.approx(loss, rel=REL_TOL), (case, mode, step)
        for name, ref in want["params"].items():
            rel = float((got["params"][name] - ref).norm() / ref.norm().clamp_min(1e-30))
            assert rel <= REL_TOL, f"{case} {mode}: {name}: relative error {rel:.2e}"
