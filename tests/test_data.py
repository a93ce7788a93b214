"""Datasets: building, reading, validation errors, the built-in sources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_zep.data.builder import build_dataset, stdlib_dataset, stdlib_files, write_token_parquet
from ray_zep.data.catalog import open_source
from ray_zep.data.source import ParquetSource
from ray_zep.data.synthetic import BIN_EDGES_K, TOKENS_PER_K, SyntheticSource, bin_probabilities
from ray_zep.data.tokenizer import ByteTokenizer, JsonTokenizer
from ray_zep.errors import (
    ConfigError,
    CorruptDatasetError,
    DatasetNotFoundError,
    EmptyDatasetError,
    TokenOutOfVocabError,
)

pytestmark = pytest.mark.unit


def _docs(*lengths: int) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.int32) % 256 for n in lengths]


def test_build_from_text_jsonl_and_folders(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("héllo")
    (tmp_path / "in" / "b.jsonl").write_text(
        json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "xyz"}) + "\n"
    )
    (tmp_path / "in" / "ignored.bin").write_bytes(b"\x00")
    stats = build_dataset([tmp_path / "in"], tmp_path / "out.parquet", ByteTokenizer())
    assert (stats.documents, stats.tokens, stats.max_length) == (3, 11, 6)
    source = ParquetSource(stats.path)
    assert source.tokens(0).tolist() == list("héllo".encode())
    assert source.tokens(2).tolist() == [ord(c) for c in "xyz"]
    assert source.tokens(0).dtype == np.int32


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"b.jsonl:1 is not valid JSON"),
        (json.dumps({"body": "x"}), r"b.jsonl:1 has no string field 'text'"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "b.jsonl").write_text(line + "\n")
    with pytest.raises(CorruptDatasetError, match=message):
        build_dataset([tmp_path / "b.jsonl"], tmp_path / "o.parquet", ByteTokenizer())
    assert not (tmp_path / "o.parquet").exists()


def test_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = JsonTokenizer(tmp_path / "tokenizer.json")
    assert loaded.vocab_size == 3
    assert loaded.encode("hello world again").tolist() == [1, 2, 0]
    with pytest.raises(ConfigError, match="does not exist"):
        JsonTokenizer(tmp_path / "missing.json")


def test_source_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        ParquetSource(tmp_path / "nope.parquet")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DatasetNotFoundError, match="folder without"):
        ParquetSource(tmp_path / "empty_dir")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(CorruptDatasetError, match="not a readable Parquet file"):
        ParquetSource(corrupt)
    no_tokens = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), no_tokens)
    with pytest.raises(CorruptDatasetError, match="has no 'tokens' column"):
        ParquetSource(no_tokens)
    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"tokens": [["a"], ["b"]]}), strings)
    with pytest.raises(CorruptDatasetError, match="expected list<int32>"):
        ParquetSource(strings)
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, None]], pa.list_(pa.int32()))}), holes)
    with pytest.raises(CorruptDatasetError, match="has null tokens"):
        ParquetSource(holes)


def test_a_source_reads_token_columns_of_every_integer_width(tmp_path: Path) -> None:
    """Token columns of other integer widths (written from a table slice, with an empty
    row) read as the rows they hold."""
    rows = [[3, 1, 4], [], [1, 5], [9, 2, 6, 5]]
    for kind in (pa.int16(), pa.uint16(), pa.int64()):
        path = tmp_path / f"{kind}.parquet"
        table = pa.table({"tokens": pa.array([[7], *rows], pa.large_list(kind))}).slice(1)
        pq.write_table(table, path)
        source = ParquetSource(path)
        assert [source.tokens(i).tolist() for i in range(len(rows))] == rows, kind


def test_empty_datasets(tmp_path: Path) -> None:
    no_rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"tokens": pa.array([], type=pa.list_(pa.int32()))}), no_rows)
    with pytest.raises(EmptyDatasetError, match="holds no tokens"):
        ParquetSource(no_rows)
    with pytest.raises(EmptyDatasetError):
        write_token_parquet(_docs(0, 0), tmp_path / "blank.parquet")


def test_vocabulary_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"tokens": pa.array([[1, 2], [3, 300]], type=pa.list_(pa.int64()))}), path
    )
    with pytest.raises(TokenOutOfVocabError, match=r"token id 300 in document 1 .* \[0, 256\)"):
        open_source(str(path), 256, seed=0)
    assert open_source(str(path), 512, seed=0).tokens(1).tolist() == [3, 300]
    negative = tmp_path / "n.parquet"
    pq.write_table(pa.table({"tokens": [[-1]]}), negative)
    with pytest.raises(TokenOutOfVocabError, match="token id -1"):
        open_source(str(negative), 256, seed=0)


def test_folder_of_files_concatenates_in_name_order(tmp_path: Path) -> None:
    write_token_parquet(_docs(3, 0, 4), tmp_path / "b.parquet")
    write_token_parquet(_docs(2), tmp_path / "a.parquet")
    source = ParquetSource(tmp_path)
    assert source.num_docs == 4
    assert source.lengths.tolist() == [2, 3, 0, 4]
    assert source.tokens(3).tolist() == [0, 1, 2, 3]


def test_stdlib_dataset_is_built_once_from_real_text(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ZEP_CACHE_DIR", str(tmp_path))
    path = stdlib_dataset()
    assert path.parent == tmp_path
    built = path.stat().st_mtime_ns
    assert stdlib_dataset() == path and path.stat().st_mtime_ns == built
    source = ParquetSource(path)
    files = stdlib_files()
    assert source.num_docs == len(files) > 500
    assert source.length(0) == files[0].stat().st_size
    lengths = source.lengths
    assert lengths.max() > 50 * np.median(lengths), "stdlib lengths should be long-tailed"


@pytest.mark.parametrize("name", ["arxiv", "github", "prolong64k", "chat"])
def test_synthetic_lengths_follow_table_2(name: str) -> None:
    """Table 2's distributions, and the assumed chat mix in the same bins."""
    source = SyntheticSource(name, vocab_size=100, seed=1)
    lengths = np.array([source.length(i) for i in range(4000)])
    edges = np.array(BIN_EDGES_K) * TOKENS_PER_K
    shares = np.histogram(lengths, bins=edges)[0] / len(lengths)
    np.testing.assert_allclose(shares, bin_probabilities(name), atol=0.03)
    again = SyntheticSource(name, vocab_size=100, seed=1)
    assert again.tokens(17).tolist() == source.tokens(17).tolist()
    assert SyntheticSource(name, 100, seed=2).length(17) != source.length(17) or SyntheticSource(
        name, 100, seed=2
    ).length(18) != source.length(18)
    assert source.tokens(5).max() < 100


def test_synthetic_scale_and_errors() -> None:
    full = SyntheticSource("arxiv", 64, seed=0)
    small = SyntheticSource("arxiv", 64, seed=0, length_scale=1 / 64)
    assert small.length(3) == max(1, round(full.length(3) / 64))
    with pytest.raises(ConfigError, match="synthetic:arxiv"):
        open_source("synthetic:wiki", 64, seed=0)
