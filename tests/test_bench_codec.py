"""`ray-zep bench codec`: the table, the JSON record, the PNG and the goals line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ray_zep.bench.codec import CodecBenchSpec, goals, run_codec_bench, synthetic_tensors
from ray_zep.cli import main
from ray_zep.errors import ConfigError

pytestmark = pytest.mark.unit


def test_bench_codec_writes_rows_for_every_data_set(tmp_path: Path, capsys) -> None:
    code = main(
        ["bench", "codec", "model.n_layers=1", "--values", "20000", "--repeats", "1",
         "--train-steps", "1", "--codecs", "zipccl,zipccl-torch,zstd-3", "--out", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    record = json.loads((tmp_path / "codec.json").read_text())
    rows = record["rows"]
    data = {r["data"] for r in rows}
    assert {"relu activations", "weights", "gradients", "hidden states"} <= data
    assert all(r["exact"] for r in rows), "a codec changed bits"
    assert {r["codec"] for r in rows} <= {"zipccl", "zipccl-torch", "zstd-3"}
    ours = [r for r in rows if r["codec"] == "zipccl-torch" and r["data"].startswith("gaussian")]
    assert ours and all(r["ratio"] >= 1.40 for r in ours)
    messages = {r["data"] for r in rows if r["data"].startswith("message")}
    assert messages == {"message 64 KiB", "message 1 MiB", "message 16 MiB"}
    assert {r["codec"] for r in rows if r["data"] in messages} <= {"zipccl", "zstd-3"}
    assert (tmp_path / "codec.png").stat().st_size > 0
    assert "goal" in out and "ratio >= 1.40" in out
    if any(r["codec"] == "zstd-3" for r in rows) and any(r["codec"] == "zipccl" for r in rows):
        assert "model gradients (BF16)" in out and "message 64 KiB: c+d" in out


def test_goals_compare_against_zstd_on_the_same_data() -> None:
    tensors = {k: v for k, v in synthetic_tensors(4096).items() if "sigma=1" in k}
    rows = run_codec_bench(
        tensors, CodecBenchSpec(values=4096, repeats=1, codecs=("zipccl-torch",))
    )
    assert [name for name, _ in goals(rows)] == []  # no native row, no zstd row: nothing to judge
    assert all(r.exact for r in rows)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"codecs": ("zip",)}, "zip"), ({"values": 0}, "--values=0"), ({"repeats": 0}, "--repeats")],
)
def test_bad_bench_options_are_config_errors(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        CodecBenchSpec(**kwargs)


def test_device_cuda_without_a_gpu_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda runs there")
    with pytest.raises(ConfigError, match="--device=cuda: torch sees no CUDA GPU"):
        CodecBenchSpec(device="cuda")
    with pytest.raises(ConfigError, match="--device=tpu"):
        CodecBenchSpec(device="tpu")
