"""The `ray-zep` command line.

    ray-zep train CONFIG [key=value ...]     train (starts a local Ray unless one is given)
    ray-zep config CONFIG [key=value ...]    print the resolved config
    ray-zep export (RUN_DIR | CONFIG) [key=value ...] --out DIR
                                             write a run's last checkpoint (or model.init_from)
                                             as a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM
    ray-zep eval CONFIG [key=value ...] [--run RUN_DIR] [--batches N] [--json F]
                                             validation loss of model.init_from (or the run's
                                             last checkpoint) on the config's data, per document
    ray-zep report RUN_DIR                   draw a run's loss.png, throughput.png and load.png
    ray-zep topology [CONFIG] [key=value ...] [--probe]
                                             print the topology (or probe this GPU node)
    ray-zep data build INPUT ... --out FILE  tokenize text/JSONL into a Parquet dataset
    ray-zep data stats SOURCE                documents, tokens and length percentiles
    ray-zep plan [CONFIG] [key=value ...] [--lengths 9000,300 | --distribution arxiv]
                                             place one batch, print a per-rank table
    ray-zep plan --auto [CONFIG] [key=value ...] [--distribution arxiv --tokens 256k]
                 [--batches 3] [--calibration FILE] [--out best.yaml]
                                             rank every composition by simulated step time,
                                             keep what fits, write the winner's config
    ray-zep simulate [CONFIG] [key=value ...] [--strategies zeppelin,te_cp,...] [--ablation]
                     [--distribution arxiv --tokens 256k] [--calibration FILE] [--json PATH]
                                             predicted step time and speedup per strategy
    ray-zep bench calibrate [CONFIG] [--out DIR]
                                             measure this device (attention per length, matmul,
                                             element-wise, optimizer) and, on CPU, the virtual
                                             cluster's links and the trainer's fixed step cost
    ray-zep bench validate [CONFIG] [key=value ...] [--quick] [--sittings N] [--json F]
                                             calibrate, train every placement x {replicated,
                                             fsdp}, predict them, simulate the paper headlines
    ray-zep bench train [CONFIG] [key=value ...] [--strategies ...] [--steps K]
                                             real CPU runs per strategy beside the simulator
    ray-zep bench train [CONFIG] --compare compression [--cases fsdp,...] [--modes off,auto,always]
                                             the same steps with ZipCCL off and on
    ray-zep bench codec [CONFIG] [key=value ...] [--values N] [--codecs zipccl,zstd-3,...]
                                             ZipCCL codec vs zstd, lz4, blosc2 on synthetic
                                             and the model's real tensors
    ray-zep bench partition [CONFIG] [key=value ...] [--out DIR]
                                             planner latency and plan quality, all planners
    ray-zep bench layers [CONFIG] [key=value ...] [--out DIR]
                                             routing NIC bytes and remap solver on plans
    ray-zep bench tawpipe [--hidden ...] [--seq-lens ...] [--nic-gbps G] [--cpu-steps K]
                                             weight-passing strategies: simulated on TawPipe's
                                             testbed and trained on CPU
    ray-zep bench moe [--models ...] [--seq-lens ...] [--cpu-ranks N] [--nic-gbps G]
                      [--intra-gbytes B] [--out DIR]
                                             FoldMoE schedules: simulated and measured
    ray-zep bench zipccl [--mfu F] [--codec-dram-fraction F] [--demo-steps K] [--out DIR]
                                             ZipCCL's paper setups, modelled off and on with
                                             the ratios our codec measures here

Errors on bad input are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ray_zep.config import config_to_yaml, load_config
from ray_zep.errors import ZepError
from ray_zep.logs import setup_logging
from ray_zep.parallel.axes import WeightsMode

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may also follow the options
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    setup_logging(None)
    try:
        return args.handler(args)
    except ZepError as exc:
        print(f"ray-zep: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(
            "ray-zep: interrupted; rerun the same command to resume from the last checkpoint",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-zep", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model")
    _config_args(train)
    train.set_defaults(handler=_train)

    config = commands.add_parser("config", help="print the resolved config")
    _config_args(config)
    config.set_defaults(handler=_config)

    export = commands.add_parser("export", help="write a model as a Hugging Face checkpoint")
    export.add_argument("source", help="run directory, or YAML config with model.init_from")
    export.add_argument("overrides", nargs="*", help="key=value overrides")
    export.add_argument("--out", required=True, help="output directory")
    export.set_defaults(handler=_export)

    evaluate = commands.add_parser("eval", help="validation loss on the config's data")
    _config_args(evaluate)
    evaluate.add_argument("--run", help="evaluate this run directory's last checkpoint")
    evaluate.add_argument("--batches", type=int, help="only the first N batches")
    evaluate.add_argument("--json", dest="json_path", help="write loss and documents here")
    evaluate.set_defaults(handler=_eval)

    report = commands.add_parser("report", help="draw a run's pictures from its metrics.jsonl")
    report.add_argument("run_dir", help="the run directory (train.out_dir)")
    report.set_defaults(handler=_report)

    topology = commands.add_parser("topology", help="print the topology of a config")
    _optional_config_args(topology)
    topology.add_argument(
        "--probe", action="store_true", help="probe this GPU node with nvidia-smi and sysfs instead"
    )
    topology.set_defaults(handler=_topology)

    plan = commands.add_parser("plan", help="place one batch and show every rank's share")
    _optional_config_args(plan)
    plan.add_argument("--lengths", help="sequence lengths, e.g. 9000,300,64k (k = 1024)")
    plan.add_argument(
        "--distribution",
        help="draw lengths from a distribution: arxiv|github|prolong64k (Table 2) or chat",
    )
    plan.add_argument(
        "--tokens", help="batch tokens for --distribution, e.g. 256k (default: nodes x GPUs x L)"
    )
    plan.add_argument("--batch", type=int, default=0, help="else: batch index of the config's data")
    plan.add_argument(
        "--auto", action="store_true", help="search every composition with the simulator"
    )
    plan.add_argument("--batches", type=int, default=3, help="--auto: batches simulated (3)")
    plan.add_argument("--calibration", help="--auto: calibration.json instead of the GPU preset")
    plan.add_argument("--out", help="--auto: write the chosen config here (YAML)")
    plan.add_argument(
        "--sequence", help="placement, the same as parallel.sequence=... (default: the config's)"
    )
    plan.add_argument("--png", help="write a picture of the placement here")
    plan.add_argument("--json", dest="json_path", help="write ranks and fragments as JSON here")
    plan.set_defaults(handler=_plan)

    simulate = commands.add_parser("simulate", help="predict step time per placement on a cluster")
    _optional_config_args(simulate)
    simulate.add_argument(
        "--strategies",
        help="default: zeppelin,te_cp,llama_cp,hybrid_dp,megatron_hybrid_cp "
        "(also zeppelin+work, bytescale_hdp, ulysses, usp, te_cp+routing, "
        "te_cp+routing+partition)",
    )
    simulate.add_argument(
        "--ablation", action="store_true", help="add te_cp+routing, te_cp+routing+partition"
    )
    simulate.add_argument("--batches", type=int, default=3, help="sampled batches (default 3)")
    simulate.add_argument(
        "--distribution",
        help="draw batches from arxiv|github|prolong64k|chat instead of the data",
    )
    simulate.add_argument("--tokens", help="batch tokens for --distribution (e.g. 256k)")
    simulate.add_argument("--headroom", type=float, default=1.25, help="L / tokens per rank")
    simulate.add_argument("--calibration", help="calibration.json from `ray-zep bench calibrate`")
    simulate.add_argument("--json", dest="json_path", help="write the results as JSON here")
    simulate.add_argument("--out", default="runs/simulate", help="folder for the PNGs")
    simulate.set_defaults(handler=_simulate)

    bench = commands.add_parser("bench", help="run a benchmark (table, JSON and PNG)")
    benches = bench.add_subparsers(dest="bench_command", required=True)
    calibrate = benches.add_parser("calibrate", help="measure this device's compute rates")
    _optional_config_args(calibrate)
    calibrate.add_argument("--repeats", type=int, default=5, help="timed runs per size")
    calibrate.add_argument("--out", default="runs/bench/calibrate", help="output folder")
    calibrate.set_defaults(handler=_bench_calibrate)
    validate = benches.add_parser("validate", help="the simulator against real CPU runs")
    validate.add_argument("config", nargs="?", default="conf/demo.yaml", help="YAML config")
    validate.add_argument("overrides", nargs="*", help="key=value overrides")
    validate.add_argument("--quick", action="store_true", help="6 of the 14 modes (all headlines)")
    validate.add_argument(
        "--steps", type=int, help="steps per mode (2 warm-up; default 12, with --quick 8)"
    )
    validate.add_argument(
        "--sittings",
        type=int,
        default=1,
        help="runs of each mode, in passes over the modes (every second pass in reverse "
        "order); a mode's figures are over all its runs (default 1)",
    )
    validate.add_argument("--calibration", help="calibration.json (default: measure now)")
    validate.add_argument("--json", dest="json_path", help="write the rows here")
    validate.add_argument("--out", default="runs/bench/validate", help="runs and JSON folder")
    validate.set_defaults(handler=_bench_validate)
    train_bench = benches.add_parser("train", help="real CPU runs next to the simulator")
    train_bench.add_argument("config", nargs="?", default="conf/zeppelin.yaml", help="YAML config")
    train_bench.add_argument("overrides", nargs="*", help="key=value overrides")
    train_bench.add_argument(
        "--strategies",
        help="default: zeppelin,te_cp,llama_cp,hybrid_dp (also zeppelin+work, whole, "
        "PLACEMENT/WEIGHTS, a weights mode)",
    )
    train_bench.add_argument("--steps", type=int, default=8, help="steps per mode (2 warm-up)")
    train_bench.add_argument("--calibration", help="calibration.json (default: measure now)")
    train_bench.add_argument("--out", default="runs/bench/train", help="runs, JSON and PNG")
    train_bench.add_argument(
        "--compare",
        choices=["compression"],
        help="compression: each of --cases with comm.compression off and on, side by side",
    )
    train_bench.add_argument(
        "--cases", help="--compare compression: fsdp,zeppelin+fsdp,moe_ep2_1a1m (also tawpipe)"
    )
    train_bench.add_argument("--modes", help="--compare compression: off,auto,always")
    train_bench.set_defaults(handler=_bench_train)
    codec = benches.add_parser("codec", help="ZipCCL codec vs zstd, lz4, blosc2: ratio, GB/s")
    _optional_config_args(codec)
    codec.add_argument("--values", type=int, default=1 << 22, help="values per synthetic tensor")
    codec.add_argument("--repeats", type=int, default=3, help="timed runs (best is kept)")
    codec.add_argument("--train-steps", type=int, default=3, help="steps before real tensors")
    codec.add_argument("--codecs", help="default: zipccl,zipccl-torch,zstd-3,lz4,blosc2")
    codec.add_argument("--out", default="runs/bench/codec", help="JSON and PNG folder")
    codec.set_defaults(handler=_bench_codec)
    partition = benches.add_parser("partition", help="planner latency and plan quality")
    _optional_config_args(partition)
    partition.add_argument("--nodes", default="2,4,8", help="cluster sizes (default 2,4,8)")
    partition.add_argument("--tokens", default="64k,128k,256k", help="tokens per batch")
    partition.add_argument("--distributions", help="default: arxiv,github,prolong64k,short")
    partition.add_argument("--planners", help="default: every planner")
    partition.add_argument("--batches", type=int, default=3, help="batches per case")
    partition.add_argument("--repeats", type=int, default=5, help="timed runs per batch")
    partition.add_argument("--headroom", type=float, default=1.25, help="L / tokens per rank")
    partition.add_argument("--out", default="runs/bench/partition", help="JSON and PNG folder")
    partition.set_defaults(handler=_bench_partition)
    layers = benches.add_parser("layers", help="routing (NIC bytes) and remap (solver) on plans")
    _optional_config_args(layers)
    layers.add_argument("--nodes", default="2,4,8", help="cluster sizes (default 2,4,8)")
    layers.add_argument("--tokens", default="256k", help="tokens per batch (default 256k)")
    layers.add_argument("--distributions", help="default: arxiv,github,prolong64k")
    layers.add_argument("--planners", help="default: te_cp,zeppelin,hybrid_dp,usp")
    layers.add_argument("--batches", type=int, default=3, help="batches per case")
    layers.add_argument("--repeats", type=int, default=20, help="timed solves per batch")
    layers.add_argument("--out", default="runs/bench/layers", help="JSON and PNG folder")
    layers.set_defaults(handler=_bench_layers)
    scale = benches.add_parser("scale", help="placements from 64 to 4,096 GPUs, modelled")
    scale.add_argument("--gpus", default="64,256,1024,4096", help="cluster sizes (8 per node)")
    scale.add_argument("--distributions", help="default: arxiv,github,prolong64k,chat")
    scale.add_argument("--models", default="7b,13b", help="model presets (default 7b,13b)")
    scale.add_argument("--tokens", default="4k,16k", help="tokens per GPU on average")
    scale.add_argument("--placements", help="default: " + ",".join(_scale_placements()))
    scale.add_argument("--batches", type=int, default=1, help="sampled batches per case")
    scale.add_argument("--headroom", type=float, default=1.25, help="L / tokens per GPU")
    scale.add_argument(
        "--plan-only", action="store_true", help="plan, no simulation: work, bytes, ms, memory"
    )
    scale.add_argument("--out", default="runs/bench/scale", help="JSON and PNG folder")
    scale.set_defaults(handler=_bench_scale)
    moe = benches.add_parser("moe", help="MoE block latency per FoldMoE schedule")
    moe.add_argument("--models", default="gpt_moe_s,gpt_moe_m,gpt_moe_l", help="MoE presets")
    moe.add_argument("--seq-lens", default="4k,8k,16k,32k", help="sequence lengths")
    moe.add_argument("--degrees", default="2,4,8,16", help="overlap degrees to search")
    moe.add_argument(
        "--cpu-ranks", type=int, default=4, help="processes of the real runs (0: none)"
    )
    moe.add_argument("--cpu-tokens", type=int, default=2048, help="tokens per process")
    moe.add_argument("--cpu-degree", type=int, default=4, help="overlap degree of the real runs")
    moe.add_argument(
        "--nic-gbps", type=float, default=40.0, help="achieved Gb/s between nodes (default 40)"
    )
    moe.add_argument(
        "--intra-gbytes", type=float, default=5.0, help="achieved GB/s per GPU in a node (5)"
    )
    moe.add_argument("--out", default="runs/bench/moe", help="JSON and PNG folder")
    moe.set_defaults(handler=_bench_moe)

    tawpipe = benches.add_parser(
        WeightsMode.TAWPIPE.value, help="weight-passing modes on TawPipe's testbed"
    )
    tawpipe.add_argument("--hidden", default="1024,2048,4096", help="model dims H")
    tawpipe.add_argument("--seq-lens", default="4k,8k,16k", help="sequence lengths")
    tawpipe.add_argument(
        "--nic-gbps", type=float, default=10.0, help="line rate between nodes, Gb/s (10)"
    )
    tawpipe.add_argument("--cpu-config", default="conf/demo.yaml", help="config of the CPU runs")
    tawpipe.add_argument("--cpu-steps", type=int, default=6, help="steps of each CPU run (0: none)")
    tawpipe.add_argument("--out", default="runs/bench/tawpipe", help="JSON and PNG folder")
    tawpipe.set_defaults(handler=_bench_tawpipe)

    zipccl = benches.add_parser("zipccl", help="ZipCCL's paper setups, modelled off and on")
    zipccl.add_argument("--mfu", type=float, default=0.58, help="model FLOPs / peak (0.58)")
    zipccl.add_argument(
        "--codec-dram-fraction", type=float, default=0.5, help="codec rate / DRAM rate (0.5)"
    )
    zipccl.add_argument("--latency-us", type=float, default=10.0, help="alpha per ring step")
    zipccl.add_argument(
        "--weights-sample", type=int, default=0, help="values per weight tensor measured (0: all)"
    )
    zipccl.add_argument("--demo-config", default="conf/demo.yaml", help="model of the demo ratios")
    zipccl.add_argument(
        "--demo-steps", type=int, default=3, help="demo training steps (0: weights' ratio only)"
    )
    zipccl.add_argument("--out", default="runs/bench/zipccl", help="JSON and PNG folder")
    zipccl.set_defaults(handler=_bench_zipccl)

    memory = benches.add_parser("memory", help="per-rank memory, modelled and measured")
    _optional_config_args(memory)
    memory.add_argument("--weights", default="replicated,fsdp", help="weights modes to run")
    memory.add_argument(
        "--checkpointing", default="none,full", help="train.activation_checkpointing values"
    )
    memory.add_argument("--steps", type=int, default=3, help="steps per case; the last is measured")
    memory.add_argument("--out", default="runs/bench/memory", help="JSON and PNG folder")
    memory.set_defaults(handler=_bench_memory)

    data = commands.add_parser("data", help="build or inspect datasets")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    build = data_commands.add_parser("build", help="tokenize text/JSONL into Parquet")
    build.add_argument("inputs", nargs="+", help="text or JSONL files, or folders of them")
    build.add_argument("--out", required=True, help="output Parquet file")
    build.add_argument("--tokenizer", help="tokenizer.json (default: UTF-8 bytes, vocab 256)")
    build.add_argument("--text-key", default="text", help="JSONL field holding the text")
    build.set_defaults(handler=_data_build)
    stats = data_commands.add_parser("stats", help="summarise a dataset")
    stats.add_argument("source", help="Parquet file/folder or 'stdlib'")
    stats.set_defaults(handler=_data_stats)
    return parser


def _optional_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (defaults if omitted)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config, e.g. conf/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5")


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from workers.driver import train  # the only command that needs Ray

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
    """Balance and traffic of the run, and TE CP on its batches (modelled)."""
    from ray_zep import steplog
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


def _config(args: argparse.Namespace) -> int:
    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _report(args: argparse.Namespace) -> int:
    from ray_zep.report.run_plots import draw_run

    for path in draw_run(Path(args.run_dir)):
        print(f"wrote {path}")
    return 0


def _wrote(path: Path | None) -> None:
    """Say where a picture went; None: skipped without matplotlib, already logged."""
    if path is not None:
        print(f"wrote {path}")


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


def _optional_config(args: argparse.Namespace):
    """Load CONFIG + overrides where CONFIG may be omitted (then it is the first override)."""
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).exists():
        path, overrides = None, [path, *overrides]
    return load_config(path, overrides)


def _topology(args: argparse.Namespace) -> int:
    config = _optional_config(args)
    if args.probe:
        from ray_zep.topology_probe import probe_local_node

        print(probe_local_node(config.topology.nodes).describe())
    else:
        from ray_zep.topology import build_topology

        print(build_topology(config.topology).describe())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ray_zep.report.plan_command import PlanRequest, run_plan, write_outputs

    if args.auto:
        return _plan_auto(args)
    if args.sequence is not None:  # one more override: validated with the others
        args.overrides = [*args.overrides, f"parallel.sequence={args.sequence}"]
    request = PlanRequest(args.lengths, args.distribution, _tokens(args.tokens), args.batch)
    result = run_plan(_optional_config(args), request)
    print(result.table)
    for path in write_outputs(result, args.png, args.json_path):
        print(f"wrote {path}")
    result.memory.check()  # after the table: the refusal comes with the figures
    return 0


def _plan_auto(args: argparse.Namespace) -> int:
    import json

    from ray_zep.errors import ConfigError
    from ray_zep.report.simulate_command import SimulateRequest, batches_of, request_hardware
    from ray_zep.sim.auto import auto_plan, write_best
    from ray_zep.sim.replay import data_batches

    if args.batches < 1:
        raise ConfigError(f"--batches={args.batches} must be >= 1")
    config = _optional_config(args)
    hardware, on_gpu = request_hardware(config, args.calibration)
    if args.distribution:  # the same sampled lengths for every composition
        tokens = _tokens(args.tokens)
        request = SimulateRequest(None, False, args.batches, args.distribution, tokens)
        sampled = [(lengths, None) for lengths in batches_of(config, hardware.topology, request)[0]]

        def batches(candidate):
            return sampled
    else:  # the data as each composition's data actor draws it

        def batches(candidate):
            return data_batches(candidate, hardware.devices, 0, args.batches)

    result = auto_plan(config, hardware, batches, on_gpu)
    print(f"{hardware.source}; {args.batches} batches; {len(result.candidates)} compositions")
    print(result.table())
    if result.best is not None:
        print(f"chosen: {result.best.name}: {result.why()}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result.record(), indent=1) + "\n")
        print(f"wrote {args.json_path}")
    if args.out:
        print(f"wrote {write_best(result, Path(args.out))}")
    return 0


def _tokens(text: str | None) -> int | None:
    """A `--tokens` count, in the lengths' syntax (k = 1024): one syntax for every command."""
    from ray_zep.errors import ConfigError
    from ray_zep.report.plan_command import parse_lengths

    if not text:
        return None
    values = parse_lengths(text, "--tokens")
    if len(values) != 1:
        raise ConfigError(f"--tokens {text!r}: one count, e.g. --tokens 256k")
    return int(values[0])


def _simulate(args: argparse.Namespace) -> int:
    from ray_zep.report.simulate_command import SimulateRequest, run_simulate, write_outputs

    tokens = _tokens(args.tokens)
    request = SimulateRequest(
        args.strategies,
        args.ablation,
        args.batches,
        args.distribution,
        tokens,
        args.headroom,
        args.calibration,
    )
    result = run_simulate(_optional_config(args), request)
    print(result.table())
    for path in write_outputs(result, args.json_path, args.out):
        print(f"wrote {path}")
    return 0


def _bench_calibrate(args: argparse.Namespace) -> int:
    from ray_zep.bench.calibrate import calibrate
    from ray_zep.train.build import resolve_device

    config = _optional_config(args)
    device = resolve_device(config.train.device)
    result = calibrate(config, device, args.repeats)
    out = Path(args.out)
    if device.type == "cpu":  # the trainer's fixed step cost on this virtual cluster
        from workers.calibrate_step import measure_step_overhead  # trains through Ray

        result = measure_step_overhead(args.config, args.overrides, result, out.resolve())
    print(result.table())
    print(f"wrote {result.save(out / 'calibration.json')}")
    return 0


def _bench_validate(args: argparse.Namespace) -> int:
    from ray_zep.errors import ConfigError

    if args.steps is not None and args.steps < 3:
        raise ConfigError(f"--steps={args.steps} must be >= 3 (the first two are warm-up)")
    if args.sittings < 1:
        raise ConfigError(f"--sittings={args.sittings} must be >= 1 (runs of each mode)")
    import workers.bench_validate as bench  # trains through Ray, like `train`
    from ray_zep.bench.calibrate import Calibration
    from ray_zep.report.output import write_json

    if args.steps is None:
        args.steps = bench.QUICK_STEPS if args.quick else bench.STEPS

    calibration = Calibration.load(args.calibration) if args.calibration else None
    out = Path(args.out)
    result = bench.run_validate(
        args.config, args.overrides, args.quick, args.steps, out.resolve(), calibration,
        args.sittings,
    )  # fmt: skip
    print(result.table())
    written = result.calibration.save(out / "calibration.json")
    print(f"wrote {written}")
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep bench validate"
    spec = {"config": args.config, "overrides": args.overrides, "steps": args.steps,
            "quick": args.quick, "sittings": args.sittings}  # fmt: skip
    path = Path(args.json_path) if args.json_path else out / "validate.json"
    print(f"wrote {write_json(path, command, spec, result.rows())}")
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from ray_zep.errors import ConfigError

    if args.steps < 3:
        raise ConfigError(f"--steps={args.steps} must be >= 3 (the first two are warm-up)")
    if args.compare == "compression":
        return _bench_compression(args)
    import workers.bench_train as bench  # trains through Ray, like `train`
    from ray_zep.report.output import write_json
    from ray_zep.report.timeline import draw_throughput

    names = bench.check_names(_names(args.strategies, bench.DEFAULT_STRATEGIES))
    from ray_zep.bench.calibrate import Calibration

    calibration = Calibration.load(args.calibration) if args.calibration else None
    out = Path(args.out)
    rows, calibration = bench.run_train_bench(
        args.config, args.overrides, names, args.steps, out.resolve(), calibration
    )
    print(bench.format_table(rows))
    spec = {"config": args.config, "overrides": args.overrides, "steps": args.steps}
    spec["rates"] = calibration.rates.__dict__
    spec["link"] = {
        "latency_s": calibration.link_latency_s,
        "bandwidth": calibration.link_bandwidth,
        "core_share": calibration.core_share,
    }
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep bench train"
    print(f"wrote {write_json(out / 'train.json', command, spec, bench.row_dicts(rows))}")
    measured = [r.measured_tokens_per_second for r in rows]
    _wrote(draw_throughput("measured on this CPU", names, measured, out / "train.png"))
    return 0


def _bench_compression(args: argparse.Namespace) -> int:
    import workers.bench_compression as bench  # trains through Ray, like `train`
    from ray_zep.report.output import write_json
    from ray_zep.report.timeline import draw_throughput

    cases, modes = bench.check_cases(
        _names(args.cases, bench.DEFAULT_CASES), _names(args.modes, bench.MODES)
    )
    out = Path(args.out)
    rows = bench.run_compression_bench(
        args.config, args.overrides, cases, modes, args.steps, out.resolve()
    )
    print(bench.format_table(rows))
    spec = {"config": args.config, "overrides": args.overrides, "steps": args.steps}
    command = "ray-zep " + " ".join(sys.argv[1:])
    print(f"wrote {write_json(out / 'compression.json', command, spec, bench.row_dicts(rows))}")
    names = [f"{r.case} {r.mode}" for r in rows]
    chart = draw_throughput(
        "measured on this CPU", names, [r.tokens_per_second for r in rows], out / "compression.png"
    )
    _wrote(chart)
    return 0


def _bench_codec(args: argparse.Namespace) -> int:
    from ray_zep.bench import codec as bench

    codecs = _names(args.codecs, bench.CODECS)
    spec = bench.CodecBenchSpec(args.values, args.repeats, args.train_steps, codecs)
    config = _optional_config(args)
    for codec, reason in bench.available_codecs(codecs).items():
        if reason is not None:
            print(f"skipping {codec}: {reason}")
    tensors = {
        **bench.synthetic_tensors(spec.values),
        **bench.model_tensors(config, spec.train_steps),
    }
    rows = bench.run_codec_bench(tensors, spec)
    print(bench.format_table(rows))
    for goal, ok in bench.goals(rows):
        print(f"goal {'met' if ok else 'MISSED'}: {goal}")
    _write_bench(args, config, spec, "codec", bench.row_dicts(rows))
    _wrote(bench.draw_codec_chart(rows, Path(args.out) / "codec.png"))
    return 0


def _bench_moe(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ray_zep.bench import moe as bench
    from ray_zep.errors import ConfigError
    from ray_zep.report.output import write_json
    from ray_zep.report.plan_command import parse_lengths

    for flag, value in (("--nic-gbps", args.nic_gbps), ("--intra-gbytes", args.intra_gbytes)):
        if not value > 0:
            raise ConfigError(f"{flag}={value} must be a positive bandwidth")
    spec = bench.MoEBenchSpec(
        models=tuple(_names(args.models, ())),
        seq_lens=tuple(int(n) for n in parse_lengths(args.seq_lens, "--seq-lens")),
        degrees=tuple(int(d) for d in args.degrees.split(",")),
        cpu_ranks=args.cpu_ranks,
        cpu_tokens=args.cpu_tokens,
        cpu_degree=args.cpu_degree,
        nic_gbps=args.nic_gbps,
        intra_gbytes=args.intra_gbytes,
    )
    rows = bench.simulate_rows(spec)
    if spec.cpu_ranks > 1:
        rows += bench.measure_rows(spec)
    print(bench.format_table(rows))
    if ("gpt_moe_m", 16384) in {(r.model, r.seq_len) for r in rows}:
        for goal, ok in bench.goals(rows):
            print(f"goal {'met' if ok else 'MISSED'}: {goal}")
    out = Path(args.out)
    record = write_json(out / "moe.json", "ray-zep " + " ".join(sys.argv[1:]), asdict(spec),
                        bench.row_dicts(rows))  # fmt: skip
    print(f"wrote {record}")
    _wrote(bench.draw_moe_chart(rows, out / "moe.png"))
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    from ray_zep.bench import memory as bench
    from ray_zep.config import ActivationCheckpointing
    from ray_zep.errors import ConfigError
    from ray_zep.parallel.axes import WEIGHTS_AXES, Family, WeightsMode
    from ray_zep.report.output import write_json

    if args.config is None and not args.overrides:  # the demo model on a virtual 1 x 8
        whole = ["parallel.sequence=whole", "parallel.routing=false", "parallel.remap=false"]
        sizes = ["topology.nodes=1", "topology.gpus_per_node=8", "data.packing=rank"]
        config = load_config(Path("conf/demo.yaml"), [*sizes, *whole])
    else:
        config = _optional_config(args)
    if args.steps < 2:
        raise ConfigError(f"--steps={args.steps}: at least 2 (the first has no optimizer state)")
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    known = [m.value for m in WeightsMode if WEIGHTS_AXES[m].family is Family.AUTOGRAD]
    checkpointing = [c.strip() for c in args.checkpointing.split(",") if c.strip()]
    for name in weights:
        if name not in known:
            raise ConfigError(f"--weights item {name!r}: choose from {', '.join(known)}")
    for name in checkpointing:
        if name not in [m.value for m in ActivationCheckpointing]:
            raise ConfigError(f"--checkpointing item {name!r}: none, full or selective")
    rows = bench.run_cases(config, bench.cases(weights, checkpointing), args.steps)
    checks = bench.goals(rows, config)
    print(bench.table(rows, checks))
    out = Path(args.out)
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep bench memory"
    spec = {"weights": weights, "checkpointing": checkpointing, "steps": args.steps}
    record_rows = bench.row_dicts(rows)
    print(
        f"wrote {write_json(out / 'memory.json', command, spec | {'goals': checks}, record_rows)}"
    )
    _wrote(bench.draw(rows, out / "memory.png"))
    return 0


def _bench_tawpipe(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ray_zep.bench import tawpipe as bench
    from ray_zep.errors import ConfigError
    from ray_zep.report.output import write_record
    from ray_zep.report.plan_command import parse_lengths

    if not args.nic_gbps > 0:
        raise ConfigError(f"--nic-gbps={args.nic_gbps} must be a positive bandwidth")
    if args.cpu_steps == 1 or args.cpu_steps < 0:
        raise ConfigError(f"--cpu-steps={args.cpu_steps}: 0 (no CPU runs) or >= 2 (one warm-up)")
    hidden = args.hidden.split(",")
    for item in hidden:
        if not item.isdigit() or int(item) % 128 or int(item) == 0:
            raise ConfigError(f"--hidden item {item!r} must be a positive multiple of 128")
    spec = bench.TawPipeBenchSpec(
        hidden=tuple(int(h) for h in hidden),
        seq_lens=tuple(int(n) for n in parse_lengths(args.seq_lens, "--seq-lens")),
        nic_gbps=args.nic_gbps,
    )
    rows = bench.simulate_rows(spec)
    print(f"simulated on {spec.cluster().source}")
    print(bench.format_table(rows))
    for goal, ok in bench.goals(rows):
        print(f"goal {'met' if ok else 'MISSED'}: {goal}")
    out = Path(args.out)
    record = {"spec": asdict(spec), "rows": bench.row_dicts(rows)}
    if args.cpu_steps:
        import workers.bench_train as train_bench  # trains through Ray, like `train`

        names = tuple(m.value for m in bench.MODES)
        cpu, _ = train_bench.run_train_bench(
            args.cpu_config, [], names, args.cpu_steps, out / "cpu"
        )
        print(f"\nreal CPU runs ({args.cpu_config}, {args.cpu_steps} steps each):")
        print(train_bench.format_table(cpu))
        record["cpu"] = train_bench.row_dicts(cpu)
    command = "ray-zep " + " ".join(sys.argv[1:])
    print(f"wrote {write_record(out / 'tawpipe.json', command, record)}")
    _wrote(bench.draw_tawpipe_chart(rows, out / "tawpipe.png"))
    return 0


def _bench_zipccl(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ray_zep.bench import zipccl_report as bench
    from ray_zep.bench.zipccl import Assumptions
    from ray_zep.errors import ConfigError
    from ray_zep.report.output import write_record

    if args.demo_steps < 0:
        raise ConfigError(f"--demo-steps={args.demo_steps}: must be >= 0 (0: no demo run)")
    spec = Assumptions(args.mfu, args.codec_dram_fraction, args.latency_us)
    weights = bench.layer_weights(sample=args.weights_sample)
    demo = None
    if args.demo_steps:
        from ray_zep.bench.codec import model_tensors

        demo = model_tensors(load_config(Path(args.demo_config), []), args.demo_steps)
    ratios = bench.measure_ratios(weights, demo)
    print(f"measured ratios (our codec, this machine): {asdict(ratios)}")
    rows = bench.model_rows(spec, ratios)
    print(bench.format_table(rows))
    out = Path(args.out)
    record = {
        "assumptions": asdict(spec),
        "ratios": asdict(ratios)
        | {"weights_values": weights.numel(), "demo_steps": args.demo_steps},
        "rows": bench.row_dicts(rows),
    }
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep bench zipccl"
    print(f"wrote {write_record(out / 'zipccl.json', command, record)}")
    _wrote(bench.draw_zipccl_chart(rows, out / "zipccl.png"))
    return 0


def _bench_partition(args: argparse.Namespace) -> int:
    from ray_zep.bench import partition as bench

    config = _bench_config(args)
    spec = bench.PartitionBenchSpec(
        **_bench_sizes(args, bench.DISTRIBUTIONS, bench.PLANNERS), headroom=args.headroom
    )
    rows = bench.run_partition_bench(config, spec)
    print(bench.format_table(rows))
    _write_bench(args, config, spec, "partition", bench.row_dicts(rows))
    _wrote(bench.draw_partition_chart(rows, Path(args.out) / "partition.png"))
    return 0


def _bench_layers(args: argparse.Namespace) -> int:
    from ray_zep.bench import layers as bench
    from ray_zep.data.synthetic import TABLE_2

    config = _bench_config(args)
    spec = bench.LayersBenchSpec(**_bench_sizes(args, tuple(TABLE_2), bench.PLANNERS))
    rows = bench.run_layers_bench(config, spec)
    print(bench.format_table(rows))
    _write_bench(args, config, spec, "layers", bench.row_dicts(rows))
    _wrote(bench.draw_layers_chart(rows, Path(args.out) / "layers.png"))
    return 0


def _scale_placements() -> tuple[str, ...]:
    from ray_zep.bench.scale import PLACEMENTS

    return PLACEMENTS


def _bench_scale(args: argparse.Namespace) -> int:
    from ray_zep.bench import scale as bench
    from ray_zep.report.output import write_json
    from ray_zep.report.plan_command import parse_lengths

    spec = bench.ScaleBenchSpec(
        gpus=tuple(int(n) for n in parse_lengths(args.gpus, "--gpus")),
        distributions=_names(args.distributions, bench.ScaleBenchSpec.distributions),
        models=_names(args.models, ()),
        tokens_per_gpu=tuple(int(t) for t in parse_lengths(args.tokens, "--tokens")),
        placements=_names(args.placements, bench.planned_placements(args.plan_only)),
        batches=args.batches,
        headroom=args.headroom,
        plan_only=args.plan_only,
    )
    rows = bench.run_scale_bench(spec, progress=lambda line: print(line, flush=True))
    print(bench.format_table(rows))
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep bench scale"
    path = write_json(Path(args.out) / "scale.json", command, spec.__dict__, bench.row_dicts(rows))
    print(f"wrote {path}")
    _wrote(bench.draw_scale_chart(rows, Path(args.out) / "scale.png"))
    return 0


def _bench_config(args: argparse.Namespace):
    """Benchmarks default to the paper's cluster A and the 7b model."""
    args.overrides = ["topology.preset=cluster_a", "model.preset=7b", *args.overrides]
    return _optional_config(args)


def _bench_sizes(args: argparse.Namespace, distributions, planners) -> dict:
    from ray_zep.report.plan_command import parse_lengths

    return dict(
        nodes=tuple(int(n) for n in parse_lengths(args.nodes, "--nodes")),
        tokens=tuple(int(t) for t in parse_lengths(args.tokens, "--tokens")),
        distributions=_names(args.distributions, distributions),
        planners=_names(args.planners, planners),
        batches=args.batches,
        repeats=args.repeats,
    )


def _write_bench(args: argparse.Namespace, config, spec, name: str, rows: list[dict]) -> None:
    from ray_zep.report.output import write_json

    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else f"ray-zep bench {name}"
    record = {**spec.__dict__, "topology": config.topology.preset, "model": config.model.preset}
    print(f"wrote {write_json(Path(args.out) / f'{name}.json', command, record, rows)}")


def _names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return default if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def _data_build(args: argparse.Namespace) -> int:
    from ray_zep.data.builder import build_dataset
    from ray_zep.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    stats = build_dataset(args.inputs, args.out, tokenizer, text_key=args.text_key)
    print(
        f"wrote {stats.documents} documents, {stats.tokens} tokens (longest {stats.max_length},"
        f" vocab {tokenizer.vocab_size}) to {stats.path}"
    )
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    from ray_zep.data.catalog import parquet_path
    from ray_zep.data.source import ParquetSource

    source = ParquetSource(parquet_path(args.source))
    lengths = source.lengths
    pct = np.percentile(lengths, [10, 50, 90, 99]).astype(int)
    print(
        f"{source.name}: {len(lengths)} documents, {int(lengths.sum())} tokens; length "
        f"p10 {pct[0]} p50 {pct[1]} p90 {pct[2]} p99 {pct[3]} max {int(lengths.max())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
