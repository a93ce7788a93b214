"""FoldMoE slicing (Alg. 1), schedules, simulator and `bench moe`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.bench.moe import COLUMNS, MoEBenchSpec, paper_footer, simulate_rows, speedup
from ray_zep.config import MoEPipeline
from ray_zep.model_shapes import PRESETS
from ray_zep.moe.schedule import Kind, build_program
from ray_zep.moe.slicing import micro_batch_sizes, slice_costs, time_uniform_slices
from ray_zep.report.text_table import render_table
from ray_zep.sim.moe_block import play, stage_times

pytestmark = pytest.mark.unit


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    degree=st.sampled_from([1, 2, 3, 4, 8, 16]),
)
def test_slices_cover_the_stream_and_feed_the_buffer_in_time(lengths, degree):
    slices = time_uniform_slices(lengths, degree, dim=256, heads=4)
    total = sum(lengths)
    assert len(slices) == degree and sum(slices) == total and min(slices) >= 0
    micro = micro_batch_sizes(total, degree)
    assert sum(micro) == total and len(micro) == degree
    for j in range(degree):  # after slice j, micro-batch j can leave the buffer
        assert sum(slices[: j + 1]) >= sum(micro[: j + 1])


@pytest.mark.parametrize("model", ["gpt_moe_s", "gpt_moe_m", "gpt_moe_l"])
@pytest.mark.parametrize("seq_len", [4096, 8192, 16384, 32768])
@pytest.mark.parametrize("degree", [2, 4, 8, 16])
def test_slices_after_the_quick_start_cost_the_same_within_10_percent(model, seq_len, degree):
    shape = PRESETS[model]
    slices = time_uniform_slices([seq_len], degree, shape.dim, shape.n_heads)
    assert slices[0] == seq_len // degree, "the quick-start slice is L/d tokens"
    costs = slice_costs([seq_len], slices, shape.dim, shape.n_heads)[1:]
    assert max(costs) <= 1.10 * min(costs), costs


def test_programs_run_every_step_once_and_keep_dependencies():
    for schedule in MoEPipeline:
        program = build_program(schedule, 4)
        d = 1 if schedule is MoEPipeline.NONE else 4
        for kind in (Kind.DISPATCH, Kind.EXPERTS, Kind.COMBINE):
            assert sorted(s.index for s in program if s.kind is kind) == list(range(d))
        position = {(s.kind, s.index): i for i, s in enumerate(program)}
        for j in range(d):
            assert position[(Kind.DISPATCH, j)] < position[(Kind.EXPERTS, j)]
            assert position[(Kind.EXPERTS, j)] < position[(Kind.COMBINE, j)]
    one = [str(s) for s in build_program(MoEPipeline.ONE_A_ONE_M, 3)]
    assert one[:5] == ["A0", "D0", "A1", "D1", "E0"], "1a1m: experts of 0 after attention of 1"


def test_simulated_schedules_order_as_the_paper_reports():
    rows = simulate_rows(MoEBenchSpec(models=("gpt_moe_m",), seq_lens=(16384,), cpu_ranks=0))
    total = {r.schedule: r.total_ms for r in rows}
    assert total["none"] > total["moe_only"] > total["aaam"] > total["1a1m"]
    assert speedup(rows, "gpt_moe_m", 16384) > 1.1
    assert "1a1m+uniform" in render_table(rows, COLUMNS)
    paper = paper_footer(rows)[-1].splitlines()[-1]  # Table 2's latencies, then our speedup
    assert paper.split("|")[1].strip() == "gpt_moe_m 16384" and "2750" in paper
    assert f"{speedup(rows, 'gpt_moe_m', 16384):.2f}" in paper


def test_attention_steps_carry_the_tensor_parallel_collectives():
    shape, cluster = PRESETS["gpt_moe_m"], MoEBenchSpec().cluster()
    one = stage_times(shape, 16384, MoEPipeline.ONE_A_ONE_M, 4, False, cluster)
    one_gpu = replace(cluster.topology, gpus_per_node=1, gpu_to_nic=(0,))
    alone = stage_times(
        shape, 16384, MoEPipeline.ONE_A_ONE_M, 4, False, replace(cluster, topology=one_gpu)
    )
    assert alone.attend_collectives == [0.0] * 4
    # a gather and a reduce-scatter of each 4096-token slice over 8 GPUs
    slice_bytes = 4096 * shape.dim * 2
    expected = 2 * (cluster.intra_latency + slice_bytes * 7 / 8 / cluster.intra_bandwidth)
    assert one.attend_collectives == pytest.approx([expected] * 4)
    program = build_program(MoEPipeline.NONE, 1)
    plain = stage_times(shape, 16384, MoEPipeline.NONE, 1, False, cluster)
    first = play(program, plain).compute[0]
    assert first[2] - first[1] == pytest.approx(plain.attend[0] + plain.attend_collectives[0])


def test_slower_links_leave_more_for_the_attention_moe_pipeline_to_hide():
    base = dict(models=("gpt_moe_m",), seq_lens=(16384,), cpu_ranks=0)
    gains = [
        speedup(simulate_rows(MoEBenchSpec(**base, nic_gbps=gbps)), "gpt_moe_m", 16384)
        for gbps in (20.0, 40.0, 80.0)
    ]
    assert gains[0] > gains[1] > gains[2] > 1.0


def test_bench_moe_writes_table_json_and_png(tmp_path):
    out = tmp_path / "moe"
    cmd = [sys.executable, "-m", "ray_zep.cli", "bench", "moe", "--models", "gpt_moe_s",
           "--seq-lens", "4k", "--degrees", "2,4", "--cpu-ranks", "2", "--cpu-tokens", "256",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1a1m+uniform" in done.stdout and "cpu" in done.stdout
    record = json.loads((out / "moe.json").read_text())
    assert {r["source"] for r in record["rows"]} == {"simulated", "cpu"}
    assert (out / "moe.png").stat().st_size > 1000
