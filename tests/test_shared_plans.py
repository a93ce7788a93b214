"""Plans shared between compositions that place a batch alike (`plan --auto`,
`ray_zep.partition.shared_plans`): each planner's declaration of the `ParallelConfig`
fields it reads holds (no other field changes its plan), and `make_plan` shares a plan
only inside `sharing_plans()` and only where the declaration allows."""

from __future__ import annotations

import dataclasses
from enum import Enum

import numpy as np
import pytest

from ray_zep.config import ParallelConfig, load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ZepError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan
from ray_zep.partition.registry import SPECS
from ray_zep.partition.shared_plans import sharing_plans
from ray_zep.topology import build_topology

OTHER_VALUES = {
    "ring_kv_keep_gb": (0.0, 40.0),
    "ring_kv_room_mb": (0.0, 500.0),
    "ulysses_degree": (2, 4),
    "ulysses_chunks": (1, 4),
    "ep": (2,),
    "moe_overlap_degree": (2,),
    "prefetch_after_attention": (True, False),
    "prefetch_depth": (1, 3),
    "reshard_to_node": (True, False),
    "shard_nodes": (1,),
}
"""Values tried for the fields that are neither an enum nor a plain bool."""


def _setup():
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "train.tokens_per_rank=5120"])  # fmt: skip
    topology, shape = build_topology(config.topology), build_shape(config.model)
    mixed = np.concatenate([batch_lengths("github", 8 * 4096, 0),
                            batch_lengths("chat", 8 * 4096, 1)])  # fmt: skip
    # one document across both nodes (USP groups), the rest in rings and whole
    spanning = np.concatenate([[50000], batch_lengths("chat", 6 * 4096, 1)])
    # rings across the nodes, placed apart where routed
    across = batch_lengths("prolong64k", 16 * 4096, 2)
    return topology, shape, mixed, spanning, across


def _others(field: dataclasses.Field, value) -> tuple:
    """Every value of `field` but `value` the test tries."""
    if isinstance(value, Enum):
        return tuple(v for v in type(value) if v is not value)
    if isinstance(value, bool):
        return (not value,)
    if field.name == "reference_layout":
        return (Placement.TE_CP, Placement.ZEPPELIN)
    return tuple(v for v in OTHER_VALUES[field.name] if v != value)


def _shape_of(plan) -> tuple:
    """Where the plan puts each sequence (every `SeqPlacement` field)."""
    return plan.placements


DECLARED = [spec.axis.placement for spec in SPECS.values()
            if spec.planner is not None and spec.reads is not None]  # fmt: skip


def test_every_parallel_field_is_tried() -> None:
    """A new `ParallelConfig` field gets values here, so declarations are checked on it."""
    for field in dataclasses.fields(ParallelConfig):
        if field.name == "sequence":
            continue
        assert _others(field, getattr(ParallelConfig(), field.name)), field.name


@pytest.mark.parametrize("placement", DECLARED, ids=lambda p: p.value)
def test_fields_a_planner_does_not_declare_leave_its_plan(placement: Placement) -> None:
    """Each unread field at each other value gives the same placements, on three batches
    (each field zeppelin reads changes one of them)."""
    topology, shape, *batches = _setup()
    base = ParallelConfig(sequence=placement)

    def placed(parallel: ParallelConfig) -> list[tuple]:
        return [_shape_of(make_plan(placement, lengths, topology, 5120, shape, parallel))
                for lengths in batches]  # fmt: skip

    reference = placed(base)
    reads = SPECS[placement].reads
    tried = 0
    for field in dataclasses.fields(ParallelConfig):
        if field.name == "sequence" or field.name in reads:
            continue
        for value in _others(field, getattr(base, field.name)):
            try:
                other = dataclasses.replace(base, **{field.name: value})
            except ZepError:
                continue  # a combination the config refuses
            assert placed(other) == reference, (field.name, value)
            tried += 1
    assert tried >= 20


def test_plans_are_shared_only_inside_the_block_and_where_declared(monkeypatch) -> None:
    topology, shape, lengths, *_ = _setup()
    usp = ParallelConfig(sequence=Placement.USP, ulysses_degree=4)
    hsdp_routed = dataclasses.replace(usp, weights=type(usp.weights)("hsdp"), routing=True)
    assert make_plan(Placement.USP, lengths, topology, 5120, shape, usp) is not make_plan(
        Placement.USP, lengths, topology, 5120, shape, hsdp_routed
    )
    with sharing_plans():
        first = make_plan(Placement.USP, lengths, topology, 5120, shape, usp)
        assert make_plan(Placement.USP, lengths, topology, 5120, shape, hsdp_routed) is first
        # a field it reads, another L, other lengths: planned again
        wider = dataclasses.replace(usp, ulysses_degree=8)
        assert _shape_of(make_plan(Placement.USP, lengths, topology, 5120, shape, wider)) != (
            _shape_of(first)
        )
        assert make_plan(Placement.USP, lengths, topology, 6400, shape, usp) is not first
        assert make_plan(Placement.USP, lengths[1:], topology, 5120, shape, usp) is not first
        # zeppelin shares across the remap and the weights, not across routing
        zeppelin = ParallelConfig(sequence=Placement.ZEPPELIN)
        one = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, shape, zeppelin)
        remapped = dataclasses.replace(zeppelin, remap=True, weights=hsdp_routed.weights)
        assert make_plan(Placement.ZEPPELIN, lengths, topology, 5120, shape, remapped) is one
        routed = dataclasses.replace(zeppelin, routing=True)
        assert make_plan(Placement.ZEPPELIN, lengths, topology, 5120, shape, routed) is not one
        # a planner that declares nothing is planned for every call
        spec = SPECS[Placement.ZEPPELIN]
        monkeypatch.setitem(SPECS, Placement.ZEPPELIN, dataclasses.replace(spec, reads=None))
        one = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, shape, zeppelin)
        assert make_plan(Placement.ZEPPELIN, lengths, topology, 5120, shape, zeppelin) is not one
    # let go at the block's end
    assert make_plan(Placement.USP, lengths, topology, 5120, shape, usp) is not first
