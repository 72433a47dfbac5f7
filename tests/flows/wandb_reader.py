"""Read the history rows of an offline W&B run file (`run-<id>.wandb`) for assertions.

The file is a leveldb-style log: a 7-byte header (":W&B", magic, version), then records
split into chunks of 32 KiB blocks, each chunk with a 7-byte header (crc32, length, type),
each record a serialized `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes):
    offset, pending = HEADER_SIZE, b""
    while offset + HEADER_SIZE <= len(data):
        room = BLOCK_SIZE - offset % BLOCK_SIZE
        if room < HEADER_SIZE:  # block trailer padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER_SIZE])
        chunk = data[offset + HEADER_SIZE : offset + HEADER_SIZE + length]
        offset += HEADER_SIZE + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:  # zero padding at the end of a block
            offset += BLOCK_SIZE - offset % BLOCK_SIZE


def read_history(run_file: Path) -> list[dict]:
    """Every `run.log` row of the run: [{key: value}, ...] in order."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
