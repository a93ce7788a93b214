"""`train.eval_every`: the validation loss on held-out data while training, under FSDP2.

Rank 0 evaluates the checkpoint of the step in one process, as `ray-zep eval` does:
the loss it reports must be what `ray-zep eval --run` computes on that checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.errors import ConfigError
from ray_zep.train import checkpoint_dirs
from ray_zep.train.evaluate import run_eval
from ray_zep.train.restore import ModelSource
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, mixed_dataset, train_rank


@pytest.mark.dist
def test_fsdp_training_reports_the_held_out_loss_eval_computes(tmp_path: Path) -> None:
    held_out = mixed_dataset(tmp_path / "held_out.parquet")
    overrides = [
        *SMALL_RUN,
        "topology.gpus_per_node=2",
        "parallel.weights=fsdp",
        "train.steps=2",
        "train.eval_every=1",
        "train.eval_batches=2",
        f"data.eval_source={held_out}",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    events = run_ranks(train_rank, 2, overrides)[0]["events"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [1, 2]
    assert all(math.isfinite(e["loss"]) and e["label_tokens"] > 0 for e in evals)
    assert evals[0]["loss"] != evals[1]["loss"], "a step of training moves the loss"

    config = load_config(None, [*overrides, f"data.source={held_out}"])
    step_two = checkpoint_dirs.checkpoint_path(tmp_path / "run", 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rank ran it: a kernel's sums split by thread count
    try:  # (a 2-thread eval on an AMD EPYC differed by 4e-10 relative)
        again = run_eval(ModelSource(config, step_two), 2)
    finally:
        torch.set_num_threads(threads)
    assert evals[1]["loss"] == pytest.approx(again.loss, rel=1e-12)
    assert evals[1]["label_tokens"] == again.label_tokens


@pytest.mark.unit
def test_evaluation_needs_held_out_data() -> None:
    with pytest.raises(ConfigError, match=r"train\.eval_every=5: .*data\.eval_source"):
        load_config(None, ["train.eval_every=5"])
    with pytest.raises(ConfigError, match=r"train\.eval_batches"):
        load_config(None, ["train.eval_batches=-1"])
