"""`ray-zep bench train --compare compression`: rows from the runs' metrics.jsonl, the
table (bytes, ratio, the switch's calls and costs) and typed errors for bad names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_zep.errors import ConfigError
from ray_zep_workers import bench_compression as bench

PROFILE = {
    "plain": {"all_gather": {"alpha_s": 2e-4, "beta_s_per_byte": 1e-9}},
    "compress_s_per_byte": 2e-9,
    "decompress_s_per_byte": 1e-9,
}


def _metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _step(step: int, seconds: float, zipped: int, **extra) -> dict:
    counts = {"raw_bytes": 1000, "wire_bytes": 800 if zipped else 1000}
    counts |= {"zipped_calls": zipped, "plain_calls": 1 - zipped}
    row = {"step": step, "step_seconds": seconds, "tokens": 100}
    return row | {"compression": {"fsdp_all_gather": counts}} | extra


@pytest.mark.unit
def test_rows_leave_out_the_first_step_and_sum_streams(tmp_path: Path) -> None:
    rows = [_step(1, 9.0, 1, switcher=PROFILE), _step(2, 1.0, 1), _step(3, 1.0, 0)]
    row = bench._row("fsdp", "auto", _metrics(tmp_path / "m.jsonl", rows), 2.5)
    assert row.step_seconds == 1.0 and row.tokens_per_second == 100.0
    assert row.streams["fsdp_all_gather"] == {
        "raw_bytes": 2000, "wire_bytes": 1800, "zipped_calls": 1, "plain_calls": 1
    }  # fmt: skip
    assert row.profile == PROFILE
    off = bench._row("fsdp", "off", _metrics(tmp_path / "o.jsonl", [_step(1, 9, 0)] * 2), 2.5)
    printed = bench.bench_result([off, row], {})
    assert printed.name == "compression"
    assert [r["raw_bytes"] for r in printed.rows] == [1000, 2000]  # the record's totals
    line = next(t for t in printed.table.splitlines() if "| auto " in t)
    assert "fsdp_all_gather" in line and "1.111" in line and "9.00x" in line  # 9 s off, 1 s
    footer = "\n".join(printed.footer)
    assert "all_gather 200 us + bytes / 1.00 GB/s" in footer and "compress 0.50 GB/s" in footer


@pytest.mark.unit
def test_unknown_cases_and_modes_are_config_errors() -> None:
    assert bench.check_cases(["fsdp"], ["off", "auto"]) == (("fsdp",), ("off", "auto"))
    with pytest.raises(ConfigError, match="--cases: 'fdsp'"):
        bench.check_cases(["fdsp"], ["off"])
    with pytest.raises(ConfigError, match="--modes: 'on'"):
        bench.check_cases(["fsdp"], ["on"])


@pytest.mark.unit
def test_bench_train_compare_compression_writes_its_own_record(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from ray_zep.cli import main

    off = bench._row("fsdp", "off", _metrics(tmp_path / "o.jsonl", [_step(1, 9, 0)] * 2), 2.5)
    asked = []

    def fake_bench(config, overrides, cases, modes, steps, out):
        asked.append((cases, modes, steps))
        return [off]

    monkeypatch.setattr(bench, "run_compression_bench", fake_bench)
    args = ["bench", "train", "--compare", "compression", "--steps", "3", "--modes", "off"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert asked == [(bench.DEFAULT_CASES, ("off",), 3)]
    assert "| fsdp | off " in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "compression.json").read_text())
    assert record["spec"] == {"config": "conf/zeppelin.yaml", "overrides": [], "steps": 3}
    assert record["rows"][0]["wire_bytes"] == 1000
    assert (tmp_path / "out" / "compression.png").is_file()
    assert main([*args, "--cases", "fdsp", "--out", str(tmp_path / "out")]) == 2
    assert "--cases: 'fdsp'" in capsys.readouterr().err and len(asked) == 1
