"""TensorBoard scalar events, written without TensorFlow or the tensorboard package.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, data, masked
CRC-32C of the data), each holding one serialized ``Event`` protocol buffer. A scalar event
needs four fields of it, so they are encoded here by hand: ``wall_time`` (1, double), ``step``
(2, int64), ``file_version`` (3, string; the first record) and ``summary`` (5) with its
``value``s (1), each a ``tag`` (1, string) and a ``simple_value`` (2, float). One event per
training step carries all of that step's scalars. tests/unit checks the files with
tensorboard's own reader.

Each rank writes ``DIR/events/rank<R>/events.out.tfevents.<time>.<host>``: TensorBoard shows
the ranks as separate runs (``tensorboard --logdir DIR/events``).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf encodes it
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def encode_event(
    wall_time: float,
    step: int,
    scalars: dict[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    event = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        event += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", v))
            for tag, v in scalars.items()
        )
        event += _bytes_field(5, values)
    return event


def encode_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


FLUSH_EVERY_S = 2.0


class EventWriter:
    """Appends scalar events to one TensorBoard event file."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = directory / name
        self._file: BinaryIO = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        self._file.write(encode_record(encode_event(time.time(), 0, file_version="brain.Event:2")))
        self._flushed = time.monotonic()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        event = encode_event(wall_time or time.time(), step, values)
        self._file.write(encode_record(event))
        if time.monotonic() - self._flushed > FLUSH_EVERY_S:  # a live TensorBoard sees it
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()
