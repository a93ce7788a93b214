"""Bytes per compressible stream: handed to the collectives (raw) and sent (wire).

One `StreamTally` per rank is shared by every switch of the rank. Each transfer
is counted once for the whole job: point-to-point sends by their sender, and a
group collective, whose compressed sizes every rank of the group learns, by the
group's first rank. Summing the ranks' tallies therefore gives the job's bytes,
which is what the trainer does each step (`vector`, then `per_stream`).
"""

from __future__ import annotations

from ray_zep.options import COMPRESSION_STREAMS


class StreamTally:
    """Raw and wire bytes per stream since the last `vector` call."""

    def __init__(self) -> None:
        self._bytes = {name: [0, 0] for name in COMPRESSION_STREAMS}

    def add(self, stream: str, raw_bytes: int, wire_bytes: int) -> None:
        counts = self._bytes[stream]
        counts[0] += raw_bytes
        counts[1] += wire_bytes

    def peek(self, stream: str) -> tuple[int, int]:
        raw, wire = self._bytes[stream]
        return raw, wire

    def vector(self) -> list[float]:
        """(raw, wire) of every stream in `COMPRESSION_STREAMS` order, flat; resets."""
        out = [float(v) for name in COMPRESSION_STREAMS for v in self._bytes[name]]
        for counts in self._bytes.values():
            counts[0] = counts[1] = 0
        return out


def per_stream(vector: list[float]) -> dict[str, dict[str, int]]:
    """A (summed) `StreamTally.vector` as `{stream: {"raw_bytes", "wire_bytes"}}`,
    streams that moved nothing left out."""
    out = {}
    for i, name in enumerate(COMPRESSION_STREAMS):
        raw, wire = int(vector[2 * i]), int(vector[2 * i + 1])
        if raw:
            out[name] = {"raw_bytes": raw, "wire_bytes": wire}
    return out
