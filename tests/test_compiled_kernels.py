"""The planner's compiled loops (`ray_zep.partition.compiled`): each gives, compiled, what
it gives run as Python, on float inputs whose sums round, and sums a node's load as
numpy does, so that ties fall where the array code they replaced put them. What each
kernel chooses is checked against scans in tests/test_load_index.py,
tests/test_co_rings.py and tests/test_balance.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.options import DkvWire
from ray_zep.partition import sum_kernel
from ray_zep.partition.compiled import forget_stale_kernels
from ray_zep.partition.group_kernel import group_kernel
from ray_zep.partition.guest_kernel import costs_of, host_costs
from ray_zep.partition.ring_search_kernel import _node_load, co_member_ring, spare_ring
from ray_zep.partition.sum_kernel import pairwise_sum
from ray_zep.partition.work import RingParts, WorkModel
from ray_zep.topology import build_topology
from tests.test_narrow_usp import usp_cluster

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("gpus", [2, 4, 7, 8, 12, 16, 24])
def test_a_nodes_load_is_summed_as_numpy_sums_it(gpus: int) -> None:
    rng = np.random.default_rng(gpus)
    load = rng.random(gpus * 50) * 10.0 ** rng.integers(-3, 4, gpus * 50)
    expected = load.reshape(-1, gpus).sum(axis=1)
    got = np.asarray([_node_load(load, node, gpus) for node in range(50)])
    assert got.tobytes() == expected.tobytes()


def _fill_case(seed: int, gpus: int = 8, nodes: int = 16):
    rng = np.random.default_rng(seed)
    world = gpus * nodes
    load = rng.random(world) * rng.choice([0.5, 1.0], world)
    tokens = rng.integers(0, 900, world)
    in_ring = rng.random(world) < 0.4
    labels = np.where(rng.random(world) < 0.7, rng.integers(-2, 6, world), -1)
    member = np.sort(rng.random(gpus - 1) * 0.5)[::-1].copy()
    return load, tokens, in_ring, labels, member, int(rng.integers(100, 2000))


@pytest.mark.parametrize("seed", range(40))
def test_the_small_ring_searches_answer_compiled_as_run_as_python(seed: int) -> None:
    load, tokens, in_ring, labels, member, n = _fill_case(seed)
    for level in (0.6, 0.9, 1.2):
        for search, taken in ((spare_ring, in_ring), (co_member_ring, labels)):
            ranks, k = search(taken, tokens, load, n, member, level, 1000, 8)
            ranks_py, k_py = search.py_func(taken, tokens, load, n, member, level, 1000, 8)
            assert k == k_py and ranks.tolist() == ranks_py.tolist()


@pytest.mark.parametrize("seed", range(20))
def test_the_ring_groups_loop_answers_compiled_as_run_as_python(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count, sizes = int(rng.integers(0, 300)), 7
    work = np.sort(rng.random((count, sizes)) * 0.6, axis=1)[:, ::-1].copy()
    lengths = rng.integers(100, 4000, count)
    chunks = -(-lengths[:, None] // np.arange(2, sizes + 2)[None, :])
    own = rng.integers(2, sizes + 2, count)
    args = (work, chunks, own, 1.0, 3000, float(rng.integers(200, 900)), 17.0,
            float(work[:, -1].min(initial=0.0)), int(chunks[:, -1].min(initial=0)))  # fmt: skip
    groups, group_of, degree_of, totals = group_kernel(*args)
    groups_py, group_of_py, degree_of_py, totals_py = group_kernel.py_func(*args)
    assert groups == groups_py
    if groups >= 0:
        assert group_of.tolist() == group_of_py.tolist()
        assert degree_of[:groups].tolist() == degree_of_py[:groups].tolist()
        assert totals[:groups].tobytes() == totals_py[:groups].tobytes()


@pytest.mark.parametrize(
    ("model", "routed", "dkv_wire", "keep_kv_gb", "room_mb", "pieces"),
    [
        ("7b", True, DkvWire.FLOAT32, 2.0, 5.0, 1),
        ("13b", False, DkvWire.OWNER, 0.0, 0.0, 4),
        ("13b", True, DkvWire.COMPUTE, 8.0, 0.0, 3),
    ],
)
def test_a_hosts_costs_are_the_work_models_bit_for_bit(
    model: str, routed: bool, dkv_wire: DkvWire, keep_kv_gb: float, room_mb: float, pieces: int
) -> None:
    """`host_costs` against `WorkModel.usp_group_costs` at U = G on ring parts, tokens and
    positions spread over orders of magnitude, head exchanges whole or in pieces: the
    same two floats, bit for bit."""
    _, run, _ = usp_cluster(16, model)
    topology = build_topology(load_config(None, ["topology.preset=cluster_a",
                                                 "topology.nodes=16"]).topology)  # fmt: skip
    work = WorkModel.create(run.shape, topology, run.hardware.rates, routed, dkv_wire, keep_kv_gb,
                            room_mb, capacity=6400, ulysses_pieces=pieces)  # fmt: skip
    rng = np.random.default_rng(3)
    count = 4000
    diagonal = rng.random(count) * rng.choice([1e-3, 1e-2, 0.3], count)
    step = rng.random(count) * rng.choice([1e-4, 1e-3, 1e-2], count)
    send = rng.random(count) * 10.0 ** rng.integers(4, 9, count)
    tokens = rng.integers(1000, 200_000, count).astype(np.float64)
    positions = rng.integers(1, 40, count)
    gpus = topology.gpus_per_node
    seconds, forward = work.usp_group_costs(RingParts(diagonal, step, send), tokens, positions,
                                            gpus)  # fmt: skip
    numbers = costs_of(work)
    got = np.asarray([host_costs(diagonal[i], step[i], send[i], tokens[i],
                                            float(positions[i]), numbers)
                      for i in range(count)])  # fmt: skip
    assert got[:, 0].tobytes() == seconds.tobytes()
    assert got[:, 1].tobytes() == forward.tobytes()


@pytest.mark.parametrize(
    "count", [0, 1, 7, 8, 9, 127, 128, 129, 255, 256, 1000, 4096, 16384, 40000]
)
def test_a_sum_over_the_ranks_is_numpys(count: int) -> None:
    """`sum_kernel.pairwise_sum` against numpy's sum of a float64 array, bit for bit."""
    rng = np.random.default_rng(count)
    values = rng.random(count + 5) * 10.0 ** rng.integers(-6, 6, count + 5)
    got = pairwise_sum(values, 3, count)
    assert np.float64(got).tobytes() == values[3 : 3 + count].sum().tobytes()


def test_a_sum_in_buffers_as_numpy_before_2_3_sums(monkeypatch) -> None:
    """Under numpy before 2.3 (`NUMPY_BUFFER` = 8,192) the kernel adds the buffers' pairwise
    sums one after another, as that numpy does; played here as Python on any numpy, each
    buffer's own sum numpy's (one buffer is summed pairwise by every version)."""
    monkeypatch.setattr(sum_kernel, "NUMPY_BUFFER", 8192)
    rng = np.random.default_rng(7)
    values = rng.random(30_005) * 10.0 ** rng.integers(-6, 6, 30_005)
    for count in (100, 8192, 8193, 30_000):
        part = values[5 : 5 + count]
        expected = 0.0
        for at in range(0, count, 8192):
            expected += float(part[at : at + 8192].sum())
        assert sum_kernel.pairwise_sum.py_func(values, 5, count) == expected


def test_a_kernel_cache_made_from_other_sources_is_dropped(tmp_path) -> None:
    """numba checks a cached kernel's own file alone: where any kernel file changed, the
    kernels cached beside them go (those of other modules stay), once."""
    (tmp_path / "a_kernel.py").write_text("x = 1\n")
    (tmp_path / "b_kernel.py").write_text("y = 2\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def cached() -> None:
        for name in ("a_kernel.f-3.py311.nbi", "b_kernel.g-1.py311.1.nbc", "other.h-2.py311.nbi"):
            (cache / name).touch()

    cached()
    assert forget_stale_kernels(tmp_path)  # no stamp yet: made from unknown sources
    assert sorted(p.name for p in cache.glob("*.nb?")) == ["other.h-2.py311.nbi"]
    cached()
    assert not forget_stale_kernels(tmp_path)  # the same sources: kept
    assert len(list(cache.glob("*.nb?"))) == 3
    (tmp_path / "b_kernel.py").write_text("y = 3\n")  # a callee's file changed
    assert forget_stale_kernels(tmp_path)
    assert sorted(p.name for p in cache.glob("*.nb?")) == ["other.h-2.py311.nbi"]


def test_a_process_that_plans_nothing_does_not_import_numba() -> None:
    """The planner's package imports its kernels as `Kernel`s; numba comes in on the first
    call of one (`compiled.compile_all`), not with the package."""
    probe = "import sys, ray_zep.partition, ray_zep.step_plan; print('numba' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.strip() == "False"
