"""Validation loss of a model over a token source, in one process (`ray-zep eval`).

The source is read once, in its own order (no shuffling, no epochs): documents
are packed whole into batches of at most the global batch's token budget
(nodes x GPUs x `train.tokens_per_rank`, what the one-process reference holds);
a longer document is a batch of its own, never cut, so every document's loss is
that of the document itself. Each batch runs through the model's varlen forward
with its document boundaries, and every token but a document's last is scored
against the next token (cross-entropy in float32, chunk by chunk of tokens under
`model.loss_chunk_tokens`).

Result: `loss`, the mean over all label tokens; `label_tokens`; `documents`,
one entry per document read (`doc` id, `tokens`, and `loss`, the mean over its
`tokens - 1` predicted tokens, null for a one-token document); `batches`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_zep.attention.kernels import select_kernel
from ray_zep.attention.varlen import PackedSeqs, positions_from_lengths
from ray_zep.constants import IGNORE_INDEX
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.source import TokenSource
from ray_zep.errors import ConfigError
from ray_zep.model.llama import Transformer
from ray_zep.topology import build_topology
from ray_zep.train.build import resolve_device, resolve_dtype
from ray_zep.train.restore import ModelSource, whole_model


@dataclass
class EvalResult:
    """Token-weighted loss of an evaluation and every document's own."""

    loss: float
    label_tokens: int
    documents: list[dict[str, Any]] = field(default_factory=list)
    batches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return out


def document_batches(
    source: TokenSource, budget: int, max_batches: int | None = None
) -> Iterator[list[int]]:
    """Document ids of each batch: whole documents in source order, at most `budget`
    tokens a batch unless one document alone is longer; empty documents skipped.

    Raises:
        ConfigError: a source without end (synthetic) and no `max_batches`.
    """
    if source.num_docs is None and max_batches is None:
        raise ConfigError(
            f"data.source={source.name!r} has no end: give --batches N to evaluate its first N"
        )
    batch: list[int] = []
    tokens, made, doc = 0, 0, 0
    while (source.num_docs is None or doc < source.num_docs) and made != max_batches:
        length = source.length(doc)
        if batch and tokens + length > budget:
            yield batch
            made += 1
            batch, tokens = [], 0
            if made == max_batches:
                return
        if length:
            batch.append(doc)
            tokens += length
        doc += 1
    if batch and made != max_batches:
        yield batch


@torch.no_grad()
def evaluate_model(
    model: Transformer,
    source: TokenSource,
    batches: Iterator[list[int]],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> EvalResult:
    """Loss of `model` (in eval mode) on the documents of `batches`.

    Args:
        model: the whole model, on `device`.
        source: where the document ids point.
        batches: document ids per batch (`document_batches`).
        device: where to compute.
        dtype: compute dtype (bf16 runs under autocast; the loss is float32).
    """
    was_training = model.training
    model.eval()
    total, label_tokens, documents, count = 0.0, 0, [], 0
    for docs in batches:
        sums, labels = _batch_losses(model, source, docs, device, dtype)
        for doc, loss_sum, n in zip(docs, sums, labels, strict=True):
            length = n + 1
            documents.append({"doc": doc, "tokens": length, "loss": loss_sum / n if n else None})
        total += float(sum(sums))
        label_tokens += int(sum(labels))
        count += 1
    model.train(was_training)
    return EvalResult(total / max(1, label_tokens), label_tokens, documents, count)


def _batch_losses(
    model: Transformer,
    source: TokenSource,
    docs: list[int],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[list[float], list[int]]:
    """Sum of token losses and number of label tokens of each document of one batch."""
    pieces = [source.tokens(doc) for doc in docs]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    tokens_T = torch.from_numpy(np.concatenate(pieces).astype(np.int64)).to(device)
    positions_T = torch.from_numpy(positions_from_lengths(lengths).copy()).to(device)
    labels_T = torch.full_like(tokens_T, IGNORE_INDEX)
    labels_T[:-1] = tokens_T[1:]
    ends = torch.from_numpy(np.cumsum(lengths) - 1).to(device)
    labels_T[ends] = IGNORE_INDEX
    seqs = PackedSeqs.from_lengths(lengths, device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with autocast:
        losses_T = model(tokens_T, positions_T, seqs, labels_T=labels_T, reduction="none")
    doc_of_T = torch.from_numpy(np.repeat(np.arange(len(docs)), lengths)).to(device)
    sums = torch.zeros(len(docs), dtype=torch.float64, device=device)
    sums.index_add_(0, doc_of_T, losses_T.double())
    return sums.tolist(), (lengths - 1).tolist()


def run_eval(source: ModelSource, max_batches: int | None = None) -> EvalResult:
    """Evaluate the source's model on its config's `data.source` (`ray-zep eval`).

    Runs on `train.device` with `train.precision` and `model.attention_kernel`.

    Raises:
        ConfigError: `max_batches` < 1, or an endless source without it; the
            errors of `whole_model` and of opening the data.
    """
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"--batches={max_batches}: must be >= 1")
    config = source.config
    device = resolve_device(config.train.device)
    dtype = resolve_dtype(config.train.precision, device)
    model = whole_model(source).to(device)
    model.loss_chunk_tokens = config.model.loss_chunk_tokens
    model.attention_fn = select_kernel(config.model.attention_kernel, device, dtype)
    data = open_configured_source(config)
    budget = build_topology(config.topology).world_size * config.train.tokens_per_rank
    return evaluate_model(model, data, document_batches(data, budget, max_batches), device, dtype)
