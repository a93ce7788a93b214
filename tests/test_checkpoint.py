"""DCP checkpoints in one process: round trip, completeness, progress without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.errors import CheckpointError
from ray_zep.topology import build_topology
from ray_zep.train import checkpoint, checkpoint_dirs
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer

pytestmark = pytest.mark.unit


def _trainer(seed: int) -> RankTrainer:
    config = load_config(
        None, ["parallel.sequence=single", "model.n_layers=1", f"train.seed={seed}"]
    )
    comm = create_comm(config, build_topology(config.topology), 10.0)
    return RankTrainer(config, comm, torch.device("cpu"))


def _take_a_step(trainer: RankTrainer) -> None:
    tokens = torch.arange(8)
    logits = trainer.model(tokens, tokens, PackedSeqs.from_lengths([8]))
    logits.square().mean().backward()
    trainer.optimizer.step()
    trainer.steps_done += 1


def test_round_trip_restores_model_optimizer_rng_and_progress(tmp_path: Path) -> None:
    saved = _trainer(seed=0)
    _take_a_step(saved)
    torch.manual_seed(123)
    cursor = {"epoch": 1, "index": 7, "offset": 3}
    path = saved.save(tmp_path, cursor)
    rng_after_save = torch.rand(3)
    assert path == checkpoint_dirs.checkpoint_path(tmp_path, 1)

    restored = _trainer(seed=1)
    assert not torch.equal(restored.model.output.weight, saved.model.output.weight)
    progress = restored.load(path)
    assert progress == checkpoint.Progress(1, cursor)
    assert restored.steps_done == 1
    for (name, a), b in zip(
        saved.model.state_dict().items(), restored.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    state_a, state_b = saved.optimizer.state_dict(), restored.optimizer.state_dict()
    for key in state_a["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state_a["state"][key][field], state_b["state"][key][field])
    assert torch.equal(torch.rand(3), rng_after_save), "RNG state is part of the checkpoint"
    assert checkpoint.read_progress(path) == progress
    stored = checkpoint.read_model_state(path, _trainer(seed=2).model)
    for name, value in saved.model.state_dict().items():
        assert torch.equal(stored[name], value), name


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    trainer = _trainer(seed=0)
    trainer.steps_done = 2
    complete = trainer.save(tmp_path, {"epoch": 0, "index": 1, "offset": 0})
    torn = checkpoint_dirs.checkpoint_path(tmp_path, 5)
    torn.mkdir(parents=True)
    assert checkpoint_dirs.latest_checkpoint(tmp_path) == complete
    with pytest.raises(CheckpointError, match="is incomplete"):
        checkpoint.read_progress(torn)
    assert checkpoint_dirs.latest_checkpoint(tmp_path / "elsewhere") is None


class _RunsCode:
    """Unpickling this would run a command: a checkpoint must never do that."""

    def __reduce__(self):
        return (print, ("code ran while loading a checkpoint",))


def test_a_checkpoint_holding_code_is_refused_not_run(tmp_path: Path, capsys, monkeypatch) -> None:
    trainer = _trainer(seed=0)
    # a tampered file: the progress item holds a pickled callable
    monkeypatch.setattr(
        checkpoint, "_progress_state", lambda progress: {"step": 0, "cursor": _RunsCode()}
    )
    path = trainer.save(tmp_path, {"epoch": 0})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"'progress.cursor' is not plain data.*GLOBAL"):
        checkpoint.read_progress(path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        trainer.load(path)
    assert "code ran" not in capsys.readouterr().out


def test_expert_parallel_degree_mismatch_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(seed=0)
    path = trainer.save(tmp_path, {})
    (path / "COMPLETE").write_text('{"step": 0, "world_size": 4, "ep": 2}\n')
    with pytest.raises(CheckpointError, match=r"saved with parallel.ep=2, this run has"):
        trainer.load(path)


def test_topology_of_single_is_only_the_batch_size() -> None:
    config = load_config(
        None, ["parallel.sequence=single", "topology.nodes=2", "topology.gpus_per_node=4"]
    )
    comm = create_comm(config, build_topology(config.topology), 10.0)
    assert (comm.world_size, comm.distributed) == (1, False)


def test_a_run_without_save_last_keeps_only_its_periodic_checkpoints(tmp_path: Path) -> None:
    from tests.helpers.training import SMALL_RUN, train_rank

    run = [*SMALL_RUN, "parallel.sequence=single", "train.steps=3", "train.checkpoint_every=2",
           "train.save_last=false", f"train.out_dir={tmp_path}"]  # fmt: skip
    assert sorted(train_rank(0, 1, run)["losses"]) == [1, 2, 3]
    assert checkpoint_dirs.latest_checkpoint(tmp_path) == checkpoint_dirs.checkpoint_path(
        tmp_path, 2
    )


def test_keep_checkpoints_deletes_the_oldest_complete_ones_and_older_torn_saves(
    tmp_path: Path,
) -> None:
    root = checkpoint_dirs.checkpoint_root(tmp_path)
    for step in (2, 4, 5, 6, 8, 9):
        folder = checkpoint_dirs.checkpoint_path(tmp_path, step)
        folder.mkdir(parents=True)
        if step not in (5, 9):  # 5 and 9 are interrupted saves
            (folder / "COMPLETE").write_text("{}")
    assert checkpoint_dirs.prune_checkpoints(tmp_path, keep=0) == []
    deleted = checkpoint_dirs.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_00000002", "step_00000004", "step_00000005"]
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step_00000006", "step_00000008", "step_00000009"], "9 may be being written"
    assert checkpoint_dirs.latest_checkpoint(tmp_path) == checkpoint_dirs.checkpoint_path(
        tmp_path, 8
    )


def test_a_run_keeps_its_newest_checkpoints_and_resumes_from_them(tmp_path: Path) -> None:
    from tests.helpers.training import SMALL_RUN, train_rank

    run = [*SMALL_RUN, "parallel.sequence=single", "train.steps=5", "train.checkpoint_every=1",
           "train.keep_checkpoints=2", f"train.out_dir={tmp_path}"]  # fmt: skip
    assert sorted(train_rank(0, 1, run)["losses"]) == [1, 2, 3, 4, 5]
    left = sorted(p.name for p in checkpoint_dirs.checkpoint_root(tmp_path).iterdir())
    assert left == ["step_00000004", "step_00000005"]
