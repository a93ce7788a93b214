"""deploy/: KubeRay manifests valid against the CRDs, with keys and entrypoints that exist."""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from ray_zep.config import load_config
from ray_zep.config.sizes import check_live_sizes, least_nodes
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CRDS = REPO.parent / "shared" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}


def _manifest(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _schema(kind: str) -> dict:
    if not CRDS.is_dir():
        pytest.skip("../shared/kuberay-crds is absent: the CRDs to validate against")
    return _stored_schema(kind)


@functools.cache
def _stored_schema(kind: str) -> dict:
    """The openAPIV3Schema of the CRD's stored version (parsed once: the files are large)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml", "rayjob-elastic.yaml"])
def test_manifest_validates_against_its_crd(name: str) -> None:
    manifest = _manifest(name)
    schema = _schema(manifest["kind"])
    jsonschema.validate(manifest, schema)
    assert manifest["apiVersion"] == "ray.io/v1"


def test_schema_check_can_fail() -> None:
    broken = _manifest("raycluster.yaml")
    broken["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _schema("RayCluster"))


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def test_cluster_has_gpu_workers_shm_and_a_metrics_port_kept_inside() -> None:
    spec = _manifest("raycluster.yaml")["spec"]
    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False), "opt-in only: no Ingress for the dashboard"
    assert spec["authOptions"]["mode"] == "token"
    ports = {p["name"]: p["containerPort"] for p in _containers(head["template"])[0]["ports"]}
    assert ports["metrics"] == 9450
    for group in spec["workerGroupSpecs"]:
        (worker,) = _containers(group["template"])
        assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert any(e["name"].startswith("NCCL_") for e in worker["env"])
        shm = {m["name"] for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"}
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert [volumes[n]["emptyDir"]["medium"] for n in shm] == ["Memory"]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]


def test_job_targets_the_cluster_and_its_entrypoint_loads() -> None:
    cluster = _manifest("raycluster.yaml")
    job = _manifest("rayjob.yaml")["spec"]
    assert job["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    words = shlex.split(job["entrypoint"])
    assert words[:2] == ["ray-zep", "train"]
    config = load_config(str(REPO / words[2]), words[3:])
    assert config.metrics.port == 9450 and config.metrics.host == "0.0.0.0"
    workers = sum(g["replicas"] for g in cluster["spec"]["workerGroupSpecs"])
    assert config.topology.nodes == workers, "one worker pod per node"
    env = yaml.safe_load(job["runtimeEnvYAML"])["env_vars"]
    assert all(key.startswith(("NCCL_", "TORCH_NCCL_")) for key in env)


def test_pod_monitor_scrapes_the_head_metrics_port() -> None:
    monitor = _manifest("podmonitor.yaml")
    head = _manifest("raycluster.yaml")["spec"]["headGroupSpec"]["template"]
    labels = head["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    names = {p["name"] for p in _containers(head)[0]["ports"]}
    assert endpoint["port"] in names and endpoint["path"] == "/metrics"


def test_container_recipe_installs_the_package() -> None:
    recipe = (DEPLOY / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0" in recipe
    for folder in ("ray_zep", "workers", "conf"):
        assert f"COPY --chown=ray:users {folder} {folder}" in recipe
        assert (REPO / folder).is_dir()


def test_elastic_job_keeps_its_worker_group_between_the_minimum_and_the_topology() -> None:
    job = _manifest("rayjob-elastic.yaml")["spec"]
    cluster = job["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True, "lost pods are replaced"
    assert job["shutdownAfterJobFinishes"] is True
    (group,) = cluster["workerGroupSpecs"]
    words = shlex.split(job["entrypoint"])
    assert words[:2] == ["ray-zep", "train"]
    config = load_config(str(REPO / words[2]), words[3:])
    assert group["minReplicas"] == config.ray.min_nodes < config.topology.nodes
    assert group["replicas"] == group["maxReplicas"] == config.topology.nodes
    topology = build_topology(config.topology)
    check_live_sizes(config, topology, least_nodes(config, topology))  # what the driver checks
    (worker,) = _containers(group["template"])
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == config.topology.gpus_per_node
    assert config.metrics.port == 9450 and config.metrics.host == "0.0.0.0"
