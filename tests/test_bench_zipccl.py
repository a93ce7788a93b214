"""`ray-zep bench zipccl`: the modelled bytes against a hand count, speedup vs ratio, JSON."""

from __future__ import annotations

import itertools
import json

import pytest

from ray_zep.bench.zipccl import (
    SETUPS,
    Assumptions,
    DenseModel,
    MoEModel,
    PaperCluster,
    Ratios,
    Setup,
)
from ray_zep.bench.zipccl_model import model_step
from ray_zep.bench.zipccl_report import model_rows
from ray_zep.cli import main
from ray_zep.errors import ConfigError

pytestmark = pytest.mark.unit

# 2 nodes x 2 GPUs, NIC 8 Gb/s = 1e9 bytes/s, so seconds = NIC bytes / 1e9 at alpha 0.
TINY_CLUSTER = PaperCluster("tiny", 2, 8.0, 1.0, 100.0)
TINY_DENSE = DenseModel("tiny", vocab=16, dim=8, layers=2, heads=2, kv_heads=1, ffn=16)
TINY_MOE = MoEModel("tiny-moe", 16, 8, 1, 100, 8, experts=4, top_k=2, expert_ffn=4,
                    shared_experts=0)  # fmt: skip
NO_LATENCY = Assumptions(latency_us=0.0, seq_len=4)


def _setup(model) -> Setup:
    return Setup(model, TINY_CLUSTER, 4, None, None, False, "test")


def test_fsdp_bytes_equal_a_hand_count() -> None:
    # block: wq, wo 8x8; wk, wv 8x4; w1, w2, w3 8x16; two norms of 8 = 592 elements.
    units = [16 * 8, 592, 592, 16 * 8 + 8]
    # forward gathers every unit, backward all but norm + output; BF16; ring: 3/4 via NIC.
    nic = (2 * sum(units) - units[-1]) * 2 * 3 / 4
    off = model_step(_setup(TINY_DENSE), NO_LATENCY, None)
    assert off.nic_bytes == pytest.approx(nic)
    assert off.collective_s == pytest.approx(nic / 1e9)
    assert off.other_comm_s == pytest.approx(sum(units) * 4 * 3 / 4 / 1e9)  # FP32 RS


def test_moe_bytes_equal_a_hand_count() -> None:
    # 4 tokens x top-2 x dim 8 x 2 bytes per GPU; 2 GPUs per node send half to the other node;
    # dispatch + combine, forward + backward, one layer.
    per_all_to_all = 2 * (4 * 2 * 8 * 2) * 2 / 4
    off = model_step(_setup(TINY_MOE), NO_LATENCY, None)
    assert off.nic_bytes == pytest.approx(4 * per_all_to_all)
    assert off.collective_s == pytest.approx(4 * per_all_to_all / 1e9)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_speedup_is_one_at_ratio_one_and_grows_with_it(setup: Setup) -> None:
    spec = Assumptions()
    rows = [model_rows(spec, Ratios(r, r, r), (setup,))[0] for r in (1.0, 1.2, 1.4, 2.0)]
    assert rows[0].e2e_speedup == pytest.approx(1.0)
    assert rows[0].comm_speedup == pytest.approx(1.0)
    for slower, faster in itertools.pairwise(rows):
        assert faster.e2e_speedup > slower.e2e_speedup
        assert faster.comm_speedup > slower.comm_speedup


def test_bad_options_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="mfu"):
        Assumptions(mfu=1.5)
    with pytest.raises(ConfigError, match="whole nodes"):
        model_step(Setup(TINY_DENSE, TINY_CLUSTER, 3, None, None, False, ""), NO_LATENCY, None)


def test_command_writes_json_with_the_expected_keys(tmp_path, capsys) -> None:
    argv = ["bench", "zipccl", "--weights-sample", "4096", "--demo-steps", "0"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert "modelled" in capsys.readouterr().out
    record = json.loads((tmp_path / "zipccl.json").read_text())
    assert {"command", "date", "machine", "assumptions", "ratios", "rows"} <= set(record)
    assert {"weights", "activations", "gradients"} <= set(record["ratios"])
    assert len(record["rows"]) == len(SETUPS)
    keys = {"setup", "gpus", "step_off_s", "step_on_s", "e2e_speedup", "comm_speedup",
            "paper_e2e", "paper_comm", "e2e_diff", "comm_diff"}  # fmt: skip
    assert keys <= set(record["rows"][0])
    assert (tmp_path / "zipccl.png").stat().st_size > 0
