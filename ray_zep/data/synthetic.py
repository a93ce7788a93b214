"""Synthetic documents whose lengths follow the Zeppelin paper's Table 2.

Table 2 gives, per dataset, the share of sequences in each length bin (bins in
thousands of tokens; 1k = 1024 here). A document's bin is drawn with those
shares and its length uniformly inside the bin; token ids are uniform in the
vocabulary. Everything about document i is a pure function of (seed, i), so the
source is endless, needs no storage and replays exactly after a resume.

The GitHub row of the table sums to 0.945 as printed; its shares are
normalised to sum to 1 (ArXiv and ProLong64k sum to 1 already).

`chat` is not from the paper: an assumed mix in the same bins, shaped like chat
and instruction data with a long tail (mostly turns under 2k tokens, one document
in a thousand past 128k), for judging placements where rare very long sequences
sit among many short ones.
"""

from __future__ import annotations

import numpy as np

from ray_zep.errors import ConfigError

BIN_EDGES_K = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Bin edges in thousands of tokens: <1, 1-2, 2-4, ..., 128-256."""

TABLE_2: dict[str, tuple[float, ...]] = {
    "arxiv": (0.032, 0.03, 0.08, 0.219, 0.338, 0.224, 0.077, 0.0, 0.0),
    "github": (0.0, 0.34, 0.095, 0.104, 0.107, 0.102, 0.088, 0.064, 0.045),
    "prolong64k": (0.231, 0.042, 0.021, 0.012, 0.013, 0.008, 0.673, 0.0, 0.0),
}

MIXES: dict[str, tuple[float, ...]] = {
    "chat": (0.62, 0.2, 0.1, 0.04, 0.02, 0.01, 0.006, 0.003, 0.001),
}
"""Assumed length mixes beside Table 2's (module docstring), in its bins."""
DISTRIBUTIONS: dict[str, tuple[float, ...]] = TABLE_2 | MIXES
"""Every length distribution a synthetic source or `--distribution` can name."""

TOKENS_PER_K = 1024


def bin_probabilities(name: str) -> np.ndarray:
    """Normalised bin shares of a named distribution (`DISTRIBUTIONS`)."""
    if name not in DISTRIBUTIONS:
        raise ConfigError(
            f"config key data.source='synthetic:{name}': choose synthetic:"
            + " | synthetic:".join(DISTRIBUTIONS)
        )
    shares = np.asarray(DISTRIBUTIONS[name], dtype=np.float64)
    return shares / shares.sum()


class SyntheticSource:
    """Endless documents with Table 2 lengths (times `length_scale`)."""

    num_docs = None

    def __init__(
        self, distribution: str, vocab_size: int, seed: int, length_scale: float = 1.0
    ) -> None:
        self.name = f"synthetic:{distribution}"
        self._probs = bin_probabilities(distribution)
        self._cumulative = np.cumsum(self._probs)
        self._vocab_size = vocab_size
        self._seed = seed
        self._scale = length_scale

    def _rng(self, doc: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self._seed, doc, stream])

    def length(self, doc: int) -> int:
        rng = self._rng(doc, 0)
        bin_index = int(np.searchsorted(self._cumulative, rng.random(), side="right"))
        bin_index = min(bin_index, len(self._probs) - 1)
        low = max(1, BIN_EDGES_K[bin_index] * TOKENS_PER_K)
        high = BIN_EDGES_K[bin_index + 1] * TOKENS_PER_K
        raw = int(rng.integers(low, high))
        return max(1, round(raw * self._scale))

    def tokens(self, doc: int) -> np.ndarray:
        return self._rng(doc, 1).integers(
            0, self._vocab_size, size=self.length(doc), dtype=np.int32
        )

    def max_length(self) -> int | None:
        return None


def batch_lengths(distribution: str, total_tokens: int, seed: int) -> np.ndarray:
    """Sequence lengths of one global batch of exactly `total_tokens` tokens.

    Lengths are drawn from the Table 2 distribution until the batch is full; the
    last sequence is cut to the space left, as budget packing cuts a document.
    """
    source = SyntheticSource(distribution, vocab_size=2, seed=seed)
    return _filled(source.length, total_tokens)


def drawn_batch_lengths(documents: np.ndarray, total_tokens: int, seed: int) -> np.ndarray:
    """`batch_lengths` drawing from the lengths of real `documents` (with replacement,
    seeded) instead of a named distribution."""
    documents = np.asarray(documents, dtype=np.int64)
    documents = documents[documents > 0]
    if documents.size == 0:
        raise ConfigError("drawn_batch_lengths: no document with tokens to draw from")
    rng = np.random.default_rng(seed)
    return _filled(lambda doc: int(documents[rng.integers(documents.size)]), total_tokens)


def _filled(length_of, total_tokens: int) -> np.ndarray:
    """Lengths `length_of(0)`, `length_of(1)`, ... until they hold `total_tokens`, the last
    one cut to the space left."""
    lengths, used, doc = [], 0, 0
    while used < total_tokens:
        n = min(length_of(doc), total_tokens - used)
        lengths.append(n)
        used += n
        doc += 1
    return np.asarray(lengths, dtype=np.int64)
