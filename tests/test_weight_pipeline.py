"""Weight-passing pipelines (TawPipe, ring, FSDP-style) train like one process.

Every device trains its own sequences while the weight shards travel; after
five steps the losses and every parameter must equal `single` on the same
global batches. The layers are initialised differently from each other, so a
shard delivered to the wrong place shows. Tolerance as in test_train_dist
(fp32, sums in another order, AdamW steps): rel. 1e-5.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.config import Compression, load_config
from ray_zep.distributed import Comm, GroupNeeds
from ray_zep.errors import ConfigError
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Passing
from ray_zep.parallel.pipeline_layout import WeightLayout, cut_shards
from ray_zep.pipeline.transport import Transport
from ray_zep.pipeline.weights import ShardedWeights
from ray_zep.topology import build_topology
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, checkpoint_params, train_rank, train_rank_each

REL_TOL = 1e-5
PIPE_RUN = [*SMALL_RUN, "model.n_layers=6", "train.tokens_per_rank=128", "train.steps=3"]
"""Three steps, as the equality standard asks (losses and every parameter)."""
TOPOLOGIES = {"1x4": (1, 4), "2x2": (2, 2), "2x4": (2, 4)}


@pytest.mark.unit
def test_shards_are_contiguous_balanced_and_cover_every_unit() -> None:
    sizes = [100, 10, 10, 10, 10, 10, 10, 100]
    shards = cut_shards(sizes, 4)
    assert [u for r in shards for u in r] == list(range(8))
    assert all(len(r) >= 1 for r in shards)
    assert [sum(sizes[u] for u in r) for r in shards] == [100, 30, 30, 100]
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        cut_shards([1, 1, 1], 4)


@pytest.mark.unit
def test_tawpipe_interleaves_owners_over_groups_as_the_paper() -> None:
    layout = WeightLayout.build(Passing.GROUPED, [1] * 6, nodes=2, gpus_per_node=3)
    # P0:W0 P1:W2 P2:W4 in group 0, P3:W1 P4:W3 P5:W5 in group 1
    assert [layout.shard_of(d) for d in range(6)] == [0, 2, 4, 1, 3, 5]
    assert [layout.root(1, 0), layout.root(1, 1)] == [0, 3], "staging device: owner's local index"
    ring = WeightLayout.build(Passing.RING, [1] * 6, nodes=2, gpus_per_node=3)
    assert ring.owners == tuple(range(6)) and len(ring.groups) == 1


def _merged(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        assert not set(rank["params"]) & set(merged), "a parameter owned twice"
        merged.update(rank["params"])
    return merged


ZIPPED = "comm.compression=always"
STRATEGY_RUNS = {
    "1x4": [("tawpipe",), ("ring_relay",), ("tawpipe", ZIPPED)],
    "2x2": [
        ("tawpipe", "metrics.memory_every=1"),
        ("ring_relay",),
        ("tawpipe", "parallel.shard_recompute=false"),
    ],
    "2x4": [("tawpipe",), ("ring_relay",), ("tawpipe", ZIPPED)],
}
"""Weight-passing modes with whole sequences (FSDP2 is tested with every placement in
test_strategies). Compressed, TawPipe's broadcasts and sums run as chains through
four devices of a node, a shard's compressed bytes relayed as they came."""


@pytest.mark.dist
@pytest.mark.parametrize(
    "topology", [pytest.param(t, marks=[pytest.mark.slow] * (t == "2x4")) for t in TOPOLOGIES]
)
def test_weight_passing_trains_like_single(topology: str, tmp_path: Path) -> None:
    nodes, gpus = TOPOLOGIES[topology]
    base = [*PIPE_RUN, f"topology.nodes={nodes}", f"topology.gpus_per_node={gpus}"]
    single = run_ranks(
        train_rank, 1, [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / 's'}"]
    )[0]
    layers = [single["params"][f"layers.{i}.attention.wq.weight"] for i in range(6)]
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(layers))
    configs = [
        [*base, f"parallel.weights={strategy}", *extra, f"train.out_dir={tmp_path / str(i)}"]
        for i, (strategy, *extra) in enumerate(STRATEGY_RUNS[topology])
    ]
    per_rank = run_ranks(train_rank_each, nodes * gpus, configs)
    for index, case in enumerate(STRATEGY_RUNS[topology]):
        _assert_like_single([rank[index] for rank in per_rank], single, " ".join(case))


def _assert_like_single(runs: list[dict], single: dict, case: str) -> None:
    for step, loss in single["losses"].items():
        got = runs[0]["losses"][step]
        assert got == pytest.approx(loss, rel=REL_TOL), f"{case}: loss of step {step}"
    merged = _merged(runs)
    assert set(merged) == set(single["params"]), case
    for name, ref in single["params"].items():
        rel = float((merged[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert rel <= REL_TOL, f"{case}: {name}: relative error {rel:.2e}"
    for run in runs:
        ledger = run["weight_ledger"]
        # own shard, one borrowed shard at a time, one staging buffer
        assert ledger.peak_bytes <= ledger.own_bytes + 2 * ledger.largest_shard_bytes, case
        assert ledger.peak_bytes > ledger.own_bytes + ledger.staging_bytes, case


@pytest.mark.dist
def test_tawpipe_checkpoint_holds_the_whole_model_and_resumes_exactly(tmp_path: Path) -> None:
    base = [*PIPE_RUN, "topology.nodes=2", "topology.gpus_per_node=2"]
    base += ["parallel.weights=tawpipe", "train.checkpoint_every=0"]
    full = run_ranks(train_rank, 4, [*base, "train.steps=4", f"train.out_dir={tmp_path / 'a'}"])
    run_ranks(train_rank, 4, [*base, "train.steps=2", f"train.out_dir={tmp_path / 'b'}"])
    second = run_ranks(train_rank, 4, [*base, "train.steps=4", f"train.out_dir={tmp_path / 'b'}"])
    assert second[0]["events"][0] == {"event": "start", "step": 2}
    merged, resumed = _merged(full), _merged(second)
    for name, value in merged.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resume"
    stored = checkpoint_params(tmp_path / "a" / "checkpoints" / "step_00000004", base)
    assert set(stored) == set(merged)
    for name, value in merged.items():
        assert torch.equal(stored[name], value), f"checkpoint holds another {name}"


def _shard(shard: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + shard)
    return (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)


def _bf16_transport_rank(rank: int, world: int, passing: Passing) -> dict:
    """Every shard fetched and every gradient summed through a zipped Transport in bf16."""
    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    topology = build_topology(config.topology)
    comm = Comm.create(topology, topology.world_size, 30.0)
    comm = comm.with_groups(GroupNeeds(node_and_rail=passing is Passing.GROUPED))
    layout = WeightLayout.build(passing, [1] * 4, nodes=2, gpus_per_node=2)
    zipper = AdaptiveCollectives(comm.world, Compression.ALWAYS).ring_zipper()
    transport = Transport(layout, comm, zipper)
    numel, fetched, sums = 3000, {}, {}
    for shard in range(layout.shards):
        mine = layout.shard_of(rank) == shard
        buffer = _shard(shard, numel) if mine else torch.empty(numel, dtype=torch.bfloat16)
        fetched[shard] = transport.finish_fetch(transport.post_fetch(shard, buffer)).clone()
        pending = transport.post_reduce(shard, _shard(10 * (rank + 1) + shard, numel))
        transport.relay_reduce(pending)
        sums[shard] = transport.finish_reduce(pending)
    tally = {s: zipper.tally.peek(s) for s in ("weight_shards", "shard_gradients")}
    return {"fetched": fetched, "sums": sums, "tally": tally}


@pytest.mark.dist
@pytest.mark.parametrize("passing", [Passing.GROUPED, Passing.RING])
def test_bf16_shards_and_sums_travel_zipped(passing: Passing) -> None:
    """Shards arrive bit-identical and every owner gets the sum of all devices' bf16
    gradients, added in float32 at each hop and rounded to bf16 to travel on."""
    results = run_ranks(_bf16_transport_rank, 4, passing)
    layout = WeightLayout.build(passing, [1] * 4, nodes=2, gpus_per_node=2)
    for shard in range(layout.shards):
        for result in results:
            assert torch.equal(result["fetched"][shard], _shard(shard, 3000)), shard
        parts = [_shard(10 * (r + 1) + shard, 3000).float() for r in range(4)]
        exact, scale = sum(parts), sum(p.abs() for p in parts)
        for rank, result in enumerate(results):
            got = result["sums"][shard]
            if rank != layout.owners[shard]:
                assert got is None
                continue
            assert got.dtype == torch.bfloat16
            # one bf16 rounding per hop (at most 3), each within 2^-8 of what is summed
            assert bool(((got.float() - exact).abs() <= 3 * 2**-8 * scale).all()), shard
    for stream in ("weight_shards", "shard_gradients"):
        raw, wire = (sum(r["tally"][stream][i] for r in results) for i in (0, 1))
        assert raw > 1.2 * wire > 0, f"{stream}: {raw} raw bytes, {wire} on the wire"


@pytest.mark.unit
def test_shards_travel_in_the_compute_dtype_and_parameters_keep_theirs() -> None:
    shape = build_shape(load_config(None, ["model.preset=tiny", "model.n_layers=2"]).model)
    model = Transformer(shape)
    model.init_weights(torch.Generator().manual_seed(0))
    layout = WeightLayout.build(Passing.RING, [1] * 4, nodes=1, gpus_per_node=4)
    weights = ShardedWeights(model, layout, 0, torch.bfloat16)
    own = weights.own_parameters()
    packed = weights.pack(0, weights.staging)
    assert packed.dtype == torch.bfloat16
    assert torch.equal(packed[: own[0].numel()], own[0].detach().reshape(-1).bfloat16())
    for p in own:
        p.grad = torch.full_like(p, 1 / 3)
    flat = weights.pack_gradients(0)
    assert flat.dtype == torch.bfloat16
    weights.set_gradients(0, flat)
    assert own[0].grad.dtype == torch.float32
    assert torch.equal(own[0].grad, torch.full_like(own[0], 1 / 3).bfloat16().float())
    borrowed = weights.params[1][0]
    weights.materialize(1, torch.ones(weights.numel[1], dtype=torch.bfloat16))
    assert borrowed.dtype == torch.float32 and bool((borrowed == 1).all())
    assert weights.ledger.staging_bytes == 2 * max(weights.numel)
