"""`ray-zep bench partition`: every case measured, errors kept as rows, JSON and PNG written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ray_zep.bench.partition import (
    PLANNERS,
    PartitionBenchSpec,
    run_partition_bench,
    synthetic_lengths,
)
from ray_zep.cli import main
from ray_zep.config import load_config
from ray_zep.errors import ConfigError
from tests.helpers.pictures import read_png

pytestmark = pytest.mark.unit

CLUSTER_A_7B = ["topology.preset=cluster_a", "model.preset=7b"]


def test_short_batches_hold_thousands_of_sequences_and_exact_tokens() -> None:
    lengths = synthetic_lengths("short", 256 * 1024, seed=3)
    assert lengths.sum() == 256 * 1024 and len(lengths) > 1000
    assert lengths.min() >= 1 and lengths.max() <= 256


def test_rows_cover_every_case_and_keep_errors() -> None:
    spec = PartitionBenchSpec(
        nodes=(2, 3),
        tokens=(16 * 1024,),
        distributions=("arxiv", "short"),
        planners=("zeppelin", "te_cp", "ulysses"),
        batches=2,
        repeats=2,
    )
    lines: list[str] = []
    rows = run_partition_bench(load_config(None, CLUSTER_A_7B), spec, lines.append)
    assert len(rows) == 2 * 2 * 3 and len(lines) == 4
    by_key = {(r.distribution, r.nodes, r.planner): r for r in rows}
    for distribution in ("arxiv", "short"):
        for nodes in (2, 3):
            zeppelin = by_key[(distribution, nodes, "zeppelin")]
            te_cp = by_key[(distribution, nodes, "te_cp")]
            assert te_cp.inter_vs_te_cp == 1.0
            assert zeppelin.inter_node_gb < te_cp.inter_node_gb
            assert zeppelin.planner_p50_ms > 0 and zeppelin.max_tokens_over_l <= 1.0
            assert zeppelin.tokens_per_rank == int(np.ceil(16 * 1024 / (nodes * 8) * 1.25))
    # 32 heads do not divide over 24 ranks: the row says why instead of a number.
    assert "n_heads=32" in by_key[("arxiv", 3, "ulysses")].error
    assert by_key[("arxiv", 2, "ulysses")].error is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("distributions", ("wiki",)), ("planners", ("ring",)), ("headroom", 0.5), ("batches", 0)],
)
def test_bad_spec_names_the_flag(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field.rstrip("s")):
        PartitionBenchSpec(**{field: value})


def test_command_writes_table_json_and_png(tmp_path: Path, capsys) -> None:
    argv = ["bench", "partition", "--nodes", "2", "--tokens", "8k", "--batches", "1"]
    argv += ["--repeats", "1", "--distributions", "github", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "zeppelin_capacity" in out and "te_cp" in out
    record = json.loads((tmp_path / "partition.json").read_text())
    # one row per planner the registry lists for this bench (one case)
    assert record["machine"]["cpu_count"] >= 1 and len(record["rows"]) == len(PLANNERS)
    assert len(PLANNERS) >= 7
    assert {"planner_p50_ms", "flops_max_over_mean", "inter_node_gb"} <= set(record["rows"][0])
    pixels = read_png(tmp_path / "partition.png")
    assert pixels.shape[1] == 1210 and (pixels != 255).any()  # 11 inches at 110 dpi


@pytest.mark.parametrize(("flag", "value"), [("--tokens", "8k,abc"), ("--nodes", "0")])
def test_bad_command_lists_name_their_flag(capsys, flag: str, value: str) -> None:
    assert main(["bench", "partition", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ray-zep: error: {flag} item") and len(err.splitlines()) == 1


def test_layers_bench_routes_te_cp_over_every_nic(tmp_path: Path, capsys) -> None:
    argv = ["bench", "layers", *CLUSTER_A_7B, "--nodes", "2", "--tokens", "32k"]
    code = main([*argv, "--batches", "1", "--repeats", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "busiest" not in out.splitlines()[0]
    rows = json.loads((tmp_path / "layers.json").read_text())["rows"]
    assert len(rows) == 3 * 4
    for row in rows:
        assert row["error"] is None
        if row["planner"] == "te_cp":
            assert row["busiest_ratio"] <= 1 / 3
        assert 0 <= row["solve_p50_ms"] <= row["solve_p99_ms"]
    assert read_png(tmp_path / "layers.png").shape[:2] == (726, 1100)  # 10 x 6.6 in, 110 dpi
