"""The closing summary's real shape: a run's document lengths on a 7B model at cluster
scale, modelled as `ray-zep bench scale` models its grid."""

from __future__ import annotations

import numpy as np
import pytest

from ray_zep.bench.real_shape import compared_placements, real_shape_lines, real_shape_rows
from ray_zep.config import load_config
from ray_zep.data.synthetic import drawn_batch_lengths
from ray_zep.errors import ConfigError

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
    config = load_config("conf/zeppelin.yaml", ["data.source=synthetic:github"])
    rows = real_shape_rows(config, [64])
    assert [r.placement for r in rows] == list(compared_placements())
    for row in rows:
        assert row.error is None and row.gpus == 64 and row.distribution == "synthetic:github"
        assert row.step_over_bound >= 1.0 and row.tokens_per_s_per_gpu > 0
    lines = real_shape_lines(rows)
    assert lines[0].startswith("modelled at a real shape") and lines[1] == "  64 GPUs:"
    ours = rows[0].placement
    for row in rows[1:]:
        assert f"{ours} {row.step_s / rows[0].step_s:.2f}x faster" in "\n".join(lines)


def test_summary_sizes_are_whole_nodes() -> None:
    with pytest.raises(ConfigError, match=r"metrics\.summary_gpus"):
        load_config("conf/demo.yaml", ["metrics.summary_gpus=[60]"])
    assert load_config("conf/demo.yaml", ["metrics.summary_gpus=[]"]).metrics.summary_gpus == []
