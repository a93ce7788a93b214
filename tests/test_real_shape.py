"""The closing summary's real shape: a run's document lengths on a 7B model at cluster
scale, modelled as `ray-zep bench scale` models its grid."""

from __future__ import annotations

import math
from unittest.mock import patch

import numpy as np
import pytest

from ray_zep.bench import real_shape
from ray_zep.bench.real_shape import (
    ROOMS,
    TOKENS_PER_GPU,
    compared_placements,
    real_shape_lines,
    real_shape_rows,
)
from ray_zep.bench.scale import ScaleBenchSpec
from ray_zep.config import load_config
from ray_zep.data.synthetic import drawn_batch_lengths
from ray_zep.errors import ConfigError
from ray_zep.sim.token_room import ROOM_MOST, ROOM_STEP

pytestmark = pytest.mark.unit


def test_a_drawn_batch_holds_exactly_its_tokens_from_the_documents() -> None:
    documents = np.asarray([3, 500, 70_000, 0])
    batch = drawn_batch_lengths(documents, 200_000, seed=1)
    assert batch.sum() == 200_000
    assert set(batch[:-1].tolist()) <= {3, 500, 70_000}  # the last one is cut to fit
    assert np.array_equal(batch, drawn_batch_lengths(documents, 200_000, seed=1))
    with pytest.raises(ConfigError):
        drawn_batch_lengths(np.zeros(3), 10, seed=0)


def test_the_runs_documents_at_64_gpus_compare_the_three_placements() -> None:
    """Each placement at the fastest fitting token room `plan --auto` searches: no slower
    than at the default L alone (on the demo's documents Megatron-LM's dynamic CP is faster
    at a larger L), and the room it ran at printed beside its step."""
    config = load_config("conf/demo.yaml", [])
    rows = real_shape_rows(config, [64])
    assert [r.placement for r in rows] == list(compared_placements())
    factors = (*ROOMS, *np.arange(max(ROOMS), ROOM_MOST, ROOM_STEP) + ROOM_STEP)  # no halvings
    rooms = {math.ceil(TOKENS_PER_GPU * ScaleBenchSpec.headroom * f) for f in factors}
    with patch.object(real_shape, "ROOMS", (1.0,)), patch.object(real_shape, "ROOM_MOST", 1.0):
        alone = real_shape_rows(config, [64])  # the default L alone
    for row, at_default in zip(rows, alone, strict=True):
        assert row.error is None and row.gpus == 64 and row.distribution == "stdlib"
        assert row.step_over_bound >= 1.0 and row.tokens_per_s_per_gpu > 0
        assert row.tokens_per_rank in rooms and row.fits == "yes"
        assert row.step_s <= at_default.step_s
    assert any(row.step_s < at_default.step_s and row.tokens_per_rank > at_default.tokens_per_rank
               for row, at_default in zip(rows, alone, strict=True))  # fmt: skip
    lines = real_shape_lines(rows)
    assert lines[0].startswith("modelled at a real shape") and lines[1] == "  64 GPUs:"
    ours = rows[0].placement
    for row in rows[1:]:
        assert f"{ours} {row.step_s / rows[0].step_s:.2f}x faster" in "\n".join(lines)
    for row, line in zip(rows, lines[2:], strict=True):
        assert line.startswith(f"    {row.placement}: {row.step_s:,.2f} s/step at L = "
                               f"{row.tokens_per_rank:,}, ")  # fmt: skip


def test_summary_sizes_are_whole_nodes() -> None:
    with pytest.raises(ConfigError, match=r"metrics\.summary_gpus"):
        load_config("conf/demo.yaml", ["metrics.summary_gpus=[60]"])
    assert load_config("conf/demo.yaml", ["metrics.summary_gpus=[]"]).metrics.summary_gpus == []
