"""`ray-zep bench scale-replay`: a `bench scale` record's rows played again at the rooms
they kept, beside the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_zep.bench import scale_replay
from ray_zep.cli import main

pytestmark = pytest.mark.unit


def test_a_replayed_row_plays_as_recorded_and_says_what_moved(tmp_path: Path, capsys) -> None:
    """7B chat at 64 GPUs, `--room 1,1.5 --kv-room model,0`: the replay plays the row at the
    L and K/V room the grid kept, once, and steps as recorded; a record whose step / bound
    is edited shows the move in the footer."""
    grid = ["bench", "scale", "--gpus", "64", "--models", "7b", "--tokens", "4k",
            "--distributions", "chat", "--placements", "zeppelin", "--room", "1,1.5",
            "--kv-room", "model,0", "--out", str(tmp_path / "grid")]  # fmt: skip
    assert main(grid) == 0
    record = tmp_path / "grid" / "scale.json"
    (kept,) = json.loads(record.read_text())["rows"]
    assert main(["bench", "scale-replay", str(record), "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    (row,) = json.loads((tmp_path / "again" / "scale-replay.json").read_text())["rows"]
    assert (row["tokens_per_rank"], row["kv_room_mb"]) == (kept["tokens_per_rank"],
                                                           kept["kv_room_mb"])  # fmt: skip
    assert row["step_s"] == pytest.approx(kept["step_s"], rel=1e-12)
    ratio = kept["step_over_bound"]
    assert f"1 rows: mean {ratio:.4f} -> {ratio:.4f}" in out
    edited = json.loads(record.read_text())
    edited["rows"][0]["step_over_bound"] = ratio + 0.01
    record.write_text(json.dumps(edited))
    assert main(["bench", "scale-replay", str(record), "--out", str(tmp_path / "edited")]) == 0
    assert f"64 GPUs chat 7b zeppelin: {ratio + 0.01:.4f} -> {ratio:.4f}" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["[1, 2]", '{"rows": []}', "not json"])
def test_a_file_that_is_no_scale_record_is_one_line(tmp_path: Path, capsys, text: str) -> None:
    path = tmp_path / "record.json"
    path.write_text(text)
    assert main(["bench", "scale-replay", str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "scale-replay RECORD" in err and str(path) in err


def test_the_headroom_gives_the_recorded_l() -> None:
    for capacity, tokens in [(5120, 4096), (7000, 3000), (10001, 4097), (35840, 16384)]:
        headroom = scale_replay.headroom_for(capacity, tokens)
        assert headroom >= 1.0 and -(-tokens * headroom // 1) == capacity


GRID = ["bench", "scale", "--gpus", "64", "--models", "7b", "--tokens", "4k",
        "--distributions", "chat", "--placements", "zeppelin"]  # fmt: skip


def test_overrides_play_in_every_case_and_again_in_its_replay(tmp_path: Path, capsys) -> None:
    """A grid under `parallel.weights=hsdp` keeps the override in its record and steps
    apart from the grid without it; its replay plays the override again and steps as
    recorded, and a replay given one more override plays both and says so."""
    assert main([*GRID, "--out", str(tmp_path / "fsdp")]) == 0
    assert main([*GRID, "parallel.weights=hsdp", "--out", str(tmp_path / "hsdp")]) == 0
    assert "every case under: parallel.weights=hsdp" in capsys.readouterr().out
    record = tmp_path / "hsdp" / "scale.json"
    grid = json.loads(record.read_text())
    assert grid["spec"]["overrides"] == ["parallel.weights=hsdp"]
    (fsdp,) = json.loads((tmp_path / "fsdp" / "scale.json").read_text())["rows"]
    (hsdp,) = grid["rows"]
    assert hsdp["step_s"] != pytest.approx(fsdp["step_s"], rel=1e-6)
    assert main(["bench", "scale-replay", str(record), "--out", str(tmp_path / "again")]) == 0
    (again,) = json.loads((tmp_path / "again" / "scale-replay.json").read_text())["rows"]
    assert again["step_s"] == pytest.approx(hsdp["step_s"], rel=1e-12)
    capsys.readouterr()
    more = ["bench", "scale-replay", str(record), "comm.compression=always",
            "--out", str(tmp_path / "zipped")]  # fmt: skip
    assert main(more) == 0
    out = capsys.readouterr().out
    assert "every case under: parallel.weights=hsdp comm.compression=always" in out
    assert "against the record (now with comm.compression=always), 1 rows" in out
    zipped = json.loads((tmp_path / "zipped" / "scale-replay.json").read_text())
    assert zipped["spec"]["overrides"] == ["comm.compression=always"]
    assert zipped["rows"][0]["step_s"] != pytest.approx(hsdp["step_s"], rel=1e-6)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("parallel.sequence=ulysses", "the grid sets parallel.sequence (--placements)"),
        ("model.n_layers=4", "the grid sets model.n_layers (--models)"),
        ("train.micro_batches=2", "the grid sets train.micro_batches (--micro-batches)"),
        ("parallel.ring_kv_room_mb=0", "the grid sets parallel.ring_kv_room_mb (--kv-room)"),
        ("parallel.weights=tawpipe", "`ray-zep bench tawpipe` plays weight passing"),
        ("parallel.nonsense=1", "unknown config key 'parallel.nonsense'"),
        ("comm.compression=maybe", "comm.compression"),
        ("topology.nics_per_node=8", "topology.nics_per_node=8 contradicts"),
        ("data.source=synthetic:arxiv", "the grid sets data.source (--distributions"),
    ],
)
def test_an_override_the_grid_cannot_play_is_one_line_before_any_case(
    tmp_path: Path, capsys, override: str, named: str
) -> None:
    record = tmp_path / "scale.json"
    row = {"placement": "zeppelin", "gpus": 64, "distribution": "chat", "model": "7b",
           "tokens_per_gpu": 4096, "tokens_per_rank": 5120}  # fmt: skip
    record.write_text(json.dumps({"spec": {"tokens_per_gpu": [4096]}, "rows": [row]}))
    for command in ([*GRID, override], ["bench", "scale-replay", str(record), override]):
        assert main([*command, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and named in err and command[1] in err, err
    assert not (tmp_path / "out").exists()


def test_the_replay_plays_only_the_rows_its_filters_pick(tmp_path: Path, capsys) -> None:
    """Of a record's 7b chat and github rows at 64 GPUs, `--distributions github` plays the
    github row alone and says so in its spec; filters that leave no row are one line naming
    them, before any row plays."""
    case = {"placement": "zeppelin", "gpus": 64, "model": "7b", "tokens_per_gpu": 4096,
            "tokens_per_rank": 5120}  # fmt: skip
    rows = [dict(case, distribution=name) for name in ("chat", "github")]
    record = tmp_path / "scale.json"
    record.write_text(json.dumps({"spec": {"tokens_per_gpu": [4096]}, "rows": rows}))
    picked = ["bench", "scale-replay", str(record), "--distributions", "github"]
    assert main([*picked, "--out", str(tmp_path / "github")]) == 0
    played = json.loads((tmp_path / "github" / "scale-replay.json").read_text())
    assert [row["distribution"] for row in played["rows"]] == ["github"]
    assert played["spec"]["distributions"] == ["github"]
    capsys.readouterr()
    none = ["bench", "scale-replay", str(record), "--gpus", "1024", "--models", "7b"]
    assert main([*none, "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no row of --placements zeppelin --gpus 1024 --models 7b" in err
    assert not (tmp_path / "none").exists()
