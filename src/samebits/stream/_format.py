"""The on-disk layout of a fingerprint stream (schema version 1).  See docs/stream.md.

A stream is a sequence of *frames*.  Every frame is::

    u8 kind | varint payload_length | payload | u32 crc32(kind, length, payload), little endian

Frame kinds:

* ``HEADER``  JSON: schema, run id, rank, world size, coordinates, config, environment.
  The first frame of a stream.  A later HEADER frame starts a new *segment* (a resumed
  process appending to the same stream).
* ``NAMES``   new interned strings (tensor/metric names and phases): varint first id,
  varint count, then count x (varint byte length, utf-8 bytes).  Ids are dense, per stream.
* ``STEP``    one step's records: varint step, varint record count, u64 root, then the
  records.  The fixed prefix lets a reader compare roots and seek past the records.
* ``INDEX``   written at a clean close: every step's (step, record count, root, frame
  offset), so a comparer can check two whole streams by reading their footers alone.
* ``CLOSE``   the last frame of a cleanly closed stream, of fixed size (``CLOSE_FRAME_SIZE``):
  u64 offset of the INDEX frame, then ``CLOSE_MAGIC``.  Found by reading the file's tail.

Records inside a STEP frame are ``u8 kind | varint length | body``:

* tensor: varint phase id, varint name id, varint occurrence, u8 dtype code, u8 flags,
  u8 ndim, ndim x varint size, then u64 digest unless flagged ABSENT or CAPPED.
* metric: varint phase id, varint name id, varint occurrence, u8 dtype code, raw value
  bytes (the exact bits of the scalar, little endian; 8 bytes for Python floats).

The step root is a BLAKE2b-64 over the canonical form of the step's records in order
(strings, not ids), so it is equal across streams whose intern tables differ.
"""

from __future__ import annotations

import struct
import zlib

SCHEMA_VERSION = 1
MAGIC = b"SAMEBITS"  # the first bytes of the HEADER payload, before the JSON
STREAM_SUFFIX = ".sbs"

FRAME_HEADER, FRAME_NAMES, FRAME_STEP, FRAME_CLOSE, FRAME_INDEX = 1, 2, 3, 4, 5
FRAME_KINDS = {FRAME_HEADER: "header", FRAME_NAMES: "names", FRAME_STEP: "step", FRAME_CLOSE: "close",
               FRAME_INDEX: "index"}
CLOSE_MAGIC = b"SBCLOSE\0"
CLOSE_FRAME_SIZE = 1 + 1 + 16 + 4  # kind, length (16), u64 index offset + magic, crc

RECORD_TENSOR, RECORD_METRIC = 1, 2

FLAG_ABSENT = 1  # the tensor was None (e.g. a parameter without a gradient)
FLAG_CAPPED = 2  # larger than the size cap: shape and dtype recorded, no digest

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def stream_filename(rank: int) -> str:
    return f"rank-{rank:05d}{STREAM_SUFFIX}"


def encode_varint(value: int, out: bytearray) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def decode_varint(buf, pos: int) -> tuple[int, int]:
    """Return (value, next position); raise IndexError past the end, ValueError if too long."""
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def frame(kind: int, payload: bytes | bytearray) -> bytes:
    head = bytearray((kind,))
    encode_varint(len(payload), head)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return bytes(head) + bytes(payload) + _U32.pack(crc)


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(buf, pos: int) -> int:
    return _U64.unpack_from(buf, pos)[0]


def unpack_u32(buf, pos: int) -> int:
    return _U32.unpack_from(buf, pos)[0]
