"""FSDP2's forward prefetch after each block's attention (`parallel.prefetch_after_attention`):
when the next unit's parameters are gathered, and that nothing else changes."""

from __future__ import annotations

import pytest

from tests.helpers.fsdp_order import gather_order
from tests.helpers.procs import run_ranks

AFTER_EACH_ATTENTION = ["attention 0", "gather block 1", "attention 1", "gather block 2",
                        "attention 2", "gather head", "backward"]  # fmt: skip
TWO_AHEAD_AFTER_ATTENTION = [
    "all-gather tok_embeddings", "all-gather layers.0", "all-gather layers.1",
    "attention 0", "gather block 2", "all-gather layers.2",
    "attention 1", "gather head", "all-gather norm, output",
    "attention 2",
]  # fmt: skip
TWO_AHEAD_AT_START = [
    "all-gather tok_embeddings", "all-gather layers.0", "all-gather layers.1",
    "all-gather layers.2", "attention 0", "all-gather norm, output", "attention 1", "attention 2",
]  # fmt: skip


def _manual(events: list[str]) -> list[str]:
    """The events but the all-gathers FSDP2 issues."""
    return [e for e in events if not e.startswith("all-gather")]


def _forward(events: list[str]) -> list[str]:
    return events[: events.index("backward")]


@pytest.mark.dist
def test_each_block_gathers_the_next_unit_after_its_attention_and_trains_the_same() -> None:
    """On 2 ranks, one unit ahead (`parallel.prefetch_depth=1`): each block gathers the
    next unit (the head after the last block) once its attention has run, never again
    while a checkpointed block's forward runs once more in backward, and not at all by hand
    with the option off (FSDP2's own prefetch then gathers it when the block starts). Two
    ahead: each block gathers the unit two ahead after its attention (the
    embedding the first two blocks), or FSDP2 issues it when the block starts. The loss
    and gradients are the same in every case, three ahead too."""
    on, off = (["parallel.prefetch_after_attention=" + value] for value in ("true", "false"))
    one, two = ["parallel.prefetch_depth=1"], ["parallel.prefetch_depth=2"]
    three = ["parallel.prefetch_depth=3"]  # zeppelin's unset depth
    cases = ([*on, *one], [*on, *one, "train.activation_checkpointing=full"], [*off, *one],
             [*on, *two], [*off, *two], [*on, *three])  # fmt: skip
    after, checkpointed, at_start, two_after, two_at_start, three_after = (
        run_ranks(gather_order, 2, case)[0] for case in cases
    )
    assert _manual(after[0]) == AFTER_EACH_ATTENTION
    assert _manual(checkpointed[0]) == [*AFTER_EACH_ATTENTION, *["attention again"] * 3]
    assert _manual(at_start[0]) == ["attention 0", "attention 1", "attention 2", "backward"]
    assert _forward(two_after[0]) == TWO_AHEAD_AFTER_ATTENTION
    assert _forward(two_at_start[0]) == TWO_AHEAD_AT_START
    # one ahead, FSDP2 issues each block's gather when the block before it starts
    assert _forward(at_start[0]).index("all-gather layers.2") > _forward(at_start[0]).index(
        "attention 0"
    )
    assert after[1:] == checkpointed[1:] == at_start[1:] == two_after[1:] == two_at_start[1:]
    assert three_after[1:] == after[1:]


@pytest.mark.unit
def test_unset_it_gathers_after_attention_where_that_exposes_less() -> None:
    """Unset, the cost model decides (`ray_zep.prefetch_plan`): on cluster A, 7B at 4k
    tokens per GPU (L = 5,120), one block ahead, after attention on 64 and 1,024 GPUs, when
    the block starts on 4,096 (the gather's 16 ms of ring latency beside a feed-forward of
    7 ms); two blocks ahead, the latency runs from the block's start, and with the
    projections' share of it hidden after attention wins from 8,000 tokens a rank on 4,096
    GPUs (one ahead: from 10,000); unset, the depth follows (`prefetch_depth`); a set value
    is kept; without FSDP's block units nothing is gathered by hand."""
    from ray_zep.config import load_config
    from ray_zep.model_shapes import build_shape
    from ray_zep.prefetch_plan import gathers_after_attention
    from ray_zep.topology import build_topology

    def late(gpus: int, *overrides: str, tokens: int = 4096) -> bool:
        config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                    "model.preset=7b", "train.tokens_per_rank=5120",
                                    "parallel.weights=fsdp", *overrides])  # fmt: skip
        topology, shape = build_topology(config.topology), build_shape(config.model)
        return gathers_after_attention(config.parallel, topology, shape, tokens, 2)

    one = "parallel.prefetch_depth=1"
    assert late(64, one) and late(1024, one) and not late(4096, one)
    assert late(64) and late(1024) and not late(4096)
    assert late(4096, tokens=8000) and not late(4096, one, tokens=8000)
    assert not late(4096, one, tokens=9500) and late(4096, one, tokens=10000)
    assert late(4096, one, "parallel.prefetch_after_attention=true")
    assert not late(4096, "parallel.prefetch_after_attention=false")
    assert not late(64, "parallel.prefetch_after_attention=false")
    assert not late(64, "parallel.fsdp_unit=linear") and not late(64, "parallel.prefetch=false")
    assert not late(64, "parallel.weights=replicated")
