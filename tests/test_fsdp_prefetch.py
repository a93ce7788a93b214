"""FSDP2's forward prefetch after each block's attention (`parallel.prefetch_after_attention`):
when the next unit's parameters are gathered, and that nothing else changes."""

from __future__ import annotations

import pytest

from tests.helpers.fsdp_order import gather_order
from tests.helpers.procs import run_ranks

AFTER_EACH_ATTENTION = ["attention 0", "gather block 1", "attention 1", "gather block 2",
                        "attention 2", "gather head", "backward"]  # fmt: skip


@pytest.mark.dist
def test_each_block_gathers_the_next_unit_after_its_attention_and_trains_the_same() -> None:
    """On 2 ranks: each block gathers the next unit (the head after the last block) once
    its attention has run, never again while a checkpointed block's forward runs once
    more in backward, and not at all by hand with the option off (FSDP2's own prefetch
    then gathers it when the block starts); the loss and gradients are the same."""
    on, off = (["parallel.prefetch_after_attention=" + value] for value in ("true", "false"))
    cases = (on, [*on, "train.activation_checkpointing=full"], off)
    after, checkpointed, at_start = (run_ranks(gather_order, 2, case)[0] for case in cases)
    assert after[0] == AFTER_EACH_ATTENTION
    assert checkpointed[0] == [*AFTER_EACH_ATTENTION, *["attention again"] * 3]
    assert at_start[0] == ["attention 0", "attention 1", "attention 2", "backward"]
    assert after[1:] == checkpointed[1:] == at_start[1:]


@pytest.mark.unit
def test_unset_it_gathers_after_attention_where_that_exposes_less() -> None:
    """Unset, the cost model decides (`ray_zep.prefetch_plan`): on cluster A, 7B at 4k
    tokens per GPU (L = 5,120), after attention on 64 and 1,024 GPUs, when the block starts
    on 4,096 (the gather's 16 ms of ring latency beside a feed-forward of 7 ms); a set
    value is kept; without FSDP's block units nothing is gathered by hand."""
    from ray_zep.config import load_config
    from ray_zep.model_shapes import build_shape
    from ray_zep.prefetch_plan import gathers_after_attention
    from ray_zep.topology import build_topology

    def late(gpus: int, *overrides: str) -> bool:
        config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                    "model.preset=7b", "train.tokens_per_rank=5120",
                                    "parallel.weights=fsdp", *overrides])  # fmt: skip
        topology, shape = build_topology(config.topology), build_shape(config.model)
        return gathers_after_attention(config.parallel, topology, shape, 4096, 2)

    assert late(64) and late(1024) and not late(4096)
    assert late(4096, "parallel.prefetch_after_attention=true")
    assert not late(64, "parallel.prefetch_after_attention=false")
    assert not late(64, "parallel.fsdp_unit=linear") and not late(64, "parallel.prefetch=false")
    assert not late(64, "parallel.weights=replicated")
