"""`ray-zep data build` and `ray-zep data stats`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np


def add_commands(commands: argparse._SubParsersAction, argv: Sequence[str] = ()) -> None:
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
