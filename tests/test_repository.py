"""The repository keeps its promises: README commands, CI, docs, dashboard, layering."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from ray_zep import metrics
from ray_zep.config import Config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _readme_commands() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", README, flags=re.DOTALL)
    assert block and README.index(block.group(0)) < 30, "the commands open the README"
    return block.group(1).strip().splitlines()


def test_readme_opens_with_the_demo_and_test_commands() -> None:
    train, test = _readme_commands()
    assert train.startswith("pip install torch==2.13.0 && pip install -e .")
    assert train.endswith("ray-zep train conf/demo.yaml")
    assert "pytest" in test and "'.[test]'" in test


def test_ci_runs_ruff_and_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    _, test = _readme_commands()
    assert test in ci.splitlines()
    assert ci.index("ruff check") < ci.index(test)


def _schema_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(schema):
        kind = typing.get_type_hints(schema)[field.name]
        if dataclasses.is_dataclass(kind):
            keys += _schema_keys(kind, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


@pytest.mark.parametrize("key", _schema_keys(Config))
def test_every_config_key_is_documented(key: str) -> None:
    assert f"`{key}`" in README, f"README's configuration table lacks {key}"


@pytest.mark.parametrize("spec", metrics.ALL_METRICS, ids=lambda s: s.name)
def test_every_metric_is_documented(spec: metrics.MetricSpec) -> None:
    assert f"`{spec.name}" in README


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = set()
    for spec in metrics.ALL_METRICS:
        exported.add(spec.name)
        if spec.kind is metrics.Kind.HISTOGRAM:
            exported |= {spec.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    dashboard = json.loads((REPO / "dashboards" / "ray_zep.json").read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bray_zep_[a-z_]+", target["expr"]):
                assert name in exported, f"panel {panel['title']!r} queries unknown {name}"


def test_layout() -> None:
    for path in (
        "pyproject.toml",
        "README.md",
        "BENCHMARKS.md",
        ".ci/run",
        "ray_zep",
        "workers",
        "cuda",
        "conf/demo.yaml",
        "deploy",
        "tests",
        "dashboards",
    ):
        assert (REPO / path).exists(), path


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in a module."""
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
    return found


def test_library_never_imports_ray() -> None:
    """Only the CLI's commands that train (train, and bench train, which trains every
    strategy through the same driver) reach the Ray layer, through lazy imports."""
    for path in (REPO / "ray_zep").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        for name, top_level in _imports(ast.parse(path.read_text())):
            if name.split(".")[0] not in ("ray", "workers"):
                continue
            lazy = rel == "ray_zep/cli.py" and not top_level
            allowed = lazy and name in ("workers.driver", "workers.bench_train")
            assert allowed, f"{rel} imports {name}"
