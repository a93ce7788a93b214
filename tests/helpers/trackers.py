"""Read back what the trackers wrote, with each tool's own reader where it has one.

TensorBoard: its event accumulator. W&B: an offline run keeps its records in one
`run-<id>.wandb` file, a LevelDB-style log (a 7-byte header, then 32 KiB blocks of
records, each a 7-byte header of CRC32C, little-endian length and type, the FULL /
FIRST / MIDDLE / LAST pieces of one protobuf `Record`); the history records hold the
logged values as JSON.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """Every history row of the offline W&B runs under `run_dir/wandb`, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for payload in _records(path.read_bytes()):
            record = pb.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append({_key(item): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
    return rows


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _records(data: bytes):
    assert data[:4] == b":W&B", "not a W&B run file"
    offset, pieces = HEADER, []
    while offset + HEADER <= len(data):
        left = BLOCK - offset % BLOCK
        if left < HEADER:  # the block's tail is padding
            offset += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        body = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pieces = [body]
        elif kind == MIDDLE:
            pieces.append(body)
        elif kind == LAST:
            yield b"".join([*pieces, body])
