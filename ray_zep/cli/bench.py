"""`ray-zep bench NAME`: one runner for every bench.

A bench is one module that declares `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> BenchResult`; the runner adds `--out` and `--json`, runs it, and hands the
result to the one writer (`ray_zep.report.output.publish`): the table, the goals, the
JSON record and the PNG. The benches that train through Ray live in `workers/`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import ModuleType

from ray_zep.command_args import command_line
from ray_zep.parallel.axes import WeightsMode
from ray_zep.report.output import publish

BENCHES = {
    "calibrate": "ray_zep_workers.bench_calibrate",
    "validate": "ray_zep_workers.bench_validate",
    "train": "ray_zep_workers.bench_train",
    "codec": "ray_zep.bench.codec",
    "partition": "ray_zep.bench.partition",
    "layers": "ray_zep.bench.layers",
    "scale": "ray_zep.bench.scale",
    "scale-replay": "ray_zep.bench.scale_replay",
    "outliers": "ray_zep.bench.outliers",
    "moe": "ray_zep.bench.moe",
    WeightsMode.TAWPIPE.value: "ray_zep_workers.bench_tawpipe",
    "zipccl": "ray_zep.bench.zipccl_report",
    "memory": "ray_zep.bench.memory",
    "step": "ray_zep.bench.step",
    "soak": "ray_zep_workers.bench_soak",
}
"""Every bench's name and module, in the order `ray-zep bench --help` lists them."""


def add_commands(commands: argparse._SubParsersAction, argv: Sequence[str] = ()) -> None:
    bench = commands.add_parser(
        "bench",
        help="run a benchmark (table, JSON and PNG)",
        description="Run a benchmark: it prints a table and writes OUT/NAME.json and a PNG.",
    )
    if "bench" not in argv:  # another command: no bench module is imported
        return
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="NAME")
    for module in bench_modules(argv):
        parser = benches.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(parser)
        parser.add_argument(
            "--out", default=f"runs/bench/{module.NAME}", help="folder of the JSON, PNG and runs"
        )
        default = f"OUT/{module.NAME}.json"
        help_json = f"the JSON record, its PNG beside it (default {default})"
        parser.add_argument("--json", dest="json_path", help=help_json)
        parser.set_defaults(handler=partial(run_bench, module))


def bench_modules(argv: Sequence[str] = ()) -> list[ModuleType]:
    """The module of the bench `argv` names, or every bench's (for --help and errors)."""
    after = list(argv)[list(argv).index("bench") + 1 :] if "bench" in argv else []
    asked = [after[0]] if after and after[0] in BENCHES else list(BENCHES)
    modules = [importlib.import_module(BENCHES[name]) for name in asked]
    for name, module in zip(asked, modules, strict=True):
        assert name == module.NAME, f"{BENCHES[name]} declares NAME={module.NAME!r}"
    return modules


def run_bench(module: ModuleType, args: argparse.Namespace) -> int:
    result = module.run(args)
    json_path = Path(args.json_path) if args.json_path else None
    publish(result, Path(args.out), command_line(f"ray-zep bench {module.NAME}"), json_path)
    return 0
