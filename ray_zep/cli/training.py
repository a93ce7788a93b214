"""Commands around a training run: train, config, export, eval, report."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ray_zep.command_args import config_args
from ray_zep.config import config_to_yaml, load_config
from ray_zep.config.sizes import check_run


def add_commands(commands: argparse._SubParsersAction, argv: Sequence[str] = ()) -> None:
    train = commands.add_parser("train", help="train a model")
    config_args(train)
    train.set_defaults(handler=_train)

    config = commands.add_parser(
        "config", help="print the resolved config once it passes the checks train makes"
    )
    config_args(config)
    config.set_defaults(handler=_config)

    export = commands.add_parser("export", help="write a model as a Hugging Face checkpoint")
    export.add_argument("source", help="run directory, or YAML config with model.init_from")
    export.add_argument("overrides", nargs="*", help="key=value overrides")
    export.add_argument("--out", required=True, help="output directory")
    export.set_defaults(handler=_export)

    evaluate = commands.add_parser("eval", help="validation loss on the config's data")
    config_args(evaluate)
    evaluate.add_argument("--run", help="evaluate this run directory's last checkpoint")
    evaluate.add_argument("--batches", type=int, help="only the first N batches")
    evaluate.add_argument("--json", dest="json_path", help="write loss and documents here")
    evaluate.set_defaults(handler=_eval)

    report = commands.add_parser("report", help="draw a run's pictures from its metrics.jsonl")
    report.add_argument("run_dir", help="the run directory (train.out_dir)")
    report.set_defaults(handler=_report)


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ray_zep_workers.driver import train  # the only command here that needs Ray

    summary = train(config)
    if summary.final_loss is not None:
        restarts = f" after {summary.restarts} worker restart(s)" if summary.restarts else ""
        print(
            f"trained steps {summary.first_step + 1}..{summary.last_step}{restarts}: loss "
            f"{summary.first_loss:.4f} -> {summary.final_loss:.4f}, "
            f"{summary.tokens_per_second / 1e3:.1f}k tokens/s; run dir {summary.run_dir}"
        )
        _print_run_summary(config, summary.run_dir)
    else:
        print(f"nothing to train: {summary.run_dir} is already at step {summary.last_step}")
    return 0


def _print_run_summary(config, run_dir: Path) -> None:
    """Balance and traffic of the run, TE CP on its batches and the run's documents at a
    real shape (modelled)."""
    from ray_zep import steplog
    from ray_zep.bench.real_shape import real_shape_lines, real_shape_rows
    from ray_zep.constants import METRICS_FILE_NAME
    from ray_zep.errors import ZepError
    from ray_zep.report.run_summary import compare_with_te_cp, summary_lines
    from ray_zep.topology import build_topology

    rows = steplog.step_rows(run_dir / METRICS_FILE_NAME)
    if not rows:
        return
    comparison = None
    try:
        comparison = compare_with_te_cp(config, build_topology(config.topology), rows[-1]["step"])
    except ZepError as exc:
        print(f"te_cp comparison not modelled: {exc}")
    for line in summary_lines(rows, comparison):
        print(line)
    try:
        at_scale = real_shape_rows(config, config.metrics.summary_gpus)
    except ZepError as exc:
        print(f"real shape not modelled: {exc}")
        return
    for line in real_shape_lines(at_scale):
        print(line)


def _config(args: argparse.Namespace) -> int:
    """Print the resolved config once it passes the checks `train` makes before it starts
    a cluster, so a config printed here is one `train` accepts (the dataset, checkpoints
    and the cluster's resources aside)."""
    config = load_config(args.config, args.overrides)
    check_run(config)
    print(config_to_yaml(config), end="")
    return 0


def _report(args: argparse.Namespace) -> int:
    from ray_zep.report.run_plots import draw_run

    for path in draw_run(Path(args.run_dir)):
        print(f"wrote {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ray_zep.train.restore import export_model, resolve_source

    source = resolve_source(args.source, args.overrides)
    out = export_model(source, args.out)
    origin = source.checkpoint or source.config.model.init_from
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} from {origin}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ray_zep.train.evaluate import run_eval
    from ray_zep.train.restore import resolve_source

    source = resolve_source(args.config, args.overrides, args.run)
    result = run_eval(source, args.batches)
    print(
        f"loss {result.loss:.6f} over {result.label_tokens} label tokens, "
        f"{len(result.documents)} documents in {result.batches} batches"
    )
    if args.json_path:
        print(f"wrote {result.write_json(args.json_path)}")
    return 0
