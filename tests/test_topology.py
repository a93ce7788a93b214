"""Topology presets, rank layout, and the probe on recorded node outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ray_zep.config import TopologyConfig
from ray_zep.errors import ProbeError, TopologyError
from ray_zep.topology import GB, GBIT, LinkKind, Topology, build_topology
from ray_zep.topology_probe import parse_nvidia_smi_topo, probe_local_node, probe_node
from ray_zep.topology_resolve import NodeReport, report_local_node, resolve_topology

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "probe"


def test_cluster_a_matches_the_paper() -> None:
    topo = build_topology(TopologyConfig(preset="cluster_a", nodes=2))
    assert (topo.world_size, topo.gpus_per_node, topo.nics_per_node) == (16, 8, 4)
    assert topo.gpu_to_nic == (0, 0, 1, 1, 2, 2, 3, 3)  # each NIC shared by 2 GPUs
    assert topo.intra_node_bandwidth * 2 == pytest.approx(400 * GB)  # 400 GB/s bidirectional
    assert topo.nic_bandwidth == pytest.approx(200 * GBIT)
    assert topo.gpu_model == "A800-80G"


@pytest.mark.parametrize(
    ("preset", "gbits", "gpu"), [("cluster_b", 400, "H800"), ("cluster_c", 400, "H200")]
)
def test_one_nic_per_gpu_presets(preset: str, gbits: int, gpu: str) -> None:
    topo = build_topology(TopologyConfig(preset=preset, nodes=3))
    assert topo.world_size == 24
    assert topo.gpu_to_nic == tuple(range(8))
    assert topo.nic_bandwidth == pytest.approx(gbits * GBIT)
    assert topo.gpu_model == gpu


def test_virtual_topology_layout() -> None:
    topo = build_topology(TopologyConfig(nodes=2, gpus_per_node=4, nics_per_node=2))
    assert topo.world_size == 8
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [topo.local_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert list(topo.ranks_of_node(1)) == [4, 5, 6, 7]
    assert [topo.nic_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.gpus_on_nic(1) == (2, 3)
    assert topo.link_kind(1, 3) is LinkKind.INTRA_NODE
    assert topo.link_kind(3, 4) is LinkKind.INTER_NODE
    assert Topology.from_dict(topo.to_dict()) == topo
    assert "2 node(s) x 4" in topo.describe()


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (TopologyConfig(preset="cluster_z"), "topology.preset='cluster_z' is unknown"),
        (
            TopologyConfig(preset="cluster_a", gpus_per_node=4),
            "topology.gpus_per_node=4 contradicts topology.preset=cluster_a",
        ),
        (
            TopologyConfig(gpus_per_node=2, nics_per_node=4),
            "topology.nics_per_node=4 exceeds topology.gpus_per_node=2",
        ),
    ],
)
def test_bad_topologies(cfg: TopologyConfig, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        build_topology(cfg)


def test_rank_outside_topology() -> None:
    topo = build_topology(TopologyConfig(nodes=1, gpus_per_node=2))
    with pytest.raises(TopologyError, match=r"rank 2 is outside 0\.\.1"):
        topo.node_of(2)


def _sysfs(tmp_path: Path, name: str) -> Path:
    root = tmp_path / "sys"
    for rel, content in json.loads((FIXTURES / f"{name}.sysfs.json").read_text()).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content + "\n")
    return root


def test_probe_a800_node_with_four_shared_nics(tmp_path: Path) -> None:
    text = (FIXTURES / "a800_8gpu_4nic.topo.txt").read_text()
    topo = probe_node(text, _sysfs(tmp_path, "a800_8gpu_4nic"), nodes=2, gpu_model="A800")
    assert (topo.gpus_per_node, topo.nics_per_node, topo.world_size) == (8, 4, 16)
    assert topo.gpu_to_nic == (0, 0, 1, 1, 2, 2, 3, 3)
    assert topo.nic_names == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")  # front-end mlx5_4 left out
    assert topo.nic_bandwidth == pytest.approx(200 * GBIT)
    assert topo.intra_node_bandwidth == pytest.approx(8 * 25 * GB)  # NV8


def test_probe_h100_node_with_eight_nics_out_of_order(tmp_path: Path) -> None:
    text = (FIXTURES / "h100_8gpu_8nic.topo.txt").read_text()
    topo = probe_node(text, _sysfs(tmp_path, "h100_8gpu_8nic"))
    assert (topo.gpus_per_node, topo.nics_per_node) == (8, 8)
    assert topo.gpu_to_nic == tuple(range(8))
    # storage NICs (mlx5_1, mlx5_7) and the down port (mlx5_2) are not training NICs
    assert topo.nic_names == (
        "mlx5_0",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_9",
        "mlx5_10",
        "mlx5_11",
    )
    assert topo.nic_bandwidth == pytest.approx(400 * GBIT)
    assert topo.intra_node_bandwidth == pytest.approx(18 * 25 * GB)  # NV18


def test_parse_reads_gpus_nics_and_numa() -> None:
    matrix = parse_nvidia_smi_topo((FIXTURES / "a800_8gpu_4nic.topo.txt").read_text())
    assert matrix.gpus == tuple(f"GPU{i}" for i in range(8))
    assert matrix.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4")
    assert matrix.links[("GPU2", "mlx5_1")] == "PXB"
    assert matrix.gpu_numa["GPU5"] == 1


def test_probe_errors(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="no GPU0 column"):
        probe_node("No devices were found\n", tmp_path)
    text = (FIXTURES / "a800_8gpu_4nic.topo.txt").read_text()
    with pytest.raises(ProbeError, match="no active RDMA NIC"):
        probe_node(text, tmp_path / "empty-sysfs")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_local_probe_without_nvidia_smi_says_so() -> None:
    with pytest.raises(ProbeError, match="nvidia-smi is not on PATH"):
        probe_local_node()


def _a800_report(tmp_path: Path, host: str) -> NodeReport:
    text = (FIXTURES / "a800_8gpu_4nic.topo.txt").read_text()
    probed = probe_node(text, _sysfs(tmp_path, "a800_8gpu_4nic"), nodes=1, gpu_model="A800")
    return NodeReport(host, 8, topology=probed.to_dict())


def test_cpu_only_cluster_keeps_the_configured_virtual_topology() -> None:
    configured = build_topology(TopologyConfig(nodes=2, gpus_per_node=2))
    reports = [NodeReport("head", 0, error="no nvidia-smi on this node")]
    topology, origin = resolve_topology(reports, configured)
    assert topology is configured
    assert origin == "no GPU on the 1 Ray node(s): using the configured virtual topology (2 x 2)"


def test_alike_gpu_nodes_give_the_probed_topology(tmp_path: Path) -> None:
    configured = build_topology(TopologyConfig(nodes=2, gpus_per_node=8))
    reports = [_a800_report(tmp_path, "n0"), _a800_report(tmp_path, "n1")]
    topology, origin = resolve_topology(reports, configured)
    assert (topology.name, topology.nodes, topology.gpus_per_node) == ("probed", 2, 8)
    assert topology.gpu_to_nic == (0, 0, 1, 1, 2, 2, 3, 3)
    assert topology.nic_names == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert origin.startswith("probed topology (n0: 8 GPU(s), n1: 8 GPU(s))")


def test_probe_that_contradicts_the_config_keeps_the_config_and_says_why(
    tmp_path: Path,
) -> None:
    configured = build_topology(TopologyConfig(nodes=3, gpus_per_node=8))
    reports = [_a800_report(tmp_path, "n0"), _a800_report(tmp_path, "n1")]
    topology, origin = resolve_topology(reports, configured)
    assert topology is configured
    assert "does not give topology.nodes=3" in origin
    elastic, _ = resolve_topology(reports, configured, least=2)  # ray.min_nodes=2: two will do
    assert (elastic.name, elastic.nodes) == ("probed", 3)
    failed = [NodeReport("n0", 8, error="no active RDMA NIC found")]
    assert "n0: no active RDMA NIC found" in resolve_topology(failed, configured)[1]
    preset = build_topology(TopologyConfig(preset="cluster_a", nodes=2))
    named = "probe found n0: 8 GPU(s), n1: 8 GPU(s); using topology.preset=cluster_a"
    assert resolve_topology(reports, preset) == (preset, named)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_this_cpu_node_reports_no_gpu() -> None:
    assert report_local_node("here") == NodeReport("here", 0, error="no nvidia-smi on this node")
