"""`ray-zep bench validate`: its rows, its ranking check, the paper headlines, its options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration
    from ray_zep_workers.bench_train import TrainBenchRow
    from ray_zep_workers.bench_validate import Validation, bench_result

    runs = [
        TrainBenchRow("whole/replicated", 10e3, 11e3, 0.4, 0.36, 4.0, probed_shares=(0.4, 0.5)),
        TrainBenchRow("te_cp/replicated", 2e3, 3e3, 2.0, 1.3, 4.0),
        TrainBenchRow("zeppelin/replicated", 2.5e3, 2.6e3, 1.6, 1.5, 4.0),
    ]
    uneven = Calibration(ComputeRates(1e9, 1e9, 1e9), job_share=0.8, job_shares=(0.63, 0.8, 0.85))
    result = Validation(runs, [], uneven)
    rows = result.rows()
    assert rows[0]["probed_shares"] == (0.4, 0.5) and rows[1]["probed_shares"] is None
    assert [r["mode"] for r in rows if r["kind"] == "cpu"] == [r.name for r in runs]
    assert next(r for r in rows if r["kind"] == "auto") == {
        "kind": "auto",
        "chosen": "whole/replicated",
        "fastest_measured": "whole/replicated",
        "chosen_over_fastest": 1.0,
    }
    assert rows[1]["kind"] == "cpu" and rows[1]["predicted_over_measured"] == pytest.approx(1.5)
    assert result.misordered() == [("zeppelin/replicated", "te_cp/replicated")]
    printed = bench_result(result, {}, [])
    assert printed.name == "validate" and printed.rows == rows
    lines = printed.table.splitlines()  # header, rule, then a line per mode
    assert "te_cp/replicated" in lines[3] and "off by > 20%" in lines[3]
    assert "whole/replicated" in lines[2] and "off by" not in lines[2]
    footer = "\n".join(printed.footer)
    # 2.5k over 2.0k measured, 2.6k over 3.0k predicted
    assert "zeppelin/replicated > te_cp/replicated (measured +25%, predicted -13.3%)" in footer
    assert "0.63, 0.80, 0.85 in its pairs of job runs" in footer and "median, 0.80" in footer
    even = dataclasses.replace(uneven, job_shares=(0.8, 0.85, 0.9))
    assert "in its pairs of job runs" not in "\n".join(Validation(runs, [], even).footer())
    headline = paper_rows(quick=True)[0]
    paper_table = Validation(runs, [headline], even).footer()[-1]
    assert "paper headline" in paper_table and headline.name in paper_table


def test_ranking_holds_the_prediction_to_the_orders_the_runs_resolve() -> None:
    """2.5k against 2.0k tokens/s, each +-10%: 0.5k apart is within two standard errors
    of the difference (2 x 0.32k), so a swapped prediction is listed apart; the same
    pair measured +-4% is resolved, and the swap counts against the ranking."""
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration
    from ray_zep_workers.bench_train import TrainBenchRow, relative_error
    from ray_zep_workers.bench_validate import Validation, resolves

    calibration = Calibration(ComputeRates(1e9, 1e9, 1e9))

    def runs(error: float) -> list[TrainBenchRow]:
        return [
            TrainBenchRow("whole/replicated", 10e3, 11e3, 0.4, 0.36, 4.0, 0.6, error),
            TrainBenchRow("te_cp/replicated", 2e3, 3e3, 2.0, 1.3, 4.0, 0.6, error),
            TrainBenchRow("zeppelin/replicated", 2.5e3, 2.6e3, 1.6, 1.5, 4.0, 0.6, error),
        ]

    loose = Validation(runs(0.10), [], calibration)
    assert not resolves(loose.cpu[1], loose.cpu[2]) and resolves(loose.cpu[0], loose.cpu[1])
    ranking = next(r for r in loose.rows() if r["kind"] == "ranking")
    assert ranking == {
        "kind": "ranking",
        "pairs": 3,
        "resolved_pairs": 2,
        "swapped_resolved": [],
        "swapped_unresolved": [["zeppelin/replicated", "te_cp/replicated"]],
    }
    footer = "\n".join(loose.footer())
    assert "2 of 3 pairs resolved" in footer and "all predicted in order" in footer
    tight = Validation(runs(0.04), [], calibration)
    assert tight.misordered(resolved=True) == [("zeppelin/replicated", "te_cp/replicated")]
    assert tight.resolved_pairs() == (3, 3)

    # steps measured 1.0, 1.2, 0.8 s where the model gave 1 s each: 0.2 / sqrt(3) relative
    assert relative_error([1.0, 1.2, 0.8], [1.0] * 3) == pytest.approx(0.2 / 3**0.5)
    assert relative_error([1.0], [1.0]) is None


def test_mode_names_and_their_overrides() -> None:
    from ray_zep_workers.bench_train import check_names, variant_overrides

    assert check_names(["te_cp/fsdp", "whole", "tawpipe", "zeppelin"])
    assert "parallel.weights=fsdp" in variant_overrides("te_cp/fsdp")
    assert "data.packing=rank" in variant_overrides("whole/fsdp")
    assert "parallel.sequence=whole" in variant_overrides("tawpipe")
    with pytest.raises(ConfigError, match="te_cp/nope"):
        check_names(["te_cp/nope"])
    with pytest.raises(ConfigError, match="'megatron_hybrid_cp' is not one of"):
        check_names(["megatron_hybrid_cp"])  # a simulated baseline, not a trainer mode
    with pytest.raises(ConfigError, match="'bytescale_hdp' is not one of"):
        check_names(["bytescale_hdp"])
    # token- and work-balanced zeppelin side by side: only the zone policy differs
    assert check_names(["zeppelin", "zeppelin+work/fsdp"])
    work, plain = variant_overrides("zeppelin+work/fsdp"), variant_overrides("zeppelin/fsdp")
    assert set(work) - set(plain) == {"parallel.zone_policy=work"}
    assert not any("zone_policy" in o for o in plain)  # the config's (work by default)


def test_bench_train_reports_the_steady_steps_flop_balance() -> None:
    from ray_zep_workers.bench_train import TrainBenchRow, combine_sittings, steady_flop_imbalance

    rows = [{"rank_flop_imbalance": x} for x in (3.0, 2.0, 1.2, 1.4)]
    assert steady_flop_imbalance(rows) == pytest.approx(1.3)  # the warm-up left out
    assert steady_flop_imbalance([{}, {}, {}]) is None
    runs = [
        TrainBenchRow("zeppelin", 1e3, 1e3, 1.0, 1.0, 4.0, flops_max_over_mean=balance)
        for balance in (1.2, 1.4)
    ]
    assert combine_sittings(runs).flops_max_over_mean == pytest.approx(1.3)


def test_validate_rejects_bad_options_before_starting_anything(capsys) -> None:
    from ray_zep.cli import main

    assert main(["bench", "validate", "conf/demo.yaml", "--steps", "2"]) == 2
    assert "--steps=2" in capsys.readouterr().err
    assert main(["bench", "validate", "conf/demo.yaml", "--sittings", "0"]) == 2
    assert "--sittings=0" in capsys.readouterr().err


def test_calibrate_validate_and_train_write_their_records(monkeypatch, tmp_path, capsys) -> None:
    """The three benches that train through Ray, with the training stubbed: each saves
    calibration.json where it measured one, and its record under its own name."""
    import json

    import ray_zep_workers.bench_calibrate as calibrate_bench
    import ray_zep_workers.bench_train as train_bench
    import ray_zep_workers.bench_validate as validate_bench
    from ray_zep.cli import main
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration

    measured = Calibration(ComputeRates(1e9, 2e9, 3e9), 1e-3, 1e9, 2e-3, 2e9, ranks=4, cores=2)
    monkeypatch.setattr(calibrate_bench, "calibrate", lambda config, device, repeats: measured)
    monkeypatch.setattr(calibrate_bench, "measure_step_overhead", lambda *args: measured)
    runs = [train_bench.TrainBenchRow("whole", 2e3, 2.2e3, 0.5, 0.45, 4.0, 0.5)]
    monkeypatch.setattr(train_bench, "run_train_bench", lambda *args: (runs, measured))
    validation = validate_bench.Validation(runs, [], measured)
    monkeypatch.setattr(validate_bench, "run_validate", lambda *args: validation)

    def record(name: str, *args: str) -> dict:
        out = tmp_path / name
        assert main(["bench", name, *args, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        for path in out.iterdir():
            assert f"wrote {path}" in printed
        return json.loads((out / f"{name}.json").read_text())

    calibrated = record("calibrate", "--repeats", "1")
    (rates,) = calibrated["rows"]
    assert rates.keys() == dataclasses.asdict(measured.rates).keys() and rates["matmul"] == 3e9
    assert calibrated["spec"]["repeats"] == 1
    assert Calibration.load(tmp_path / "calibrate" / "calibration.json").rates.matmul == 3e9
    validated = record("validate", "--quick")
    assert validated["spec"] == {"config": "conf/demo.yaml", "overrides": [], "steps": 8,
                                 "quick": True, "sittings": 1}  # fmt: skip
    assert validated["rows"][0]["mode"] == "whole"
    assert (tmp_path / "validate" / "calibration.json").is_file()
    trained = record("train", "--steps", "3")
    assert set(trained) >= {"command", "date", "machine", "spec", "rows"}
    assert trained["spec"]["rates"]["matmul"] == 3e9 and trained["spec"]["link"]["bandwidth"] == 1e9
    assert trained["rows"][0]["predicted_over_measured"] == pytest.approx(1.1)


def test_plan_auto_searches_compositions_and_keeps_only_what_fits(tmp_path) -> None:
    """7B on 16 GPUs of cluster A: replicated weights need 16 B per parameter on every GPU
    (112 GB), more than an 80 GB A800 holds; the winner must fit, and its YAML loads."""
    from ray_zep.config import load_config
    from ray_zep.sim.auto import auto_plan, compositions, write_best
    from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware

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
    replicated = [  # modelled, played or not (the floor may rule a group out)
        c for c in result.candidates
        if c.memory_gb > 0 and c.config.parallel.weights.value == "replicated"
    ]  # fmt: skip
    assert replicated and not any(c.fits for c in replicated)
    # the ranking keeps seconds, not the layer timelines (a task list per rank each)
    played = [s for c in result.candidates for s in c.steps]
    assert played and all(s.forward is None and s.backward is None for s in played)
    chosen = load_config(write_best(result, tmp_path / "best.yaml"), [])
    assert chosen.parallel.sequence is result.best.config.parallel.sequence


def test_plan_auto_checkpoints_the_fewest_blocks_where_nothing_fits_without() -> None:
    """7B on 8 GPUs of cluster A at 16k tokens a GPU: no composition fits 80 GB without
    activation checkpointing; each is played under the lightest that fits, on its first
    blocks only, and its step counts the recomputation."""
    from ray_zep.config import load_config
    from ray_zep.sim.auto import auto_plan
    from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=1", "model.preset=7b",
                                "train.tokens_per_rank=20480"])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    batches, _ = batches_of(config, hardware.topology, SimulateRequest(None, False, 1, "arxiv"))
    result = auto_plan(config, hardware, lambda _: [(b, None) for b in batches], on_gpu)
    best = result.best
    assert best is not None and best.fits, [c.name for c in result.ranked[:3]]
    train = best.config.train
    assert train.activation_checkpointing.value in ("selective", "linears", "full")
    assert 0 < train.checkpointed(32) < 32, train.checkpoint_blocks
    assert best.steps[0].recompute_seconds > 0
    assert f"checkpointing={train.activation_checkpointing.value}:" in best.name, best.name


def test_share_probe_times_the_models_step_against_its_alone_seconds(monkeypatch, tmp_path) -> None:
    """The share is the step's seconds alone at calibration over its seconds in every
    rank now (the median over rounds), capped at 1; a calibration without the alone
    step cannot probe."""
    import ray_zep.core_share as core_share
    from ray_zep.costmodel import ComputeRates
    from ray_zep.model_shapes import ModelShape
    from ray_zep.sim.calibration import Calibration

    shape = ModelShape(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64)
    alone, together = core_share.step_seconds(shape, 2, rounds=1, alone=True)  # real processes
    assert len(alone) == len(together) == 1 and min(alone + together) > 0
    with pytest.raises(ValueError, match=">= 2 ranks"):
        core_share.step_seconds(shape, 1, rounds=1, alone=False)

    monkeypatch.setattr(core_share, "wait_until_quiet", lambda: 0.0)
    rounds = iter([([0.10] * 5, [0.20, 0.25, 0.22, 0.40, 0.21]), ([], [0.4, 0.5, 0.6])])
    monkeypatch.setattr(core_share, "step_seconds", lambda *args, **kwargs: next(rounds))
    probe, share = core_share.ShareProbe.calibrate(shape, 4)
    assert probe.alone_s == 0.10 and share == pytest.approx(0.10 / 0.22)
    assert probe.share() == pytest.approx(0.10 / 0.5)
    monkeypatch.setattr(core_share, "step_seconds", lambda *args, **kwargs: ([], [0.05] * 3))
    assert probe.around(lambda: "trained") == ("trained", 1.0)  # faster than alone: capped
    # with the calibration's share: the median of it and the two probes, so a dip that
    # one probe reads moves nothing, and a change both read is followed
    probes = iter([([], [0.5] * 3), ([], [0.22] * 3), ([], [0.4] * 3), ([], [0.38] * 3)])
    monkeypatch.setattr(core_share, "step_seconds", lambda *args, **kwargs: next(probes))
    assert probe.around(lambda: None, usual=0.44)[1] == pytest.approx(0.44)  # 0.2, 0.45
    assert probe.around(lambda: None, usual=0.44)[1] == pytest.approx(0.10 / 0.38)  # 0.25, 0.26

    rates = ComputeRates(1e9, 1e9, 1e9)
    calibrated = Calibration(rates, 1e-3, 1e9, ranks=4, cores=2, core_share=0.5, alone_step_s=0.1)
    loaded = Calibration.load(calibrated.save(tmp_path / "calibration.json"))
    assert loaded.share_probe(shape) == core_share.ShareProbe(shape, 4, 0.1)
    with pytest.raises(ConfigError, match="alone_step_s"):
        Calibration(rates, 1e-3, 1e9, ranks=4, cores=2, core_share=0.5).share_probe(shape)


def test_a_probe_waits_for_the_machine_to_be_quiet(monkeypatch, tmp_path) -> None:
    """Windows at or over the busy threshold are waited out, the first under it ends the
    wait, and the wait never passes its limit; without `/proc/stat` it is a tenth of it,
    and `/proc/stat` going away during the wait ends it."""
    import ray_zep.core_share as core_share

    # (busy, total) ticks since boot: windows 50% busy, 20% busy, then 5% busy
    ticks = iter([(0, 0), (50, 100), (70, 200), (75, 300), (80, 400)])
    monkeypatch.setattr(core_share, "_cpu_ticks", lambda: next(ticks))
    waited = core_share.wait_until_quiet(busy_below=0.15, window_s=0.01, max_s=5.0)
    assert 0.03 <= waited < 1.0 and next(ticks) == (80, 400)  # the 4th reading was not taken
    monkeypatch.setattr(core_share, "_cpu_ticks", lambda: (0, 0))  # no ticks pass: never quiet
    assert 0.05 <= core_share.wait_until_quiet(window_s=0.01, max_s=0.05) < 0.5
    gone = iter([(0, 0), None])  # readable once, then gone: the wait ends, no error
    monkeypatch.setattr(core_share, "_cpu_ticks", lambda: next(gone))
    assert core_share.wait_until_quiet(window_s=0.01, max_s=5.0) < 1.0
    monkeypatch.undo()
    monkeypatch.setattr(core_share, "PROC_STAT", str(tmp_path / "missing"))
    assert core_share._cpu_ticks() is None
    assert 0.01 <= core_share.wait_until_quiet(max_s=0.1) < 0.5


def test_fsdp_units_are_timed_against_their_replicated_twins(monkeypatch, tmp_path) -> None:
    """Each job-size FSDP2 run is predicted at the share its replicated twin measured, and
    a unit's cost is the median excess over the model, split over the units."""
    import numpy as np

    import ray_zep_workers.bench_calibrate as step
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration

    overhead, modelled = 0.03, 0.20  # the tiny step's fixed cost; a job step's compute
    job_measured = iter([0.30, 0.26, 0.33])  # three replicated job runs
    excess = iter([0.060, 0.030, 0.150])  # what each FSDP2 twin takes beyond its model
    shares_seen = []

    def fake_steps(config_path, overrides, calibration, out):
        tokens = next(o for o in overrides[::-1] if o.startswith("train.tokens_per_rank"))
        if tokens.endswith("=32"):
            return 0.05, 0.02  # measured, simulated: 30 ms beyond the model
        if "fsdp" not in out.name:  # a replicated job run, simulated without a job share
            assert calibration.job_share is None
            return next(job_measured), overhead + modelled
        shares_seen.append(calibration.job_share)
        simulated = overhead + modelled / calibration.job_share
        return simulated + next(excess), simulated

    monkeypatch.setattr(step, "_steps", fake_steps)
    start = Calibration(ComputeRates(1e9, 1e9, 1e9), 1e-3, 1e9, ranks=4, cores=2, core_share=0.5)
    out = step.measure_step_overhead(None, [], start, tmp_path)
    shares = [modelled / (m - overhead) for m in (0.30, 0.26, 0.33)]
    assert out.rates.step_overhead_s == pytest.approx(overhead)
    assert shares_seen == pytest.approx(shares)
    assert out.job_share == pytest.approx(float(np.median(shares)))
    assert out.rates.fsdp_unit_overhead_s == pytest.approx(0.060 / 6)  # the demo has 6 units

    job_measured, excess = iter([0.30]), iter([0.030])  # `--quick`: one pair
    one = step.measure_step_overhead(None, [], start, tmp_path, job_runs=1)
    assert len(shares_seen) == 4
    assert one.job_share == pytest.approx(shares[0])
    assert one.rates.fsdp_unit_overhead_s == pytest.approx(0.030 / 6)

    # a pair whose steps come out within the fixed cost is dropped, and the next pair
    # runs in folders of its own
    job_measured, excess = iter([0.02, 0.30]), iter([0.030])
    folders = []
    monkeypatch.setattr(step, "_steps", lambda *a: (folders.append(a[3].name), fake_steps(*a))[1])
    sittings = step.JobSittings.start(None, [], start, tmp_path)
    sittings.measure()
    assert sittings.shares == [] and sittings.calibration().job_share is None
    sittings.measure()
    assert folders == ["replicated", "job0", "job1", "fsdp1"]
    assert sittings.calibration().job_shares == pytest.approx((shares[0],))


def test_job_pairs_spread_over_the_runs_and_every_run_is_predicted_at_their_median(
    monkeypatch, tmp_path
) -> None:
    """Three pairs around five runs: before the first, before the third and after the
    last; the prediction of every run, the first too, uses the median of the three. A
    ring sitting goes beside each pair after the first (the calibration's was the
    first), and the ring costs are the median of the three sittings'."""
    import ray_zep_workers.bench_calibrate as step
    import ray_zep_workers.bench_train as bench
    from ray_zep.bench import calibrate_ring
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration

    assert step.spread(3, 14) == [0, 7, 14] and step.spread(3, 5) == [0, 2, 5]
    assert step.spread(1, 5) == [0] and step.spread(0, 5) == [] and step.spread(2, 1) == [0, 1]

    events, job_shares = [], iter([0.63, 0.85, 0.82])

    class FakeSittings:
        def __init__(self) -> None:
            self.shares: list[float] = []
            self.tried = 0

        @classmethod
        def start(cls, config_path, overrides, calibration, out):
            events.append("overhead")
            return cls()

        def measure(self) -> None:
            events.append("pair")
            self.shares.append(next(job_shares))
            self.tried += 1

        def calibration(self) -> Calibration:
            return dataclasses.replace(start, job_share=0.82, job_shares=tuple(self.shares))

    class FakeProbe:
        def readings(self, work):
            return work(), 0.5, 0.5

    seen_shares = []

    def fake_predicted(calibration, steps, name, config, summary, before, after):
        seen_shares.append(calibration.job_share)
        return bench.TrainBenchRow(name, 1.0, 1.0, 1.0, 1.0, None)

    slow_ring = ComputeRates(1e9, 1e9, 1e9, ring_row_seconds=9e-6)  # the first sitting ran slow
    start = Calibration(slow_ring, 1e-3, 1e9, ranks=4, cores=2, core_share=0.5, ring_step_s=1e-4)
    ring_costs = iter([(5e-5, 2e-6), (6e-5, 3e-6)])
    monkeypatch.setattr(bench, "calibrate", lambda *a, **k: start)
    monkeypatch.setattr(
        calibrate_ring,
        "measure_ring_costs",
        lambda config, calibration: (events.append("ring"), next(ring_costs))[1],
    )
    monkeypatch.setattr(bench, "JobSittings", FakeSittings)
    monkeypatch.setattr(Calibration, "share_probe", lambda self, shape: FakeProbe())
    monkeypatch.setattr(bench, "_predicted", fake_predicted)
    import ray_zep_workers.driver as driver

    monkeypatch.setattr(driver, "train", lambda config: events.append(config.train.out_dir))
    modes = ("whole", "zeppelin", "te_cp", "ulysses", "usp")
    rows, calibration = bench.run_train_bench(None, [], modes, 3, tmp_path, job_runs=3)
    runs = [Path(e).name for e in events if isinstance(e, str) and "/" in e]
    assert runs == list(modes)
    kinds = ["run" if "/" in e else e for e in events]
    assert kinds == [
        "overhead", "pair", "run", "run", "ring", "pair", "run", "run", "run", "ring", "pair"
    ]  # fmt: skip
    assert seen_shares == [0.82] * 5 and calibration.job_shares == (0.63, 0.85, 0.82)
    assert calibration.ring_step_s == pytest.approx(6e-5)
    assert calibration.rates.ring_row_seconds == pytest.approx(3e-6)
    assert [r.name for r in rows] == list(modes)


def test_sittings_run_every_mode_in_passes_and_combine_its_runs(monkeypatch, tmp_path) -> None:
    """Two sittings: the modes forward, then backward, each run in its own folder; a
    mode's row is over both runs, its error widened by how far the runs disagree."""
    import ray_zep_workers.bench_train as bench
    from ray_zep.costmodel import ComputeRates
    from ray_zep.sim.calibration import Calibration

    assert bench.sitting_order(("a", "b", "c"), 2) == [
        ("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)
    ]  # fmt: skip
    assert bench.sitting_order(("a", "b"), 1) == [("a", 0), ("b", 0)]
    assert bench.run_dir_name("te_cp/fsdp", 0) == "te_cp+fsdp"
    assert bench.run_dir_name("te_cp/fsdp", 1) == "te_cp+fsdp.sitting2"

    measured = iter([2000.0, 1000.0, 3000.0, 3000.0, 1000.0, 1000.0])
    folders = []

    class FakeProbe:
        def readings(self, work):
            return work(), 0.5, 0.4

    def fake_predicted(calibration, steps, name, config, summary, before, after):
        return bench.TrainBenchRow(
            name, next(measured), 1500.0, 1.0, 1.0, 4.0, 0.5, 0.01, (before, after)
        )

    import ray_zep_workers.driver as driver

    calibration = Calibration(ComputeRates(1e9, 1e9, 1e9), 1e-3, 1e9, ranks=4, cores=2)
    monkeypatch.setattr(Calibration, "share_probe", lambda self, shape: FakeProbe())
    monkeypatch.setattr(bench, "_predicted", fake_predicted)
    monkeypatch.setattr(driver, "train", lambda config: folders.append(config.train.out_dir))
    modes = ("whole", "te_cp/fsdp", "zeppelin")
    rows, _ = bench.run_train_bench(None, [], modes, 3, tmp_path, calibration, sittings=2)
    assert [Path(f).name for f in folders] == [
        "whole", "te_cp+fsdp", "zeppelin", "zeppelin.sitting2", "te_cp+fsdp.sitting2",
        "whole.sitting2",
    ]  # fmt: skip
    by_name = {r.name: r for r in rows}
    assert list(by_name) == list(modes)
    whole, sharded, zeppelin = (by_name[m] for m in modes)
    # the same batches twice: tokens over the time of both runs
    assert whole.measured_tokens_per_second == pytest.approx(2 / (1 / 2000 + 1 / 1000))
    assert whole.predicted_tokens_per_second == pytest.approx(1500.0)
    assert whole.probed_shares == (0.5, 0.4, 0.5, 0.4)
    # runs 2x apart: the error is theirs (stdev 0.53 of ratios 0.75, 1.5 over their mean
    # 1.125, over sqrt(2)), not the steps' (0.01 / sqrt(2))
    assert whole.measured_error == pytest.approx(1 / 3)
    # runs that agree keep the steps' error
    assert sharded.measured_tokens_per_second == pytest.approx(1000.0)
    assert sharded.measured_error == pytest.approx(0.01 / 2**0.5)
    assert zeppelin.measured_tokens_per_second == pytest.approx(3000.0)
    one = bench.combine_sittings([sharded])
    assert one is sharded
