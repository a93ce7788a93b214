"""Bytes per compressible stream: handed to the collectives (raw) and sent (wire),
and the calls that went zipped or plain (the switcher's choices).

One `StreamTally` per rank is shared by every switch of the rank. Each transfer
is counted once for the whole job: point-to-point sends by their sender, and a
group collective, whose compressed sizes every rank of the group learns, by the
group's first rank. Summing the ranks' tallies therefore gives the job's bytes,
which is what the trainer does each step (`vector`, then `per_stream`).
"""

from __future__ import annotations

from ray_zep.options import COMPRESSION_STREAMS

FIELDS = ("raw_bytes", "wire_bytes", "zipped_calls", "plain_calls")
"""What is counted per stream, in `vector` order."""


class StreamTally:
    """Bytes and calls per stream since the last `vector` call."""

    def __init__(self) -> None:
        self._counts = {name: [0] * len(FIELDS) for name in COMPRESSION_STREAMS}

    def add(self, stream: str, raw_bytes: int, wire_bytes: int, zipped: bool) -> None:
        """One call of `stream`: its bytes, and whether it went zipped."""
        counts = self._counts[stream]
        counts[0] += raw_bytes
        counts[1] += wire_bytes
        counts[2 if zipped else 3] += 1

    def peek(self, stream: str) -> tuple[int, int]:
        """(raw, wire) bytes of `stream` so far."""
        raw, wire, *_ = self._counts[stream]
        return raw, wire

    def vector(self) -> list[float]:
        """`FIELDS` of every stream in `COMPRESSION_STREAMS` order, flat; resets."""
        out = [float(v) for name in COMPRESSION_STREAMS for v in self._counts[name]]
        for counts in self._counts.values():
            counts[:] = [0] * len(FIELDS)
        return out


def per_stream(vector: list[float]) -> dict[str, dict[str, int]]:
    """A (summed) `StreamTally.vector` as `{stream: {"raw_bytes", "wire_bytes",
    "zipped_calls", "plain_calls"}}`, streams that moved nothing left out."""
    out = {}
    width = len(FIELDS)
    for i, name in enumerate(COMPRESSION_STREAMS):
        values = [int(v) for v in vector[width * i : width * (i + 1)]]
        if values[0]:
            out[name] = dict(zip(FIELDS, values, strict=True))
    return out
