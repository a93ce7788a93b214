"""FSDP2's forward prefetch after each block's attention (`parallel.prefetch_after_attention`):
when the next unit's parameters are gathered, and that nothing else changes."""

from __future__ import annotations

import pytest

from tests.helpers.fsdp_order import gather_order
from tests.helpers.procs import run_ranks

pytestmark = pytest.mark.dist

AFTER_EACH_ATTENTION = ["attention 0", "gather block 1", "attention 1", "gather block 2",
                        "attention 2", "gather head", "backward"]  # fmt: skip


def test_each_block_gathers_the_next_unit_after_its_attention_and_trains_the_same() -> None:
    """On 2 ranks: each block gathers the next unit (the head after the last block) once
    its attention has run, never again while a checkpointed block's forward runs once
    more in backward, and not at all by hand with the option off (FSDP2's own prefetch
    then gathers it when the block starts); the loss and gradients are the same."""
    off = ["parallel.prefetch_after_attention=false"]
    cases = ([], ["train.activation_checkpointing=full"], off)
    after, checkpointed, at_start = (run_ranks(gather_order, 2, case)[0] for case in cases)
    assert after[0] == AFTER_EACH_ATTENTION
    assert checkpointed[0] == [*AFTER_EACH_ATTENTION, *["attention again"] * 3]
    assert at_start[0] == ["attention 0", "attention 1", "attention 2", "backward"]
    assert after[1:] == checkpointed[1:] == at_start[1:]
