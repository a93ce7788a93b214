"""Token sources: where documents come from.

A source numbers its documents 0..num_docs-1 (or without end for synthetic
data) and hands out each one's int32 token ids. The document number is the
sample id that checkpoints and the no-sample-lost checks refer to.

Parquet datasets hold one document per row in a column `tokens: list<int32>`
(other integer widths are accepted and narrowed after a range check). A folder
source reads every `*.parquet` file in it, in name order. Empty rows are kept
as documents of length 0 and skipped by the batcher.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ray_zep.errors import (
    CorruptDatasetError,
    DatasetNotFoundError,
    EmptyDatasetError,
    TokenOutOfVocabError,
)

log = logging.getLogger(__name__)

TOKENS_COLUMN = "tokens"


class TokenSource(Protocol):
    name: str
    num_docs: int | None
    """None for a source without end."""

    def length(self, doc: int) -> int: ...

    def tokens(self, doc: int) -> np.ndarray: ...

    def max_length(self) -> int | None:
        """Longest document, or None where unknown ahead of time."""
        ...


class ParquetSource:
    """Documents of one Parquet file or a folder of them, memory-mapped.

    Raises (from the constructor):
        DatasetNotFoundError: the path does not exist, or a folder holds no
            `*.parquet` file.
        CorruptDatasetError: a file is not Parquet or lacks a `tokens` column of
            integer lists.
        EmptyDatasetError: no document has any token.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        files = _parquet_files(self.path)
        values, offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        for file in files:
            file_values, file_offsets = _read_token_column(file)
            values.append(file_values)
            offsets.append(file_offsets[1:] + base)
            base += len(file_values)
        self._values = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
        self._offsets = np.concatenate(offsets)
        self._lengths = np.diff(self._offsets)
        self.num_docs: int | None = len(self._lengths)
        if not len(self._values):
            raise EmptyDatasetError(
                f"dataset {self.name!r} holds no tokens ({self.num_docs} rows, all empty); "
                "point data.source at a dataset with documents"
            )

    def length(self, doc: int) -> int:
        return int(self._lengths[doc])

    def tokens(self, doc: int) -> np.ndarray:
        return self._values[self._offsets[doc] : self._offsets[doc + 1]].astype(np.int32)

    def max_length(self) -> int | None:
        return int(self._lengths.max())

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def check_vocab(self, vocab_size: int) -> None:
        """Raise TokenOutOfVocabError naming the first token outside [0, vocab_size)."""
        bad = np.flatnonzero((self._values < 0) | (self._values >= vocab_size))
        if len(bad):
            doc = int(np.searchsorted(self._offsets, bad[0], side="right") - 1)
            raise TokenOutOfVocabError(
                f"token id {int(self._values[bad[0]])} in document {doc} of {self.name!r} is "
                f"outside the model's vocabulary [0, {vocab_size}); use a model whose "
                "model.vocab_size covers the dataset's tokenizer"
            )


def _parquet_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DatasetNotFoundError(
            f"data.source={str(path)!r} does not exist; give a Parquet file or folder, "
            "'stdlib' or 'synthetic:<arxiv|github|prolong64k|chat>'"
        )
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix == ".parquet" and p.is_file())
    if not files:
        raise DatasetNotFoundError(f"data.source={str(path)!r} is a folder without *.parquet files")
    return files


def _read_token_column(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """Flat token values and row offsets (int64) of one file's `tokens` column."""
    try:  # ParquetFile reads one file; pq.read_table imports pyarrow.dataset (and pandas)
        parquet = pq.ParquetFile(file, memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptDatasetError(f"{str(file)!r} is not a readable Parquet file: {exc}") from None
    with parquet:
        _check_token_schema(file, parquet.schema_arrow)
        try:
            column = parquet.read(columns=[TOKENS_COLUMN])[TOKENS_COLUMN]
            array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        except (pa.ArrowException, OSError) as exc:
            raise CorruptDatasetError(f"{str(file)!r} cannot be read: {exc}") from None
    if array.null_count:
        raise CorruptDatasetError(f"{str(file)!r}: column '{TOKENS_COLUMN}' has null rows")
    if array.values.null_count:
        raise CorruptDatasetError(f"{str(file)!r}: column '{TOKENS_COLUMN}' has null tokens")
    offsets = _numeric_view(array.offsets).astype(np.int64)
    values = _numeric_view(array.values)[offsets[0] : offsets[-1]]
    return values, offsets - offsets[0]


def _numeric_view(array: pa.Array) -> np.ndarray:
    """A null-free integer array's values, read in place from its data buffer (pyarrow's
    own `to_numpy` imports pandas, a second of CPU in every process that opens a dataset)."""
    dtype = np.dtype(str(array.type))
    data = array.buffers()[1]
    if data is None or not len(array):  # an empty array may have no data buffer
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _check_token_schema(file: Path, schema: pa.Schema) -> None:
    """Refuse a file whose `tokens` column is missing or not a list of integers."""
    if TOKENS_COLUMN not in schema.names:
        raise CorruptDatasetError(
            f"{str(file)!r} has no '{TOKENS_COLUMN}' column (columns: {', '.join(schema.names)}); "
            "build datasets with `ray-zep data build`"
        )
    kind = schema.field(TOKENS_COLUMN).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(
        kind.value_type
    ):
        raise CorruptDatasetError(
            f"{str(file)!r}: column '{TOKENS_COLUMN}' is {kind}, expected list<int32>"
        )
