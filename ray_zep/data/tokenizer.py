"""Tokenizers for `ray-zep data build`.

The default is byte-level: a document's UTF-8 bytes are its token ids (0..255),
so any text works with no vocabulary file and the `tiny` model (V = 256). A
Hugging Face `tokenizer.json` is used through the optional `tokenizers` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from ray_zep.errors import ConfigError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """int32 token ids of `text`."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    @staticmethod
    def encode_bytes(data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


class JsonTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(
                "--tokenizer needs the 'tokenizers' package: pip install 'ray-zep[tokenizers]'"
            ) from None
        if not Path(path).is_file():
            raise ConfigError(f"tokenizer file {str(path)!r} does not exist")
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ConfigError(f"tokenizer file {str(path)!r} cannot be loaded: {exc}") from None
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(
            self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32
        )


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the tokenizer.json at `path`."""
    return ByteTokenizer() if path is None else JsonTokenizer(path)
