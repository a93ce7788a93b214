"""Commands that decide before a run: topology, plan (and plan --auto), simulate."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ray_zep.command_args import optional_config, optional_config_args, tokens


def add_commands(commands: argparse._SubParsersAction, argv: Sequence[str] = ()) -> None:
    topology = commands.add_parser("topology", help="print the topology of a config")
    optional_config_args(topology)
    topology.add_argument(
        "--probe", action="store_true", help="probe this GPU node with nvidia-smi and sysfs instead"
    )
    topology.set_defaults(handler=_topology)

    plan = commands.add_parser("plan", help="place one batch and show every rank's share")
    optional_config_args(plan)
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
    optional_config_args(simulate)
    simulate.add_argument(
        "--strategies",
        help="default: zeppelin,te_cp,llama_cp,hybrid_dp,megatron_hybrid_cp "
        "(also zeppelin+work, zeppelin+cost, bytescale_hdp, ulysses, usp, te_cp+routing, "
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


def _topology(args: argparse.Namespace) -> int:
    config = optional_config(args)
    if args.probe:
        from ray_zep.topology_probe import probe_local_node

        print(probe_local_node(config.topology.nodes).describe())
    else:
        from ray_zep.topology import build_topology

        print(build_topology(config.topology).describe())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ray_zep.cli.plan_run import run_plan, write_outputs
    from ray_zep.sim.request import BatchRequest

    if args.auto:
        return _plan_auto(args)
    if args.sequence is not None:  # one more override: validated with the others
        args.overrides = [*args.overrides, f"parallel.sequence={args.sequence}"]
    request = BatchRequest(args.lengths, args.distribution, tokens(args.tokens), args.batch)
    result = run_plan(optional_config(args), request)
    print(result.table)
    for path in write_outputs(result, args.png, args.json_path):
        print(f"wrote {path}")
    result.memory.check()  # after the table: the refusal comes with the figures
    return 0


def _plan_auto(args: argparse.Namespace) -> int:
    import json

    from ray_zep.cli.plan_run import auto_table
    from ray_zep.errors import ConfigError
    from ray_zep.report.progress import ProgressLine
    from ray_zep.sim.auto import auto_plan, search_steps, write_best
    from ray_zep.sim.replay import data_batches
    from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware

    if args.batches < 1:
        raise ConfigError(f"--batches={args.batches} must be >= 1")
    config = optional_config(args)
    hardware, on_gpu = request_hardware(config, args.calibration)
    if args.distribution:  # the same sampled lengths for every composition
        count = tokens(args.tokens)
        request = SimulateRequest(None, False, args.batches, args.distribution, count)
        sampled = [(lengths, None) for lengths in batches_of(config, hardware.topology, request)[0]]

        def batches(candidate):
            return sampled

        data_of = None
    else:  # the data as each composition's data actor draws it

        def batches(candidate):
            return data_batches(candidate, hardware.devices, 0, args.batches)

        def data_of(candidate, count):
            return data_batches(candidate, hardware.devices, 0, count)

    steps = search_steps(config, hardware.devices)
    with ProgressLine(steps, "groups", every=10) as bar:  # stderr: the table is stdout
        result = auto_plan(config, hardware, batches, on_gpu, data_of, args.batches,
                           bar.counter())  # fmt: skip
    print(f"{hardware.source}; {args.batches} batches; {len(result.candidates)} compositions")
    print(auto_table(result))
    if result.best is not None:
        print(f"chosen: {result.best.name}: {result.why()}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result.record(), indent=1) + "\n")
        print(f"wrote {args.json_path}")
    if args.out:
        print(f"wrote {write_best(result, Path(args.out))}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from ray_zep.cli.simulate_run import result_table, write_outputs
    from ray_zep.sim.request import SimulateRequest, run_simulate

    request = SimulateRequest(
        args.strategies,
        args.ablation,
        args.batches,
        args.distribution,
        tokens(args.tokens),
        args.headroom,
        args.calibration,
    )
    result = run_simulate(optional_config(args), request)
    print(result_table(result))
    for path in write_outputs(result, args.json_path, args.out):
        print(f"wrote {path}")
    return 0
