"""Every placement and weights mode trains like one process; ring attention matches the reference.

Multi-process gloo tests. The batches hold sequences of length 1, odd lengths,
lengths below 2 x G, many tiny documents and one document longer than a node
holds, so every zone, empty zigzag chunks and fragments of one token occur.

Tolerances (fp32): attention outputs and gradients are merged from ring steps in
a different order than one kernel call sums them (~1e-6 absolute); training
compares parameters after AdamW steps at the project-wide 1e-5 relative error
(see test_train_dist for why AdamW amplifies rounding).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.data.shards import shard_for
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import PLANNED, make_plan
from ray_zep.partition.plan import SeqPlacement, even_bounds, local_placement
from ray_zep.topology import build_topology
from ray_zep.train.checkpoint import Progress
from tests.helpers.attention import reference, ring_rank
from tests.helpers.procs import run_ranks
from tests.helpers.training import (
    SMALL_RUN,
    make_stream,
    max_relative_error,
    mixed_dataset,
    train_rank,
)

pytestmark = pytest.mark.dist

STRATEGIES = [p.value for p in PLANNED]  # every planned placement of the axes table
ROUTED = ["zeppelin", "te_cp", "usp"]
"""Strategies whose plans have ring transfers between nodes (usp's U parallel rings
already use every GPU's NIC, so its transfers stay direct: the engine must agree)."""
TOPOLOGIES = [(1, 4), (2, 2), pytest.param(2, 4, marks=pytest.mark.slow)]
HEADS = ["model.n_heads=8", "model.n_kv_heads=2"]
ATTENTION_TOL = 1e-5


def _ring_all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [ring_rank(rank, world, case) for case in cases]


@pytest.mark.parametrize("nodes,gpus", TOPOLOGIES, ids=lambda v: str(v))
def test_ring_attention_matches_single_device(nodes: int, gpus: int) -> None:
    """Multi-head and grouped-query attention (8 and 2 K/V heads), one spawn."""
    for kv_heads, cases, results in _ring_runs(nodes, gpus):
        _assert_ring_matches(kv_heads, cases, results)


def test_a_rank_in_several_rings_matches_single_device() -> None:
    """`fill` pours two long sequences over consecutive ranks in unequal shares: ranks
    0-2 sit in both rings (and hold whole short sequences), on one node and across two
    (routed). The work policy's hosted ring (`ray_zep.partition.hosting`): a ring across
    nodes over ranks 0-2 and, on node 0's two GPUs, a ring inside the node over two more
    sequences, direct and routed."""
    lengths = [90, 70, 3, 1, 50, 2, 7]
    cases = [
        dict(strategy="fill", routing=routing, nodes=nodes, gpus=gpus, heads=8, kv_heads=2,
             dim=4, lengths=lengths, capacity=-(-sum(lengths) // 4) + 4)
        for nodes, gpus, routing in [(1, 4, False), (2, 2, False), (2, 2, True)]
    ]  # fmt: skip
    for case in cases:
        config = load_config(None, [f"topology.nodes={case['nodes']}", "model.n_heads=8",
                                    f"topology.gpus_per_node={case['gpus']}"])  # fmt: skip
        topology = build_topology(config.topology)
        plan = make_plan(Placement.FILL, lengths, topology, case["capacity"],
                         build_shape(config.model))  # fmt: skip
        rings = Counter(r for item in plan.items() if item.ring_size > 1 for r in item.ranks)
        assert max(rings.values()) >= 2, "a rank must sit in two rings"
    hosted = [40, 12, 3, 5, 7, 9]
    placements = [
        SeqPlacement(0, 40, (0, 1, 2), even_bounds(40, 3)),
        SeqPlacement(1, 12, (0, 1), even_bounds(12, 2)),
        local_placement(2, 3, 3), local_placement(3, 5, 2), local_placement(4, 7, 3),
        SeqPlacement(5, 9, (0, 1), even_bounds(9, 2)),
    ]  # fmt: skip
    cases += [
        dict(strategy="zeppelin", routing=routing, nodes=2, gpus=2, heads=8, kv_heads=2, dim=4,
             lengths=hosted, capacity=24, placements=placements)
        for routing in (False, True)
    ]  # fmt: skip
    results = run_ranks(_ring_all, 4, cases)
    _assert_ring_matches(2, cases[:3], [r[:3] for r in results])
    _assert_ring_matches(2, cases[3:], [r[3:] for r in results])


def test_sequences_sharing_a_ring_match_single_device() -> None:
    """The work policy puts two split sequences on one ring (one queue item whose steps
    forward both sequences' chunks; a rank in one ring only): on one node, and across
    two, direct and routed."""
    cases = [
        dict(strategy="zeppelin", routing=routing, nodes=nodes, gpus=gpus, heads=8, kv_heads=2,
             dim=4, lengths=[12, 2, 14], capacity=7)
        for nodes, gpus, routing in [(1, 4, False), (2, 2, False), (2, 2, True)]
    ]  # fmt: skip
    for case in cases:
        config = load_config(None, [f"topology.nodes={case['nodes']}", "model.n_heads=8",
                                    f"topology.gpus_per_node={case['gpus']}", "model.n_kv_heads=2",
                                    "model.dim=32"])  # fmt: skip
        plan = make_plan(Placement.ZEPPELIN, case["lengths"], build_topology(config.topology),
                         case["capacity"], build_shape(config.model))  # fmt: skip
        rings = [item for item in plan.items() if item.ring_size > 1]
        assert any(len(item.seqs) > 1 for item in rings), "two sequences must share a ring"
        assert max(Counter(r for item in rings for r in item.ranks).values()) == 1
    results = run_ranks(_ring_all, 4, cases)
    _assert_ring_matches(2, cases, results)


def test_dkv_on_the_wire_in_the_kv_dtype_and_straight_to_their_owners() -> None:
    """One set of four ranks on 2x2 runs both wires that halve the dK/dV bytes.

    `parallel.dkv_wire=compute`, every sequence on a ring of the four ranks (te_cp,
    routed: hops inside a node direct, between nodes through the relays): in float32 the
    wire changes nothing (equal to one device); in bfloat16 each hop's partial dK/dV is
    rounded to bf16, within bf16's error of the float32 wire's gradients, and not equal to
    them.

    `parallel.dkv_wire=owner`, zeppelin's rings inside a node and usp's Ulysses groups
    sending each step's dK/dV to their owners: in float32 equal to one device; in bfloat16
    each step's dK/dV is the kernel's bf16 output, so the owners' float32 sums are the
    float32 ring's up to the order of the additions (within one bf16 rounding of the
    result), with fewer dK/dV messages."""
    lengths = [1, 7, 3, 3, 2, 61, 1, 2, 1, 3, 33]
    shared = dict(routing=True, nodes=2, gpus=2, heads=8, kv_heads=2, dim=4, lengths=lengths,
                  capacity=-(-sum(lengths) // 4) + 4)  # fmt: skip
    te = {**shared, "strategy": "te_cp"}
    cases = [{**te, "dkv_as_kv": True}]
    cases += [{**te, "dtype": "bfloat16", "dkv_as_kv": wire} for wire in (False, True)]
    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    for strategy in ("zeppelin", "usp"):
        plan = make_plan(Placement(strategy), lengths, build_topology(config.topology),
                         shared["capacity"], build_shape(config.model))  # fmt: skip
        assert any(item.owner_dkv for item in plan.items()), strategy
        base = {**shared, "strategy": strategy}
        cases += [{**base, "dkv_to_owner": True}]
        cases += [{**base, "dtype": "bfloat16", "dkv_to_owner": owner} for owner in (False, True)]
    results = run_ranks(_ring_all, 4, cases)
    for start in (0, 3, 6):
        _assert_ring_matches(2, cases[start : start + 1], [r[start : start + 1] for r in results])
    differs = False
    for per_rank in results:
        wide, narrow = per_rank[1], per_rank[2]
        for name in ("dk", "dv"):
            a, b = wide[name].float(), narrow[name].float()
            assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max()), name
            differs |= not torch.equal(a, b)
        assert torch.equal(wide["dq"], narrow["dq"]), "dQ never travels"
        assert narrow["ops"].get("routed", 0) > 0, "the relays must carry some dK/dV"
    assert differs, "the bf16 wire must round some partial sum"
    for start in (3, 6):
        for per_rank in results:
            ring, owner = per_rank[start + 1], per_rank[start + 2]
            for name in ("dk", "dv"):
                a, b = ring[name].float(), owner[name].float()
                assert float((a - b).abs().max()) <= 2**-7 * float(a.abs().max()), name
            assert torch.equal(ring["dq"], owner["dq"]), "dQ never travels"
            assert owner["ops"].get("p2p", 0) <= ring["ops"].get("p2p", 0)
        fewer = [r[start + 2]["ops"].get("p2p", 0) < r[start + 1]["ops"].get("p2p", 0)
                 for r in results]  # fmt: skip
        assert any(fewer), "one dK/dV message fewer per owner item and member"


def _ring_runs(nodes: int, gpus: int):
    cases = {kv_heads: _ring_cases(nodes, gpus, kv_heads) for kv_heads in (8, 2)}
    flat = [case for group in cases.values() for case in group]
    results = run_ranks(_ring_all, nodes * gpus, flat)
    start = 0
    for kv_heads, group in cases.items():
        yield kv_heads, group, [r[start : start + len(group)] for r in results]
        start += len(group)


def _ring_cases(nodes: int, gpus: int, kv_heads: int) -> list[dict]:
    lengths = [1, 7, 3, 2 * gpus - 1, 2, 5 * gpus * 12 + 1, *[1, 2, 1, 3] * 4, 33]
    capacity = -(-sum(lengths) // (nodes * gpus)) + 4
    routed = [(s, True) for s in ROUTED] if nodes > 1 else []
    return [
        dict(
            strategy=s,
            routing=routing,
            nodes=nodes,
            gpus=gpus,
            heads=8,
            kv_heads=kv_heads,
            dim=4,
            lengths=lengths,
            capacity=capacity,
        )
        for s, routing in [*((s, False) for s in STRATEGIES), *routed]
    ]


def _assert_ring_matches(kv_heads: int, cases: list[dict], results: list[list[dict]]) -> None:
    q, k, v, _, out = reference(cases[0]["lengths"], cases[0]["heads"], kv_heads, 4, 0)
    for index, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            rows = torch.as_tensor(got["rows"])
            n = len(rows)
            for name, value, ref in [
                ("out", got["out"], out),
                ("dq", got["dq"], q.grad),
                ("dk", got["dk"], k.grad),
                ("dv", got["dv"], v.grad),
            ]:
                diff = (value[:n] - ref[rows]).abs()
                where = (
                    f"{case['strategy']} routing={case['routing']} kv_heads={kv_heads} "
                    f"rank {rank} {name}"
                )
                assert n == 0 or float(diff.max()) <= ATTENTION_TOL, (
                    f"{where}: max abs {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}"
                )
                assert torch.count_nonzero(value[n:]) == 0, f"{where}: padding rows not zero"
            assert got["ops"] == got["expected_ops"], f"{case} rank {rank}"
        if case["routing"] and case["strategy"] == "te_cp":
            routed = sum(r[index]["ops"].get("routed", 0) for r in results)
            assert routed > 0, "te_cp crosses nodes: routing must act"


def _train_all(rank: int, world: int, runs: dict[str, list[str]]) -> dict:
    return {name: train_rank(rank, world, overrides) for name, overrides in runs.items()}


def _base(nodes: int, gpus: int, data: Path, packing: str = "budget") -> list[str]:
    return [
        *SMALL_RUN,
        *HEADS,
        f"topology.nodes={nodes}",
        f"topology.gpus_per_node={gpus}",
        "train.tokens_per_rank=64",
        "train.steps=2",
        "train.save_last=false",  # the trainers' own parameters are compared
        f"data.source={data}",
        f"data.packing={packing}",
        "data.shuffle=false",
    ]


def _assert_trains_like(single: dict, runs: dict) -> None:
    assert sorted(single["losses"]) == [1, 2]
    for name, run in runs.items():
        assert run["samples"] == single["samples"], f"{name} saw other batches"
        for step, loss in single["losses"].items():
            assert run["losses"][step] == pytest.approx(loss, rel=1e-5), f"{name} step {step}"
        err, param = max_relative_error(run["params"], single["params"])
        assert err <= 1e-5, f"{name}: parameter {param} relative error {err:.2e}"


ROUTE = "parallel.routing=true"
REMAP = ("parallel.remap=true", "parallel.remap_policy=always")
RINGS = "parallel.usp_groups=false"
"""zeppelin's long sequences on rings across nodes (a USP group's hops go direct: nothing
to route; the groups train in the other runs)."""
LAYER_RUNS = {
    "zeppelin+routing+remap": ["parallel.sequence=zeppelin", ROUTE, *REMAP, RINGS],
    "zeppelin+hsdp+routing+remap": [
        "parallel.sequence=zeppelin",
        "parallel.weights=hsdp",
        ROUTE,
        *REMAP,
        RINGS,
    ],
    "te_cp+routing": ["parallel.sequence=te_cp", ROUTE],
    "hybrid_dp+remap": ["parallel.sequence=hybrid_dp", *REMAP],
}
"""Placements with the routing and remapping layers on (te_cp, llama_cp and usp
already hold balanced token counts, so remapping would move nothing); they need
more than one node."""
WEIGHTS = ("replicated", "fsdp")
TWO_BY_TWO_ONLY = ("fill",)
"""Placements trained on 2 x 2 only: fill cuts its rings by the same rule on any
topology, and a rank in several rings is tested on 1 x 4 and 2 x 2, direct and routed
(`test_a_rank_in_several_rings_matches_single_device`)."""
MICRO_2 = "train.micro_batches=2"
WHOLE_WEIGHTS = ("replicated", "fsdp", "hsdp")
"""Whole sequences with every sharding mode (the weight-passing modes are tested in
test_weight_pipeline)."""


@pytest.mark.parametrize(
    "nodes,gpus", [(2, 2), pytest.param(2, 4, marks=pytest.mark.slow)], ids=["2x2", "2x4"]
)
def test_every_placement_and_weights_mode_trains_like_one_process(
    nodes: int, gpus: int, tmp_path: Path
) -> None:
    """Every placement x {replicated, fsdp}, hsdp with zeppelin's routing and remapping
    layers, and whole sequences under every sharding mode, 2 steps each, one spawn.

    On 2 x 4 each placement trains under one weights mode, the modes taking turns, and
    whole sequences under hsdp, dealt to ranks by modelled work (`parallel.zone_policy=
    work`; FSDP2's per-projection units on 2 x 2 only): what four
    GPUs per node change is the plan (zones, Ulysses groups, proxies, hsdp's shard
    groups), while the weights axis composes with every placement the same way on any
    topology (crossed in full on 2 x 2)."""
    data = mixed_dataset(tmp_path / "mixed.parquet")
    planned, whole = _base(nodes, gpus, data), _base(nodes, gpus, data, packing="rank")
    for name, extra in LAYER_RUNS.items():
        _assert_layers_act(load_config(None, [*planned, *extra]), name)
    _assert_usp_groups(load_config(None, [*planned, "parallel.sequence=zeppelin"]))
    crossed = gpus <= 2
    strategies = STRATEGIES if crossed else [s for s in STRATEGIES if s not in TWO_BY_TWO_ONLY]
    pairs = [
        (s, w)
        for i, s in enumerate(strategies)
        for w in (WEIGHTS if crossed else [WEIGHTS[i % len(WEIGHTS)]])
    ]
    runs = {
        f"{s}+{w}": [*planned, f"parallel.sequence={s}", f"parallel.weights={w}"] for s, w in pairs
    }
    runs |= {name: [*planned, *extra] for name, extra in LAYER_RUNS.items()}
    if crossed:
        runs["zeppelin+fsdp per projection"] = [*runs["zeppelin+fsdp"], "parallel.fsdp_unit=linear"]
    if crossed:  # USP head exchanges in 3 pieces beside the projections (4 by default), whole
        runs["zeppelin+fsdp ulysses in 3 pieces"] = [*planned, "parallel.sequence=zeppelin",
                                                     "parallel.weights=fsdp",
                                                     "parallel.ulysses_chunks=3"]  # fmt: skip
        runs["usp+replicated ulysses whole"] = [*planned, "parallel.sequence=usp",
                                                "parallel.ulysses_chunks=1"]  # fmt: skip
    # the default places by modelled work (token counts differ between ranks); the cost
    # model's zones and first-fit packing are the other policy
    runs["zeppelin+cost"] = [*planned, "parallel.sequence=zeppelin", "parallel.weights=fsdp",
                             "parallel.zone_policy=cost"]  # fmt: skip
    runs["hybrid_dp+cost"] = [*planned, "parallel.sequence=hybrid_dp",
                              "parallel.zone_policy=cost"]  # fmt: skip
    _assert_places_apart(planned, "parallel.sequence=hybrid_dp", "parallel.zone_policy=cost")
    whole_weights = WHOLE_WEIGHTS if crossed else ("hsdp",)
    whole_runs = {f"whole+{w}": [*whole, f"parallel.weights={w}"] for w in whole_weights}
    if not crossed:  # a plan change: whole sequences dealt first fit, not by modelled work
        whole_runs["whole+hsdp"].append("parallel.zone_policy=cost")
    # gradient accumulation (2 x 2): two global batches a step, against one process doing
    # the same; tests/test_elastic.py covers it on fewer nodes than configured
    zeppelin_fsdp = [*planned, "parallel.sequence=zeppelin", "parallel.weights=fsdp"]
    micro = {"zeppelin+fsdp 2 micro-batches": [*zeppelin_fsdp, MICRO_2],
             "whole+replicated 2 micro-batches": [*whole, MICRO_2]} if crossed else {}  # fmt: skip
    single_runs = {"single": planned, "single_rank_packed": whole}
    if crossed:
        single_runs["single_rank_packed micro 2"] = [*whole, MICRO_2]
        single_runs["single micro 2"] = [*planned, MICRO_2]
    singles = run_ranks(
        _train_all,
        1,
        {
            name: [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / name}"]
            for name, base in single_runs.items()
        },
    )[0]
    trained = run_ranks(
        _train_all,
        nodes * gpus,
        {
            name: [*overrides, f"train.out_dir={tmp_path / name}"]
            for name, overrides in (runs | whole_runs | micro).items()
        },
    )[0]
    _assert_trains_like(singles["single"], {name: trained[name] for name in runs})
    _assert_trains_like(singles["single_rank_packed"], {n: trained[n] for n in whole_runs})
    if crossed:
        zeppelin_micro = {n: trained[n] for n in micro if n.startswith("zeppelin")}
        _assert_trains_like(singles["single micro 2"], zeppelin_micro)
        whole_micro = {n: trained[n] for n in micro if n.startswith("whole")}
        _assert_trains_like(singles["single_rank_packed micro 2"], whole_micro)
        assert len(singles["single micro 2"]["samples"]) == 4, "2 steps of 2 batches"


def _assert_usp_groups(config) -> None:
    """zeppelin's default policy runs a sequence of these batches as a USP group (heads
    exchanged inside each node, the ring over the nodes), so its runs train one; on
    2 x 4, one of half-node positions ending on half of the second node."""
    topology = build_topology(config.topology)
    stream = make_stream(config, topology, Progress(0, {}))
    shards = [s for _ in range(2) for s in shard_for(stream.next_batch(), config, topology)]
    widths = {item.ulysses for s in shards for item in s.plan.items()}
    assert max(widths) > 1, "no USP group"
    gpus = topology.gpus_per_node
    if gpus >= 4:
        assert gpus // 2 in widths, "no group of half-node positions"


def _assert_places_apart(base: list[str], placement: str, policy: str) -> None:
    """The policy changes where the first batches' tokens go (else its run proves nothing)."""
    docs = []
    for extra in ([placement], [placement, policy]):
        config = load_config(None, [*base, *extra])
        topology = build_topology(config.topology)
        stream = make_stream(config, topology, Progress(0, {}))
        shards = [s for _ in range(2) for s in shard_for(stream.next_batch(), config, topology)]
        docs.append([s.tokens.tolist() for s in shards])
    assert docs[0] != docs[1], f"{policy} places {placement} as the default does"


def _assert_layers_act(config, name: str) -> None:
    """The two batches really route and remap under `config` (else the test proves nothing)."""
    topology = build_topology(config.topology)
    stream = make_stream(config, topology, Progress(0, {}))
    shards = [s for _ in range(2) for s in shard_for(stream.next_batch(), config, topology)]
    if config.parallel.routing:
        assert any(s.routing.forward for s in shards), f"{name}: nothing routed"
    if config.parallel.remap:
        assert any(s.remap and s.remap.sends for s in shards), f"{name}: nothing remapped"
        for step in (0, 1):
            sizes = [len(s.tokens) for s in shards if s.step == step]
            assert max(sizes) - min(sizes) <= 1, f"{name}: linear layout not balanced"
