"""The Ray layer end to end: driver, data actor and Ray Train workers on a local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from ray_zep.config import load_config
from ray_zep.errors import OverlongDocumentError
from ray_zep.train.checkpoint import checkpoint_path
from tests.helpers.training import SMALL_RUN, checkpoint_params, jsonl_losses, max_relative_error
from workers.driver import train

pytestmark = pytest.mark.ray

# See tests/test_train_dist.py for why fp32 dp and single agree to ~1e-6 and not bit for bit.
REL_TOL = 1e-5
BASE = [
    *SMALL_RUN,
    "topology.nodes=2",
    "topology.gpus_per_node=2",
    "metrics.port=-1",
    "train.checkpoint_every=2",
]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=6, object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    yield
    ray.shutdown()


def _train(out: Path, *overrides: str):
    return train(load_config(None, [*BASE, f"train.out_dir={out}", *overrides]))


def test_dp_on_ray_matches_single_and_resumes_exactly(tmp_path: Path) -> None:
    dp = _train(tmp_path / "dp", "train.steps=4")
    single = _train(tmp_path / "single", "train.steps=4", "parallel.strategy=single")
    assert (dp.first_step, dp.last_step) == (0, 4)

    dp_losses, single_losses = jsonl_losses(dp.run_dir), jsonl_losses(single.run_dir)
    assert sorted(dp_losses) == [1, 2, 3, 4]
    for step, loss in single_losses.items():
        assert dp_losses[step] == pytest.approx(loss, rel=REL_TOL), f"loss of step {step}"
    dp_params = checkpoint_params(checkpoint_path(dp.run_dir, 4), BASE)
    single_params = checkpoint_params(checkpoint_path(single.run_dir, 4), BASE)
    err, name = max_relative_error(dp_params, single_params)
    assert err <= REL_TOL, f"parameter {name}: relative error {err:.2e}"

    first = _train(tmp_path / "resumed", "train.steps=2")
    second = _train(tmp_path / "resumed", "train.steps=4")
    assert (first.last_step, second.first_step, second.last_step) == (2, 2, 4)
    assert jsonl_losses(second.run_dir) == dp_losses, "the data actor must rewind to the cursor"
    resumed_params = checkpoint_params(checkpoint_path(second.run_dir, 4), BASE)
    for key, value in dp_params.items():
        assert torch.equal(resumed_params[key], value), key


def test_a_data_error_during_training_reaches_the_driver_typed(tmp_path: Path) -> None:
    with pytest.raises(OverlongDocumentError, match=r"data\.overlong=error"):
        _train(
            tmp_path,
            "train.steps=30",
            "data.source=synthetic:github",
            "data.length_scale=1.0",
            "data.overlong=error",
        )
