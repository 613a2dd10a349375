"""The on-disk layout of a fingerprint stream (schema version 2; version 1 is still read):
frames ``u8 kind | varint length | payload | u32 crc32``, the records inside a STEP frame and
the step root.  The layout itself is docs/stream.md, "Byte layout (schema 2)".
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from samebits.errors import StreamError


class MalformedBytes(StreamError, ValueError):
    """Bytes that do not decode (a varint too long, stray bytes): the reader adds file, offset
    and frame before a user sees it."""


SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # a reader accepts these; the writer writes SCHEMA_VERSION
MAGIC = b"SAMEBITS"  # the first bytes of the HEADER payload, before the JSON
# The header key holding the version of the digest the stream's digests were computed with
# (fingerprint.DIGEST_VERSION, docs/digest.md).  Streams written before it existed lack it:
# their digests are version 1.
DIGEST_VERSION_KEY = "digest_version"
STREAM_SUFFIX = ".sbs"

FRAME_HEADER, FRAME_NAMES, FRAME_STEP, FRAME_CLOSE, FRAME_INDEX = 1, 2, 3, 4, 5
FRAME_KINDS = {FRAME_HEADER: "header", FRAME_NAMES: "names", FRAME_STEP: "step", FRAME_CLOSE: "close",
               FRAME_INDEX: "index"}
CLOSE_MAGIC = b"SBCLOSE\0"
CLOSE_FRAME_SIZE = 1 + 1 + 16 + 4  # kind, length (16), u64 index offset + magic, crc

RECORD_TENSOR, RECORD_METRIC = 1, 2

FLAG_ABSENT = 1  # the tensor was None (e.g. a parameter without a gradient)
FLAG_CAPPED = 2  # larger than the size cap: shape and dtype recorded, no digest

MAX_STEP = 2**63 - 1  # steps are 0 <= step <= MAX_STEP (int64 everywhere they are used)

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def stream_filename(rank: int) -> str:
    return f"rank-{rank:05d}{STREAM_SUFFIX}"


def encode_varint(value: int, out: bytearray) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def decode_varint(buf, pos: int, end: int | None = None) -> tuple[int, int]:
    """Return (value, next position); raise IndexError past ``end`` (default: the buffer's
    end), ValueError if longer than 10 bytes or above 2**64 - 1."""
    limit = len(buf) if end is None else end
    result = shift = 0
    while True:
        if pos >= limit:
            raise IndexError("varint runs past the end")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise MalformedBytes("varint above 2**64 - 1")
            return result, pos
        shift += 7
        if shift > 63:
            raise MalformedBytes("varint longer than 10 bytes")


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


def name_bytes(text: str) -> bytes:
    """A name as it is interned and hashed into the names key: varint length, utf-8."""
    data = text.encode()
    head = bytearray()
    encode_varint(len(data), head)
    return bytes(head) + data


def new_names_hasher():
    """The running hash behind the names key; `update` it with `name_bytes` of each new name."""
    return hashlib.sha256()


def step_root(names_key: bytes, records) -> int:
    """The schema-2 step root: 8 bytes of SHA-256(names key || records as stored)."""
    hasher = hashlib.sha256(names_key)
    hasher.update(records)
    return int.from_bytes(hasher.digest()[:8], "little")


def step_root_v1(canonical) -> int:
    """The schema-1 step root over the canonical records (strings joined by NUL)."""
    return int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "little")
