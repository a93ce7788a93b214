"""`ray-zep bench scale`: the grid runs, every column is filled where it applies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ray_zep.bench.scale import COLUMNS, ScaleBenchSpec, kv_rooms, run_scale_bench
from ray_zep.bench.scale_play import filled_config
from ray_zep.cli import main
from ray_zep.config import Packing, load_config
from ray_zep.errors import ConfigError
from ray_zep.prefetch_plan import run_gathers_after_attention
from ray_zep.report.text_table import render_table
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.topology import build_topology
from tests.helpers.scenarios import WHOLE_EXCHANGES

pytestmark = pytest.mark.unit


def test_scale_bench_fills_each_placements_columns(tmp_path: Path, capsys) -> None:
    argv = ["bench", "scale", "--gpus", "64", "--models", "7b", "--tokens", "4k",
            "--distributions", "prolong64k",
            "--placements", "zeppelin,zeppelin+cost,megatron_hybrid_cp",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "zeppelin+cost" in out and "x ideal" in out
    assert "64 GPUs prolong64k 7b 4k/GPU: " in out  # progress while it runs
    rows = {r["placement"]: r for r in json.loads((tmp_path / "scale.json").read_text())["rows"]}
    for name in ("zeppelin", "zeppelin+cost"):
        row = rows[name]
        assert row["error"] is None
        assert 1.0 <= row["work_mean"] <= row["work_worst"]
        assert row["step_over_ideal"] > 1.0 and row["tokens_per_s_per_gpu"] > 0
        assert row["inter_node_gb"] > 0 and row["planner_ms"] > 0
        assert 0 < row["peak_memory_gb"] < 80
        ends = row["phase_ends"]  # where the first batch's forward and backward end
        assert [e["phase"] for e in ends] == ["forward", "backward"]
        assert all(e["holds"] and 0 <= e["rank"] < 64 for e in ends)
        assert sum(row["gpu_time"].values()) == pytest.approx(1.0, abs=1e-9)  # every rank's
    # the balanced placement's level: kept at or above the mean, and at the mean the rings
    # of this batch need more ranks than the 64 there are (`ray-zep plan`'s level trace)
    assert rows["zeppelin"]["level"] >= 1.0 and rows["zeppelin"]["rings_at_mean"] > 1.0
    assert rows["zeppelin+cost"]["level"] is None  # the cost policy scans no levels
    # the work policy's (the default's) busiest rank carries less work: the prolong64k
    # batch is the one the simulator shows it faster on (tests/test_balance.py)
    assert rows["zeppelin"]["step_s"] < rows["zeppelin+cost"]["step_s"]
    megatron = rows["megatron_hybrid_cp"]
    assert megatron["step_s"] > 0 and megatron["work_mean"] is None
    assert (tmp_path / "scale.png").exists() or "skipped" in out


def test_plan_only_times_the_plans_without_simulating(tmp_path: Path, capsys) -> None:
    argv = ["bench", "scale", "--gpus", "64", "--models", "7b", "--tokens", "4k",
            "--distributions", "chat", "--plan-only", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert "megatron_hybrid_cp" not in {r["placement"] for r in rows}, "it has no plan"
    assert {"zeppelin", "zeppelin+cost", "bytescale_hdp"} <= {r["placement"] for r in rows}
    for row in rows:
        assert row["step_s"] is None and row["tokens_per_s_per_gpu"] is None
        assert row["planner_ms"] > 0 and row["work_mean"] >= 1.0
    assert "plan ms" in capsys.readouterr().out
    # a second run into the folder, its record named: its picture beside it, the first kept
    first = (tmp_path / "scale.png").read_bytes() if (tmp_path / "scale.png").exists() else None
    assert main([*argv[:-2], "--gpus", "128", "--out", str(tmp_path),
                 "--json", str(tmp_path / "scale_128.json")]) == 0  # fmt: skip
    if first is not None:  # matplotlib installed
        assert (tmp_path / "scale_128.png").exists()
        assert (tmp_path / "scale.png").read_bytes() == first


def test_plan_repeats_time_the_same_plan_again() -> None:
    """`--plan-repeats`: each batch planned again for the planner's time (the median);
    the plan columns are the first plan's, the same as one call's."""
    cases = dict(gpus=(64,), distributions=("arxiv",), models=("7b",), tokens_per_gpu=(4096,),
                 placements=("zeppelin",), plan_only=True)  # fmt: skip
    (once,) = run_scale_bench(ScaleBenchSpec(**cases), progress=lambda line: None)
    (thrice,) = run_scale_bench(ScaleBenchSpec(**cases, plan_repeats=3), progress=lambda line: None)
    assert thrice.planner_ms > 0
    for column in ("work_mean", "work_worst", "level", "inter_node_gb", "peak_memory_gb"):
        assert getattr(thrice, column) == getattr(once, column), column


@pytest.mark.parametrize(
    "bad",
    [
        dict(gpus=(60,)),
        dict(distributions=("nope",)),
        dict(placements=("zeppelin+x",)),
        dict(batches=0),
        dict(plan_only=True, placements=("megatron_hybrid_cp",)),
        dict(room=(0.5,)),
        dict(room=()),
        dict(plan_only=True, room=(1.0, 1.5)),
        dict(plan_only=True, kv_room=(None, 0.0)),
        dict(plan_repeats=0),
    ],
)
def test_scale_bench_refuses_bad_options(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ScaleBenchSpec(**bad)


def test_scale_table_marks_missing_columns() -> None:
    rows = run_scale_bench(
        ScaleBenchSpec(gpus=(64,), distributions=("arxiv",), models=("7b",),
                       tokens_per_gpu=(4096,), placements=("megatron_hybrid_cp",)),
        progress=lambda line: None,
    )  # fmt: skip
    header, _rule, line = render_table(rows, COLUMNS).splitlines()
    names = [cell.strip() for cell in header.strip("|").split("|")]
    cells = dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
    assert cells["placement"] == "megatron_hybrid_cp" and cells["work m/m"] == "-"
    assert cells["ckpt"] == "none" and cells["fits"] == "yes"  # its fullest wave's memory


def test_rows_that_do_not_fit_checkpoint_and_pay_for_it() -> None:
    """At 20k tokens per GPU no activation checkpointing leaves a 7B rank over 80 GB;
    the row checkpoints the fewest first blocks that fit (not every block: a rank of
    20k tokens has room to keep some), and its step counts the recompute."""
    spec = ScaleBenchSpec(gpus=(64,), distributions=("arxiv",), models=("7b",),
                          tokens_per_gpu=(20480,), placements=("zeppelin",),
                          micro_batches=1)  # fmt: skip
    (row,) = run_scale_bench(spec, progress=lambda line: None)
    mode, blocks = row.checkpointing.split()
    blocks, _, rest = blocks.partition("+")  # "linears 9/32+selective": selective after them
    checkpointed, layers = map(int, blocks.split("/"))
    assert mode in ("selective", "linears", "full"), row.checkpointing
    assert 0 < checkpointed < layers == 32, row.checkpointing
    assert rest in ("", "selective"), row.checkpointing
    assert row.fits == "yes" and row.peak_memory_gb < 80
    plain = ScaleBenchSpec(gpus=(64,), distributions=("arxiv",), models=("7b",),
                           tokens_per_gpu=(4096,), placements=("zeppelin",))  # fmt: skip
    (small,) = run_scale_bench(plain, progress=lambda line: None)
    assert small.checkpointing == "none"


def test_room_keeps_the_fastest_l_that_fits() -> None:
    """`--room 1,1.5`: each row is the faster of L = 5,120 and L = 7,680 on the same batch,
    as the two played apart give them, and says which L it ran at."""
    cases = dict(gpus=(64,), distributions=("github",), models=("7b",), tokens_per_gpu=(4096,),
                 placements=("zeppelin", "megatron_dynamic_cp"))  # fmt: skip
    quiet = lambda line: None  # noqa: E731
    both = run_scale_bench(ScaleBenchSpec(**cases, room=(1.0, 1.5)), progress=quiet)
    small = run_scale_bench(ScaleBenchSpec(**cases), progress=quiet)
    large = run_scale_bench(ScaleBenchSpec(**cases, headroom=1.875), progress=quiet)
    for row, one, other in zip(both, small, large, strict=True):
        assert {one.tokens_per_rank, other.tokens_per_rank} == {5120, 7680}
        fitting = [r for r in (one, other) if r.fits == "yes"]
        kept = min(fitting, key=lambda r: r.step_s)
        assert (row.step_s, row.tokens_per_rank) == (kept.step_s, kept.tokens_per_rank)


def test_room_up_to_plays_the_rooms_next_to_the_fastest(monkeypatch) -> None:
    """`--room 1.25 --room-up-to 2` on 7B chat at 64 GPUs: L = 6,400 is played, then 7,680
    next to it, which wins, then 8,960 next to that, which loses; 6,400 below it was
    played, so the ladder stops and the gaps beside the fastest are halved: above (x 1.625,
    then 1.5625, both lose), then below (x 1.375 loses, 1.4375 wins: L = 7,360, as played
    apart); its gaps are then a sixteenth, and the search stops. Up to 1.25, nothing more
    is played."""
    from ray_zep.bench import scale

    cases = dict(gpus=(64,), distributions=("chat",), models=("7b",), tokens_per_gpu=(4096,),
                 placements=("zeppelin",), overrides=(WHOLE_EXCHANGES,))  # fmt: skip
    quiet = lambda line: None  # noqa: E731
    played = []
    case_at = scale.case_at
    monkeypatch.setattr(scale, "case_at", lambda spec, *a, **k: played.append(
        round(spec.headroom / 1.25, 2)) or case_at(spec, *a, **k))  # fmt: skip
    (row,) = run_scale_bench(ScaleBenchSpec(**cases, room=(1.25,), room_up_to=2.0),
                             progress=quiet)  # fmt: skip
    assert played == [1.25, 1.5, 1.75, 1.62, 1.56, 1.38, 1.44]
    (apart,) = run_scale_bench(ScaleBenchSpec(**cases, headroom=1.25 * 1.4375), progress=quiet)
    assert (row.tokens_per_rank, row.step_s) == (7360, apart.step_s)
    played.clear()
    (kept,) = run_scale_bench(ScaleBenchSpec(**cases, room=(1.25,), room_up_to=1.25),
                              progress=quiet)  # fmt: skip
    assert played == [1.25] and kept.tokens_per_rank == 6400 and kept.step_s > row.step_s
    with pytest.raises(ConfigError, match="--room-halvings -1"):
        ScaleBenchSpec(**cases, room=(1.25,), room_up_to=2.0, room_halvings=-1)
    with pytest.raises(ConfigError, match=r"--room-up-to 1\.0"):
        ScaleBenchSpec(**cases, room=(1.0, 1.25), room_up_to=1.0)
    with pytest.raises(ConfigError, match="--room"):
        ScaleBenchSpec(**cases, plan_only=True, room_up_to=2.0)


def test_kv_room_keeps_the_faster_of_the_memory_models_room_and_none() -> None:
    """`--kv-room model,0` on 13B chat at 64 GPUs, L = 7,680: the planner holding a kept
    ring's room free on its members (the memory model's MB a token) and the planner
    filling them (`keep_where_room` keeping where room is left) end differently; the row
    is the faster of the two played apart and says which it ran with."""
    cases = dict(gpus=(64,), distributions=("chat",), models=("13b",), tokens_per_gpu=(4096,),
                 placements=("zeppelin",), headroom=1.875)  # fmt: skip
    quiet = lambda line: None  # noqa: E731
    (both,) = run_scale_bench(ScaleBenchSpec(**cases, kv_room=(None, 0.0)), progress=quiet)
    (held,) = run_scale_bench(ScaleBenchSpec(**cases), progress=quiet)
    (filled,) = run_scale_bench(ScaleBenchSpec(**cases, kv_room=(0.0,)), progress=quiet)
    assert (held.kv_room_mb, filled.kv_room_mb) == (None, 0.0)
    assert held.step_s != filled.step_s, "the two rooms plan this batch apart"
    kept = min((held, filled), key=lambda r: r.step_s)
    assert (both.step_s, both.kv_room_mb) == (kept.step_s, kept.kv_room_mb)
    assert kv_rooms("model, 0,2.5") == (None, 0.0, 2.5)
    with pytest.raises(ConfigError, match="--kv-room item 'all'"):
        kv_rooms("model,all")


def test_a_rows_config_says_how_full_its_batches_are() -> None:
    """The batches fill L x 1 / headroom a rank, budget-packed, as `plan --auto` says it for
    the same batches at more token room: FSDP2's gathers are then timed for the tokens a
    rank holds (at 4,096 GPUs of 13B, L = 1.5625 x 4k: when the block starts, the gather's
    ring steps, 16 ms, too long for a feed-forward of 4k tokens to hide; read at L, the
    rule gathered after attention, two blocks ahead)."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=512",
                                "model.preset=13b", "train.tokens_per_rank=6400",
                                "parallel.weights=fsdp"])  # fmt: skip
    hardware = Hardware.preset(build_topology(config.topology))
    plain = variant_config(config, "zeppelin", 6400)
    batches = [np.full(4096 * 4096 // 8192, 8192, dtype=np.int64)] * 2
    filled = filled_config(plain, batches, hardware.devices)
    assert filled.data.packing is Packing.BUDGET
    assert filled.data.batch_fill == pytest.approx(4096 / 6400)
    shape = RunModel.create(plain, hardware).shape
    late = [run_gathers_after_attention(c, hardware.topology, shape, 2) for c in (plain, filled)]
    assert late == [True, False]
    # whole sequences are packed by rank: their config stays as it is
    assert config.parallel.sequence.value == "whole"
    assert filled_config(config, batches, hardware.devices) is config
