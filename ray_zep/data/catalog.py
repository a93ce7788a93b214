"""Resolve `data.source` to a validated token source."""

from __future__ import annotations

from pathlib import Path

from ray_zep.config import Config
from ray_zep.data.builder import stdlib_dataset
from ray_zep.data.source import ParquetSource, TokenSource
from ray_zep.data.synthetic import SyntheticSource
from ray_zep.model_shapes import build_shape

STDLIB = "stdlib"
SYNTHETIC_PREFIX = "synthetic:"


def open_source(spec: str, vocab_size: int, seed: int, length_scale: float = 1.0) -> TokenSource:
    """Open the source that `data.source` names and check it against the vocabulary.

    Args:
        spec: `stdlib`, `synthetic:<arxiv|github|prolong64k|chat>`, or a Parquet path.
        vocab_size: the model's vocabulary size; every token id must be below it.
        seed: seed of synthetic documents.
        length_scale: multiplier of synthetic lengths.

    Raises:
        DataError subclasses naming the path or key to fix; ConfigError for an
        unknown synthetic distribution.
    """
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(spec[len(SYNTHETIC_PREFIX) :], vocab_size, seed, length_scale)
    source = ParquetSource(parquet_path(spec))
    source.check_vocab(vocab_size)
    return source


def parquet_path(spec: str) -> Path:
    """The Parquet file or folder a non-synthetic `data.source` names."""
    return stdlib_dataset() if spec == STDLIB else Path(spec)


def open_configured_source(config: Config) -> TokenSource:
    """The source `data.source` names, checked against the model's vocabulary."""
    data = config.data
    vocab_size = build_shape(config.model).vocab_size
    return open_source(data.source, vocab_size, config.train.seed, data.length_scale)
