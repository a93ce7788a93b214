"""Outlier delay chosen by the simulator: `ray-zep plan --auto` plays `data.outlier_tokens`.

A batch holding one document far longer than its peers has a floor no placement lifts:
the document's ranks import most of its K/V over their node's NICs however many nodes
it spans, and the rest of the cluster waits for them. Holding such documents back until
`data.outlier_group` of them wait (`ray_zep.data.batching`, after WLB-LLM's outlier
delay) pays that floor once for the group instead of once per document, and leaves the
batches between them easy to balance. Whether it pays depends on the data, the model
and the cluster: in the simulator it gains 2.0-5.1% on the chat mix at 256 GPUs, at most
1.2% on github, and costs 1.0% on 13B chat at 1,024 GPUs (`ray-zep bench outliers`,
BENCHMARKS.md). So `plan --auto` plays it.

Thresholds tried (`thresholds`): documents longer than `SPAN_NODES` nodes' token room (G x
L each), and the rarer ones, about one in `RARE_EVERY` batches, where the batches hold at
least `outlier_group` such documents. Where several outliers come in every batch the
delay only shifts them (and its queue, full at every batch, never empties: see
`delay_window`), so the rarer threshold is the one that can pay there.

The delay changes which documents a batch holds, so its steps are compared on a window
that trains about the same documents as the same composition without it (`delay_window`):
at least `MIN_WINDOW` batches, extended until no outlier is held (a prefix of the stream's
documents), the composition without the delay played on as many batches. Batches of a
budget are not all equally full (a whole document that does not fit waits for the next
one), so the two windows are compared in seconds per token. The delay's candidate ranks
at the step the composition took on the search's batches times that ratio
(`ray_zep.sim.auto.Candidate.delay`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ray_zep.config import Config, Packing
from ray_zep.errors import ConfigError

SPAN_NODES = 2
"""Documents longer than this many nodes' token room (G x L) may be outliers."""
RARE_EVERY = 2
"""The rarer threshold: the length of about one document in this many batches."""
MIN_WINDOW = 12
"""Batches the delay's window holds at least: a held outlier waits up to
`data.outlier_max_delay` batches, and a window of a few batches would compare the delay
on the batches it empties and not on the one that trains what it held."""
MAX_EXTENSION = 16
"""Batches a window may add until no outlier is held (each waits at most
`data.outlier_max_delay`, but others may be met in the meantime)."""


@dataclass(frozen=True)
class DelayEffect:
    """The delay's steps against the same composition's without it, on a window that
    trains the same documents.

    Attributes:
        threshold: `data.outlier_tokens`.
        batches: the window's batches.
        plain_tokens_per_second: the composition's tokens/s without the delay on the
            window.
        delayed_tokens_per_second: with it.
        held_at_end: outliers still held after the window (0 unless `MAX_EXTENSION` ran
            out: then the window leaves their tokens for later).
        outliers: sequences of the delayed window at least `threshold` long.
    """

    threshold: int
    batches: int
    plain_tokens_per_second: float
    delayed_tokens_per_second: float
    held_at_end: int = 0
    outliers: int = 0

    @property
    def ratio(self) -> float:
        """The delay's seconds per token over the plain's."""
        delayed = self.delayed_tokens_per_second
        return self.plain_tokens_per_second / delayed if delayed > 0 else float("inf")


def thresholds(config: Config, gpus_per_node: int, lengths: list[np.ndarray]) -> list[int]:
    """`data.outlier_tokens` values to try for `config` on batches of these sequence
    lengths, ascending: `SPAN_NODES` nodes' token room, and the length that about one
    sequence in every `RARE_EVERY` batches reaches where that is longer, each where at
    least `data.outlier_group` sequences are that long; none where the config sets a
    delay already or does not pack a budget (rank-packed bins: whole sequences, no
    node-spanning floor)."""
    data = config.data
    if data.outlier_tokens > 0 or data.packing is not Packing.BUDGET or not lengths:
        return []
    spanning = SPAN_NODES * gpus_per_node * config.train.tokens_per_rank
    every = np.sort(np.concatenate(lengths))[::-1]
    rare = int(every[min(every.size, max(1, len(lengths) // RARE_EVERY)) - 1])
    out = []
    for threshold in sorted({spanning, max(spanning, rare)}):
        if int((every >= threshold).sum()) >= data.outlier_group:
            out.append(threshold)
    return out


def delayed(config: Config, threshold: int) -> Config:
    """`config` with `data.outlier_tokens` = `threshold`."""
    return dataclasses.replace(
        config, data=dataclasses.replace(config.data, outlier_tokens=int(threshold))
    )


def delay_window(config: Config, ranks: int, count: int) -> tuple[list, int]:
    """((lengths, rank bins or None) of the delayed stream's first batches, outliers held
    after them): at least `count` batches, then more until none is held, at most
    `MAX_EXTENSION` more.

    Raises:
        ConfigError: `config` sets no delay.
        ZepError subclasses: data that cannot be read.
    """
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source

    if config.data.outlier_tokens <= 0:
        raise ConfigError("delay_window needs data.outlier_tokens > 0")
    stream = BatchStream.from_config(open_configured_source(config), config, ranks)
    drawn = [stream.next_batch() for _ in range(count)]
    while drawn[-1].cursor_after.held and len(drawn) < count + MAX_EXTENSION:
        drawn.append(stream.next_batch())
    return [(b.lengths, b.bins) for b in drawn], len(drawn[-1].cursor_after.held)
