"""`ray-zep plan`: table, JSON fragments that tile the batch, PNG, and typed errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ray_zep.cli import main
from ray_zep.config import load_config
from ray_zep.costmodel import linear_flops_per_token
from ray_zep.model_shapes import build_shape
from ray_zep.report.placement import ZONE_COLORS
from tests.helpers.pictures import read_png

pytestmark = pytest.mark.unit

CLUSTER = ["topology.preset=cluster_a", "topology.nodes=2", "train.tokens_per_rank=4096"]
SHARDED = [*CLUSTER, "parallel.weights=fsdp"]
"""7B replicated does not fit an 80 GB GPU (ray-zep plan refuses it): shard the weights."""
LENGTHS = [30000, 9000, 300, 300, 12288, 1024, 1, 7]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("strategy", ["zeppelin", "te_cp", "hybrid_dp", "usp", "whole"])
def test_plan_json_tiles_every_sequence(tmp_path: Path, capsys, strategy: str) -> None:
    lengths = LENGTHS if strategy != "whole" else [4000, 300, 7]
    out = tmp_path / "plan.json"
    argv = [*SHARDED, "model.preset=7b", "--lengths", ",".join(map(str, lengths))]
    code, stdout, err = _run(capsys, "plan", *argv, "--sequence", strategy, "--json", str(out))
    assert code == 0, err
    # header, rule, ranks, summary; blank, NIC header, rule, 2 nodes x 4 NICs, NIC and
    # remap lines; blank, per-rank memory; blank, modelled step over ideal and bound;
    # "wrote"
    assert len(stdout.splitlines()) == 2 + 16 + 1 + 1 + 2 + 8 + 2 + 2 + 2 + 1
    assert "x its bound" in stdout
    record = json.loads(out.read_text())
    remap = record["remap"]
    assert remap["counts_before"] == [r["tokens"] for r in record["ranks"]]
    after = np.asarray(remap["counts_before"])
    for src, dst, tokens in remap["transfers"]:
        after[src] -= tokens
        after[dst] += tokens
    assert after.tolist() == remap["counts_after"] and after.max() - after.min() <= 1
    assert remap["solve_ms"] >= 0 and remap["max_rank_cost"] >= 0
    nic = record["nic_bytes"]
    assert nic["direct"]["inter_node"] == nic["routed"]["inter_node"]
    assert np.max(nic["routed"]["nic"]) <= np.max(nic["direct"]["nic"])
    assert record["planner_ms"] >= 0 and len(record["ranks"]) == 16
    covered = [np.zeros(n, dtype=np.int64) for n in lengths]
    for rank in record["ranks"]:
        held = sum(f["end"] - f["start"] for f in rank["fragments"])
        assert held == rank["tokens"] <= 4096
        assert rank["attention_flops"] > 0 or held == 0
        for fragment in rank["fragments"]:
            assert fragment["zone"] in ("local", "intra_node", "inter_node")
            covered[fragment["seq"]][fragment["start"] : fragment["end"]] += 1
    assert all((c == 1).all() for c in covered), "every token exactly once"
    work = np.asarray([r["work_flops"] for r in record["ranks"]])
    assert record["work_max_over_mean"] == pytest.approx(work.max() / work.mean())
    shape = build_shape(load_config(None, [*CLUSTER, "model.preset=7b"]).model)
    linear = sum(linear_flops_per_token(shape))
    for rank in record["ranks"]:  # fwd + bwd (x 3) of every layer, linear and attention
        want = 3 * shape.n_layers * (rank["tokens"] * linear + rank["attention_flops"])
        assert rank["work_flops"] == pytest.approx(want)


def test_plan_picture_shows_the_zones(tmp_path: Path, capsys) -> None:
    png = tmp_path / "plan.png"
    argv = [*CLUSTER, "--lengths", "30000,9000,12k,300,5", "--png", str(png)]
    code, _, err = _run(capsys, "plan", *argv, "--sequence", "zeppelin")
    assert code == 0, err
    pixels = read_png(png)
    assert pixels.shape[1] > 900 and pixels.shape[0] > 16 * 12
    colours = {tuple(p) for p in pixels.reshape(-1, 3)[::7].tolist()}
    for zone_shades in ZONE_COLORS.values():
        assert set(zone_shades) & colours, "each zone appears (legend at least)"


def test_plan_from_a_distribution_and_from_the_configured_data(capsys) -> None:
    argv = [*CLUSTER, "--distribution", "arxiv", "--tokens", "60000"]
    code, stdout, err = _run(capsys, "plan", *argv, "--sequence", "zeppelin")
    assert code == 0, err
    assert "60000 tokens on 16 ranks" in stdout
    data = ["data.source=synthetic:github", "data.length_scale=0.05", "data.packing=budget"]
    argv = [*CLUSTER, *data, "parallel.sequence=zeppelin", "--batch", "1"]
    code, stdout, err = _run(capsys, "plan", *argv)
    assert code == 0, err
    assert "zeppelin:" in stdout and "tokens on 16 ranks" in stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "10,abc"], r"--lengths item 'abc'"),
        (["--lengths", "10,0"], r"--lengths item '0'"),
        (["--lengths", "70000,70000"], r"train\.tokens_per_rank=4096"),
        (["--lengths", "10", "--sequence", "ring"], r"parallel.sequence: .*expected single"),
        (["--lengths", "10", "--sequence", "single"], r"nothing to place"),
        (["--lengths", "10", "--distribution", "arxiv"], r"either --lengths or --distribution"),
        (["--distribution", "wiki"], r"synthetic:arxiv"),
        (["--lengths", "10", "parallel.zone_policy=fast"], r"parallel\.zone_policy"),
    ],
)
def test_plan_bad_input_is_one_line(capsys, argv: list[str], message: str) -> None:
    code, _, err = _run(capsys, "plan", *CLUSTER, *argv)
    assert code == 2
    assert err.startswith("ray-zep: error:") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
