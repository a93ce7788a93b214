"""`ray-zep bench validate`: its rows, its ranking check, the paper headlines, its options."""

from __future__ import annotations

import pytest

from ray_zep.bench.headlines import TOLERANCE, paper_rows
from ray_zep.errors import ConfigError

pytestmark = pytest.mark.unit


def test_headlines_name_the_paper_figure_and_explain_every_gap() -> None:
    rows = paper_rows(quick=True)
    names = {row.name.split("/")[0] for row in rows}
    assert names == {"zeppelin", "tawpipe", "foldmoe", "zipccl"}
    for row in rows:
        record = row.to_dict()
        assert record["kind"] == "paper" and record["paper"] > 0 and record["simulated"] > 0
        off = abs(row.simulated / row.paper - 1) > TOLERANCE
        assert (record["explained"] is not None) == off, row


def test_rows_and_ranking_of_the_cpu_runs() -> None:
    from workers.bench_train import TrainBenchRow
    from workers.bench_validate import Validation

    runs = [
        TrainBenchRow("whole/replicated", 10e3, 11e3, 0.4, 0.36, 4.0),
        TrainBenchRow("te_cp/replicated", 2e3, 3e3, 2.0, 1.3, 4.0),
        TrainBenchRow("zeppelin/replicated", 2.5e3, 2.6e3, 1.6, 1.5, 4.0),
    ]
    result = Validation(runs, [], calibration=None)
    rows = result.rows()
    assert [r["mode"] for r in rows if r["kind"] == "cpu"] == [r.name for r in runs]
    assert rows[-1] == {
        "kind": "auto",
        "chosen": "whole/replicated",
        "fastest_measured": "whole/replicated",
        "chosen_over_fastest": 1.0,
    }
    assert rows[1]["kind"] == "cpu" and rows[1]["predicted_over_measured"] == pytest.approx(1.5)
    assert result.misordered() == [("zeppelin/replicated", "te_cp/replicated")]
    table = result.table()
    assert "off by > 20%" in table.splitlines()[2] and "zeppelin/replicated > te_cp" in table


def test_mode_names_and_their_overrides() -> None:
    from workers.bench_train import check_names, variant_overrides

    assert check_names(["te_cp/fsdp", "whole", "tawpipe", "zeppelin"])
    assert "parallel.weights=fsdp" in variant_overrides("te_cp/fsdp")
    assert "data.packing=rank" in variant_overrides("whole/fsdp")
    assert "parallel.sequence=whole" in variant_overrides("tawpipe")
    with pytest.raises(ConfigError, match="te_cp/nope"):
        check_names(["te_cp/nope"])
    with pytest.raises(ConfigError, match="'megatron_hybrid_cp' is not one of"):
        check_names(["megatron_hybrid_cp"])  # a simulated baseline, not a trainer mode


def test_validate_rejects_bad_options_before_starting_anything(capsys) -> None:
    from ray_zep.cli import main

    assert main(["bench", "validate", "conf/demo.yaml", "--steps", "2"]) == 2
    assert "--steps=2" in capsys.readouterr().err


def test_plan_auto_searches_compositions_and_keeps_only_what_fits(tmp_path) -> None:
    """7B on 16 GPUs of cluster A: replicated weights need 16 B per parameter on every GPU
    (112 GB), more than an 80 GB A800 holds; the winner must fit, and its YAML loads."""
    from ray_zep.config import load_config
    from ray_zep.sim.auto import auto_plan, compositions, write_best
    from ray_zep.sim.command import SimulateRequest, batches_of, request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2", "model.preset=7b"])
    every = compositions(config, 16)
    names = {(c.parallel.sequence.value, c.parallel.weights.value) for c in every}
    assert ("zeppelin", "fsdp") in names and ("whole", "tawpipe") in names
    assert ("zeppelin", "tawpipe") not in names  # refused: weight passing keeps sequences whole
    hardware, on_gpu = request_hardware(config, None)
    batches, _ = batches_of(config, hardware.topology, SimulateRequest(None, False, 1, "arxiv"))
    result = auto_plan(config, hardware, lambda _: [(b, None) for b in batches], on_gpu)
    assert result.best is not None and result.best.fits
    assert result.best.memory_gb * 1e9 <= hardware.topology.gpu_memory_bytes
    replicated = [
        c for c in result.candidates if c.steps and c.config.parallel.weights.value == "replicated"
    ]
    assert replicated and not any(c.fits for c in replicated)
    chosen = load_config(write_best(result, tmp_path / "best.yaml"), [])
    assert chosen.parallel.sequence is result.best.config.parallel.sequence


def test_core_share_probe_is_a_share_and_refuses_no_ranks() -> None:
    from ray_zep.bench.core_share import probe_core_share

    assert 0.0 < probe_core_share(2, iterations=100_000, pause=0.0) <= 1.0
    with pytest.raises(ValueError, match="needs >= 1 rank"):
        probe_core_share(0)
