"""The command line: bad input is one typed line and exit status 2, before any cluster starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from ray_zep.cli import main
from ray_zep.command_args import command_line
from ray_zep.config import config_from_dict, load_config
from ray_zep.config.sizes import check_run
from ray_zep.data.builder import write_token_parquet
from ray_zep.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "conf" / "demo.yaml")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _datasets(tmp: Path) -> dict[str, Path]:
    paths = {
        "ok": write_token_parquet([np.arange(50, dtype=np.int32)] * 4, tmp / "ok.parquet").path,
        "long": write_token_parquet(
            [np.arange(n, dtype=np.int32) % 256 for n in (10, 5000)], tmp / "long.parquet"
        ).path,
        "vocab": write_token_parquet(
            [np.array([1, 2, 999], dtype=np.int32)], tmp / "vocab.parquet"
        ).path,
    }
    paths["corrupt"] = tmp / "corrupt.parquet"
    paths["corrupt"].write_bytes(b"definitely not parquet")
    paths["empty"] = tmp / "empty.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[]], type=pa.list_(pa.int32()))}), paths["empty"])
    return paths


BAD_INPUT = [
    (["train.stesp=3"], "unknown config key 'train.stesp'"),
    (["train.steps=many"], "config key train.steps: Value 'many'"),
    (["ray.num_workers=3"], "ray.num_workers=3: parallel.sequence=zeppelin on topology.nodes=2"),
    (["data.source={tmp}/nope.parquet"], "nope.parquet' does not exist"),
    (["data.source={corrupt}"], "is not a readable Parquet file"),
    (["data.source={empty}"], "holds no tokens"),
    (["data.source={long}", "data.overlong=error"], "document 1 of .* has 5000 tokens"),
    (["data.source={vocab}"], r"token id 999 in document 0 .* outside the model's vocabulary"),
    (["topology.preset=cluster_a", "topology.gpus_per_node=2"], "contradicts"),
    (["data.source=synthetic:books"], "synthetic:arxiv"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUT)
def test_bad_input_is_one_line(tmp_path: Path, capsys, overrides: list[str], message: str) -> None:
    paths = {k: str(v) for k, v in _datasets(tmp_path).items()}
    filled = [o.format(tmp=tmp_path, **paths) for o in overrides]
    code, _, err = _run(capsys, "train", DEMO, f"train.out_dir={tmp_path / 'run'}", *filled)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ray-zep: error: "), err
    assert re.search(message, lines[0]), lines[0]


def test_console_script_reports_without_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_zep.cli",
            "train",
            DEMO,
            "data.source=/nowhere/x.parquet",
            f"train.out_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().endswith(
        "'/nowhere/x.parquet' does not exist; give a Parquet "
        "file or folder, 'stdlib' or "
        "'synthetic:<arxiv|github|prolong64k|chat>'"
    )


def test_resume_refusals(tmp_path: Path, capsys) -> None:
    ok = str(_datasets(tmp_path)["ok"])
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1, "ep": 2}))
    code, _, err = _run(
        capsys, "train", DEMO, f"train.out_dir={run}", f"data.source={ok}", "train.resume=never"
    )
    assert code == 2 and "train.resume=never" in err
    code, _, err = _run(capsys, "train", DEMO, f"train.out_dir={run}", f"data.source={ok}")
    assert code == 2 and "saved with parallel.ep=2, this run has parallel.ep=1" in err


def test_data_build_and_stats(tmp_path: Path, capsys) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("some text to learn from")
    out = tmp_path / "notes.parquet"
    code, stdout, _ = _run(capsys, "data", "build", str(text), "--out", str(out))
    assert code == 0 and "wrote 1 documents, 23 tokens" in stdout
    code, stdout, _ = _run(capsys, "data", "stats", str(out))
    assert code == 0 and "1 documents, 23 tokens" in stdout
    code, _, err = _run(capsys, "data", "build", str(tmp_path / "missing.txt"), "--out", str(out))
    assert code == 2 and "does not exist" in err


def test_config_and_topology_commands(capsys) -> None:
    code, stdout, _ = _run(capsys, "config", DEMO, "train.steps=7")
    assert code == 0 and "steps: 7" in stdout
    code, stdout, _ = _run(
        capsys, "topology", DEMO, "topology.preset=cluster_a", "topology.gpus_per_node=8"
    )
    assert code == 0 and "2 node(s) x 8 A800-80G = 16 ranks" in stdout
    assert "NIC0<-GPU0,1" in stdout


MOE_REPLICATED = ["model.preset=tiny_moe", "parallel.weights=replicated"]
"""The demo with experts, its weights replicated (experts sharded over their replicas
under fsdp need torch 2.12: refused when the config loads before it)."""
TRAIN_REFUSES = [
    ([*MOE_REPLICATED, "parallel.ep=3"], "config key parallel.ep=3: must divide the 4"),
    (["ray.min_nodes=5"], "config key ray.min_nodes=5: must be at most topology.nodes=2"),
]


@pytest.mark.parametrize(("overrides", "message"), TRAIN_REFUSES)
def test_config_command_refuses_what_train_refuses(
    tmp_path: Path, capsys, overrides: list[str], message: str
) -> None:
    """`config` prints nothing and exits with the line `train` exits with: both apply
    `check_run`, train before it touches a cluster."""
    with pytest.raises(ConfigError) as refused:
        check_run(load_config(DEMO, overrides))
    assert str(refused.value).startswith(message)
    code, stdout, config_err = _run(capsys, "config", DEMO, *overrides)
    assert code == 2 and stdout == ""
    assert config_err == f"ray-zep: error: {refused.value}\n"
    code, _, train_err = _run(capsys, "train", DEMO, f"train.out_dir={tmp_path}", *overrides)
    assert code == 2 and train_err == config_err
    assert not (tmp_path / "config.yaml").exists()


def test_config_command_prints_what_train_accepts(capsys) -> None:
    overrides = [*MOE_REPLICATED, "parallel.ep=2", "ray.min_nodes=2"]
    code, stdout, err = _run(capsys, "config", DEMO, *overrides)
    assert code == 0 and err == ""
    assert load_config(DEMO, overrides) == config_from_dict(yaml.safe_load(stdout))
    assert "  ep: 2\n" in stdout and "  min_nodes: 2\n" in stdout


def test_interrupt_is_one_line(capsys, monkeypatch) -> None:
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("ray_zep.cli.training._config", interrupted)
    code, _, err = _run(capsys, "config", DEMO)
    assert code == 130
    assert err.strip() == (
        "ray-zep: interrupted; rerun the same command to resume from the last checkpoint"
    )


def test_bench_help_lists_every_bench_and_other_commands_import_none(capsys) -> None:
    """One runner: `ray-zep bench --help` names every registered bench with its help line,
    each bench module declares the NAME it is registered under, and a command that is not
    a bench imports no bench module (and no Ray)."""
    from ray_zep.cli.bench import BENCHES, bench_modules

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    for module in bench_modules():
        assert re.search(rf"^\s+{module.NAME}\s+{re.escape(module.HELP)}", listed, re.M), module
    assert [m.NAME for m in bench_modules()] == list(BENCHES)
    probe = (
        "import sys; from ray_zep.cli import main; main(['config', sys.argv[1]]); "
        "from ray_zep.cli.bench import BENCHES; "
        "print(sorted({*BENCHES.values(), 'ray'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, DEMO], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().endswith("[]"), done.stdout[-300:]


def test_the_driver_starts_without_the_training_stack() -> None:
    """The driver finds and checks checkpoints and hands Ray Train its worker function;
    the engine and torch.distributed.checkpoint are imported in the workers only."""
    stack = ["torch.distributed.checkpoint", "ray_zep.train.loop", "ray_zep.attention.engine"]
    probe = f"import sys, ray_zep_workers.driver; print(sorted(set({stack!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith("[]"), done.stdout[-300:]


def test_a_record_keeps_the_command_but_not_where_it_wrote(monkeypatch) -> None:
    """A bench's JSON records its command to repeat it; its output folders are one
    machine's paths, and are left out."""
    argv = ["ray-zep", "bench", "scale", "--gpus", "64", "--out", "/somewhere/runs",
            "--json=/somewhere/s.json", "--models", "7b"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert command_line("ray-zep bench scale") == "ray-zep bench scale --gpus 64 --models 7b"
    monkeypatch.setattr(sys, "argv", ["ray-zep"])
    assert command_line("ray-zep bench scale") == "ray-zep bench scale"
