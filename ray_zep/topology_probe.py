"""Build the Topology of a real GPU node from `nvidia-smi topo -m` and sysfs.

What is read:
- `nvidia-smi topo -m`: the GPU and NIC names, the link between every pair
  (`NV#` bonded NVLinks, or a PCIe path PIX < PXB < PHB < NODE < SYS from nearest
  to farthest) and each GPU's NUMA affinity.
- `/sys/class/infiniband/<dev>/ports/1/{rate,state,link_layer}`: speed and state
  of each RDMA NIC; `/sys/class/infiniband/<dev>/device/net/<ifname>` and
  `/sys/class/net/<ifname>/device/numa_node`: its network interface and NUMA node.

Decisions:
- Each GPU sends through its nearest active RDMA NIC; ties go to the faster NIC,
  then to one on the GPU's NUMA node, then to the NIC with the fewest GPUs so
  far, then to the lower index.
- The node's training NICs are the NICs some GPU was assigned to, in the order
  nvidia-smi lists them. Front-end and storage NICs are farther from every GPU
  than its compute NIC, so they drop out.
- Intra-node bandwidth is the slowest GPU pair: `NV#` counts 25 GB/s each way per
  link (NVLink 3 and 4); a pair joined only through PCIe counts 25 GB/s (Gen4 x16).
- NIC bandwidth is the slowest training NIC's sysfs rate.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ray_zep.errors import ProbeError
from ray_zep.topology import GB, GBIT, PRESETS, US, Topology

PCIE_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
"""Nearest first; NVLink pairs are ranked ahead of all PCIe paths."""
NVLINK_GBYTES_PER_LINK = 25.0
PCIE_GBYTES = 25.0


@dataclass(frozen=True)
class TopoMatrix:
    """Parsed `nvidia-smi topo -m`: device names and pairwise link labels."""

    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    links: dict[tuple[str, str], str]
    gpu_numa: dict[str, int | None]


@dataclass(frozen=True)
class NicInfo:
    name: str
    gbits_per_s: float
    active: bool
    numa_node: int | None


def parse_nvidia_smi_topo(text: str) -> TopoMatrix:
    """Parse the matrix printed by `nvidia-smi topo -m`.

    NIC columns are named `NIC<i>` with a legend mapping them to device names
    (recent drivers) or by the device name itself (older drivers); both work.

    Raises:
        ProbeError: no GPU rows could be found.
    """
    lines = [line.rstrip("\n") for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if re.search(r"\tGPU0\b", line)), None)
    if header_at is None:
        raise ProbeError("nvidia-smi topo -m output has no GPU0 column header")
    header = [cell.strip() for cell in lines[header_at].split("\t")]
    devices = [c for c in header[1:] if c and not c.endswith(("Affinity", "NUMA ID"))]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.MULTILINE))
    numa_col = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    links: dict[tuple[str, str], str] = {}
    gpu_numa: dict[str, int | None] = {}
    for line in lines[header_at + 1 :]:
        cells = [cell.strip() for cell in line.split("\t")]
        if not cells or cells[0] not in devices:
            continue
        for other, label in zip(devices, cells[1 : 1 + len(devices)], strict=False):
            links[(legend.get(cells[0], cells[0]), legend.get(other, other))] = label
        if cells[0].startswith("GPU"):
            gpu_numa[cells[0]] = _int_or_none(cells[numa_col]) if numa_col else None
    gpus = tuple(d for d in devices if re.fullmatch(r"GPU\d+", d))
    nics = tuple(legend.get(d, d) for d in devices if not re.fullmatch(r"GPU\d+", d))
    if not gpus:
        raise ProbeError("nvidia-smi topo -m output lists no GPUs")
    return TopoMatrix(gpus, nics, links, gpu_numa)


def read_sysfs_nics(sysfs_root: Path) -> dict[str, NicInfo]:
    """Speed, state and NUMA node of every RDMA device under `sysfs_root`."""
    ib_root = sysfs_root / "class" / "infiniband"
    if not ib_root.is_dir():
        return {}
    nics = {}
    for dev in sorted(p.name for p in ib_root.iterdir()):
        port = ib_root / dev / "ports" / "1"
        rate = _read(port / "rate")
        match = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
        numa = None
        net_dir = ib_root / dev / "device" / "net"
        if net_dir.is_dir():
            for ifname in sorted(p.name for p in net_dir.iterdir()):
                numa = _int_or_none(
                    _read(sysfs_root / "class" / "net" / ifname / "device" / "numa_node") or ""
                )
                break
        nics[dev] = NicInfo(
            name=dev,
            gbits_per_s=float(match.group(1)) if match else 0.0,
            active="ACTIVE" in (_read(port / "state") or ""),
            numa_node=numa,
        )
    return nics


def probe_node(
    topo_text: str, sysfs_root: Path, nodes: int = 1, gpu_model: str = "probed"
) -> Topology:
    """The Topology of `nodes` nodes built like the probed one.

    Args:
        topo_text: output of `nvidia-smi topo -m`.
        sysfs_root: root of sysfs (`/sys` on a live machine, a fixture in tests).
        nodes: how many such nodes the cluster has.
        gpu_model: GPU name for reports.

    Raises:
        ProbeError: no active RDMA NIC, or the outputs disagree.
    """
    matrix = parse_nvidia_smi_topo(topo_text)
    sysfs = read_sysfs_nics(sysfs_root)
    active = [n for n in matrix.nics if n in sysfs and sysfs[n].active and sysfs[n].gbits_per_s]
    if not active:
        raise ProbeError(
            f"no active RDMA NIC found (nvidia-smi lists {list(matrix.nics) or 'none'}, "
            f"sysfs lists {sorted(sysfs) or 'none'}); inter-node training needs one"
        )
    nearest = _nearest_nics(matrix, active, sysfs)
    used = set(nearest.values())
    training = [n for n in active if n in used]
    affinity = tuple(training.index(nearest[gpu]) for gpu in matrix.gpus)
    return Topology(
        name="probed",
        nodes=nodes,
        gpus_per_node=len(matrix.gpus),
        nics_per_node=len(training),
        gpu_to_nic=affinity,
        intra_node_bandwidth=_intra_node_gbytes(matrix) * GB,
        nic_bandwidth=min(sysfs[n].gbits_per_s for n in training) * GBIT,
        intra_node_latency=PRESETS["virtual"].intra_latency_us * US,
        inter_node_latency=PRESETS["virtual"].inter_latency_us * US,
        gpu_model=gpu_model,
        nic_names=tuple(training),
    )


def probe_local_node(nodes: int = 1) -> Topology:
    """Probe this machine (needs `nvidia-smi` and a Linux sysfs)."""
    if shutil.which("nvidia-smi") is None:
        raise ProbeError("nvidia-smi is not on PATH: the topology probe needs an NVIDIA GPU node")
    topo = _run(["nvidia-smi", "topo", "-m"])
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()
    return probe_node(topo, Path("/sys"), nodes=nodes, gpu_model=(names or ["probed"])[0].strip())


def _nearest_nics(matrix: TopoMatrix, nics: list[str], sysfs: dict[str, NicInfo]) -> dict[str, str]:
    """GPU name -> name of the NIC it sends through (see the module's decisions)."""
    load = dict.fromkeys(nics, 0)
    chosen = {}
    for gpu in matrix.gpus:
        costs = [
            (
                _pcie_rank(matrix, gpu, name),
                -sysfs[name].gbits_per_s,
                0 if sysfs[name].numa_node == matrix.gpu_numa.get(gpu) else 1,
                load[name],
                i,
            )
            for i, name in enumerate(nics)
        ]
        best = nics[min(costs)[-1]]
        load[best] += 1
        chosen[gpu] = best
    return chosen


def _pcie_rank(matrix: TopoMatrix, gpu: str, nic: str) -> int:
    label = matrix.links.get((gpu, nic)) or matrix.links.get((nic, gpu))
    if label is None:
        raise ProbeError(f"nvidia-smi topo -m has no link between {gpu} and {nic}")
    return PCIE_RANK.get(label, PCIE_RANK["SYS"])


def _intra_node_gbytes(matrix: TopoMatrix) -> float:
    slowest = None
    for a in matrix.gpus:
        for b in matrix.gpus:
            if a == b:
                continue
            match = re.fullmatch(r"NV(\d+)", matrix.links.get((a, b), ""))
            speed = int(match.group(1)) * NVLINK_GBYTES_PER_LINK if match else PCIE_GBYTES
            slowest = speed if slowest is None else min(slowest, speed)
    return slowest if slowest is not None else PCIE_GBYTES


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ProbeError(f"{' '.join(cmd)} failed: {exc}") from None
    return done.stdout


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) and int(text) >= 0 else None
