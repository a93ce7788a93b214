"""Build Parquet token datasets from text and JSONL files.

Inputs: plain text files (one document each), JSONL files (one document per
line, text under a key, `text` by default), or folders of them (searched
recursively for *.txt, *.md, *.py, *.jsonl, in path order). The output is one
Parquet file with a `tokens: list<int32>` column, zstd-compressed, written to a
temporary name and renamed, so a reader never sees half a file.

The built-in `stdlib` dataset is this Python's own standard-library source
files, byte-tokenized: real text with long-tailed lengths (a few hundred bytes
to ~750 kB) that every machine has. It is built once and cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ray_zep import constants
from ray_zep.data.source import TOKENS_COLUMN
from ray_zep.data.tokenizer import ByteTokenizer, Tokenizer
from ray_zep.errors import CorruptDatasetError, DatasetNotFoundError, EmptyDatasetError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
ROWS_PER_GROUP = 512


@dataclass(frozen=True)
class BuildStats:
    path: Path
    documents: int
    tokens: int
    max_length: int


def write_token_parquet(docs: Iterable[np.ndarray], out: Path) -> BuildStats:
    """Write documents (int32 token arrays) as a Parquet dataset at `out`.

    Raises:
        EmptyDatasetError: no document has a token.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    schema = pa.schema([(TOKENS_COLUMN, pa.list_(pa.int32()))])
    documents = tokens = longest = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for group in _chunks(docs, ROWS_PER_GROUP):
                writer.write_table(pa.table({TOKENS_COLUMN: _list_array(group)}, schema=schema))
                documents += len(group)
                tokens += sum(len(d) for d in group)
                longest = max([longest, *(len(d) for d in group)])
        if tokens == 0:
            raise EmptyDatasetError(f"no input document for {str(out)!r} has any text")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return BuildStats(out, documents, tokens, longest)


def build_dataset(
    inputs: list[str | Path], out: str | Path, tokenizer: Tokenizer, text_key: str = "text"
) -> BuildStats:
    """Tokenize text/JSONL files (or folders of them) into one Parquet dataset."""
    files = list(_input_files([Path(p) for p in inputs]))
    return write_token_parquet(
        (tokenizer.encode(text) for text in _texts(files, text_key)), Path(out)
    )


def stdlib_dataset() -> Path:
    """Path of the cached stdlib dataset, building it on first use."""
    path = constants.cache_dir() / _stdlib_dataset_name()
    if not path.exists():
        files = stdlib_files()
        log.info("building the stdlib dataset from %d files into %s", len(files), path)
        write_token_parquet((ByteTokenizer.encode_bytes(f.read_bytes()) for f in files), path)
    return path


@functools.cache
def _stdlib_dataset_name() -> str:
    """The dataset's file name: this Python's version and a digest of its stdlib files'
    names and sizes (computed once per process: a driver opens the source several times)."""
    digest = hashlib.sha256()
    for file in stdlib_files():
        digest.update(f"{file.name}:{file.stat().st_size}\n".encode())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"stdlib-py{version}-{digest.hexdigest()[:12]}.parquet"


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library *.py files, in path order."""
    return list(_stdlib_files())


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    """One walk of the stdlib a process (os.walk: a tenth of Path.rglob's time)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in skip]
        paths = (os.path.join(folder, name) for name in names if name.endswith(".py"))
        found.extend(path for path in paths if os.path.isfile(path))
    return tuple(sorted(Path(path) for path in found))


def _input_files(inputs: list[Path]) -> Iterator[Path]:
    for path in inputs:
        if not path.exists():
            raise DatasetNotFoundError(f"input {str(path)!r} does not exist")
        if path.is_dir():
            yield from sorted(
                p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
            )
        else:
            yield path


def _texts(files: list[Path], text_key: str) -> Iterator[str]:
    for file in files:
        if file.suffix != ".jsonl":
            yield file.read_text(encoding="utf-8", errors="replace")
            continue
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    yield _jsonl_text(line, file, number, text_key)


def _jsonl_text(line: str, file: Path, number: int, text_key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorruptDatasetError(f"{file}:{number} is not valid JSON: {exc.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise CorruptDatasetError(
            f"{file}:{number} has no string field {text_key!r}; choose it with --text-key"
        )
    return record[text_key]


def _chunks(docs: Iterable[np.ndarray], size: int) -> Iterator[list[np.ndarray]]:
    group: list[np.ndarray] = []
    for doc in docs:
        group.append(np.asarray(doc, dtype=np.int32))
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _list_array(group: list[np.ndarray]) -> pa.ListArray:
    offsets = np.zeros(len(group) + 1, dtype=np.int32)
    np.cumsum([len(d) for d in group], out=offsets[1:])
    values = np.concatenate(group) if group else np.zeros(0, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))
