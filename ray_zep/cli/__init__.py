"""The `ray-zep` command line: one module per command family (training, planning,
bench, data), each declaring its arguments next to its handlers; `plan_run` and
`simulate_run` run and show `ray-zep plan` and `ray-zep simulate` for `planning`.

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
    ray-zep bench scale [--gpus 64,...,4096] [--placements ...] [--plan-only] [--out DIR]
                                             placements from 64 to 4,096 GPUs, modelled
    ray-zep bench scale-replay RECORD [--placements zeppelin] [--out DIR]
                                             a bench scale record's rows again, each at
                                             the room it kept
    ray-zep bench memory [CONFIG] [--weights ...] [--checkpointing ...] [--out DIR]
                                             per-rank memory, modelled and measured
    ray-zep bench soak [CONFIG] [--steps 2000] [--warm-up N] [--out DIR]
                                             a long run: memory, descriptors and step time of
                                             the driver, the data actor and every rank
    ray-zep bench --help                     every bench; each writes OUT/NAME.json and a PNG

Errors on bad input are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ray_zep.cli import bench, data, planning, training
from ray_zep.errors import ZepError
from ray_zep.logs import setup_logging

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
FAMILIES = (training, planning, bench, data)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
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


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Every family's commands. A family may build only what `argv` asks for: the benches
    import their modules for `ray-zep bench ...` alone, so other commands start at once."""
    parser = argparse.ArgumentParser(prog="ray-zep", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.add_commands(commands, argv)
    return parser
