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
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert train.startswith(f"{venv}pip install torch==2.13.0 && pip install -e '.[plots]' && ")
    assert train.endswith("ray-zep train conf/demo.yaml")
    assert test.startswith(venv) and "pytest" in test and "'.[test]'" in test


def test_ci_runs_the_readme_commands_verbatim_in_order_then_ruff() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    train, test = _readme_commands()
    assert train in ci and test in ci, "CI copies both README commands as they are written"
    assert ci.index(train) < ci.index(test) < ci.index("ruff check .")
    assert "ruff format --check ." in ci
    assert any("pip freeze" in line for line in ci), "CI prints the versions it resolved"
    assert ".venv/" in (REPO / ".gitignore").read_text().splitlines()


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
    """Nothing under ray_zep/ imports Ray. Only the command line (ray_zep/cli/) reaches
    the Ray layer in workers/: by lazy imports in the commands that train, and by the
    module names of the benches that train through Ray (`BENCHES`), imported only when
    such a bench is run."""
    from ray_zep.cli.bench import BENCHES

    module_name = re.compile(r"ray_zep_workers(\.\w+)+")  # a module of the Ray layer
    for path in (REPO / "ray_zep").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        command_line = rel.startswith("ray_zep/cli/")
        tree = ast.parse(path.read_text())
        for name, top_level in _imports(tree):
            root = name.split(".")[0]
            assert root != "ray", f"{rel} imports {name}"
            if root == "ray_zep_workers":
                assert command_line and not top_level, f"{rel} imports {name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = module_name.fullmatch(node.value)
                assert not named or command_line, f"{rel} names the module {node.value}"
    workers = [module for module in BENCHES.values() if module.startswith("ray_zep_workers.")]
    assert workers, "the benches that train through Ray live in workers/"
    for module in workers:
        file = module.replace("ray_zep_workers.", "workers/", 1).replace(".", "/") + ".py"
        assert (REPO / file).is_file(), module


def test_no_import_circle_inside_the_library() -> None:
    """Every import counts, lazy and TYPE_CHECKING ones too: a circle of files that name
    each other is a circle to a reader, whatever Python tolerates at run time."""
    files = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (REPO / "ray_zep").rglob("*.py")
    }
    graph = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        graph[module] = {n for n in names if n in files and n != module}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            assert dep not in path, "import circle: " + " -> ".join([*path, module, dep])
            if dep not in done:
                visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [])


AXES_MODULE = "ray_zep/parallel/axes.py"


def _axis_names() -> set[str]:
    from ray_zep.parallel.axes import Placement, WeightsMode

    return {m.value for m in (*Placement, *WeightsMode)}


def test_axis_names_are_spelled_in_one_module_only() -> None:
    """Code refers to placements and weights modes through the enums of the axes module:
    no string literal elsewhere equals one of their names (docstrings aside)."""
    names = _axis_names()
    found = []
    for path in [*(REPO / "ray_zep").rglob("*.py"), *(REPO / "workers").rglob("*.py")]:
        rel = path.relative_to(REPO).as_posix()
        if rel == AXES_MODULE:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        found += [
            f"{rel}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and node.value in names
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ]
    assert not found, f"axis names spelled outside {AXES_MODULE}: {found}"


def test_every_planned_placement_has_a_planner_and_every_value_a_description() -> None:
    from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES, Placement, WeightsMode
    from ray_zep.partition.registry import BUILT_IN, SPECS

    assert set(SEQUENCE_AXES) == set(Placement) and set(WEIGHTS_AXES) == set(WeightsMode)
    assert set(SPECS) == set(Placement), "every placement has one spec in the registry"
    for spec in BUILT_IN:
        assert (spec.planner is not None) == SEQUENCE_AXES[spec.axis.placement].planned, spec.name
    built_in = {spec.axis for spec in BUILT_IN}
    for axis in (*built_in, *WEIGHTS_AXES.values()):
        assert axis.summary and axis.name in README, f"{axis.name} is not in the README"


def test_the_ray_layer_is_imported_under_the_project_name() -> None:
    """workers/ installs as `ray_zep_workers`: a bare `workers` import would find another
    distribution's package, or nothing, on a user's machine."""
    for path in [
        *REPO.glob("ray_zep/**/*.py"),
        *REPO.glob("workers/*.py"),
        *REPO.glob("tests/**/*.py"),
    ]:
        for name, _ in _imports(ast.parse(path.read_text())):
            assert name.split(".")[0] != "workers", f"{path.relative_to(REPO)} imports {name}"
