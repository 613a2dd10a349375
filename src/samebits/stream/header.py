"""The stream header as a typed value: the JSON of a HEADER frame (docs/stream.md, "The
header"), checked once when read and written key for key.  Readers use its fields, not keys.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import NamedTuple

from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.verdicts import ToDict, serialised

assert fmt.DIGEST_VERSION_KEY == "digest_version"  # the field's name is the key's
_MINIMUM = {"rank": 0, "world_size": 1, "digest_version": 1, "segment": 0}  # beyond the fields' types
_JSON_TYPES = {"int": int, "str": str, "list": list, "dict": dict}  # the fields' annotations


@dataclass(frozen=True, kw_only=True)
class StreamHeader(ToDict):
    """What a stream says about itself: who wrote it, how, and what it records.  Written by its
    field marks (`ToDict`); read back, each value must have its annotation's JSON type."""

    schema: int
    rank: int
    world_size: int
    digest_version: int = 1  # of the digests (docs/digest.md); absent before the field: 1
    run_id: str | None = None
    run_id_source: str | None = None  # how the ranks agreed on the run id (docs/stream.md)
    segment: int = 0  # 0 for the first header, n for the n-th resumed process appending
    coords: dict = field(default_factory=dict)  # dp/tp/pp/ep/cp as the program gave them
    config: dict = field(default_factory=dict)
    window: list | None = None  # [first step, stop step] (null: open)
    phases: list | None = None  # recorded phases (null: all)
    ranks: list | None = None  # recorded ranks (null: all)
    max_tensor_bytes: int | None = None  # the size cap (null: none)
    # The name filters: written only by a writer that filtered names.
    include: list | None = field(default=None, metadata=serialised(omit_none=True))
    exclude: list | None = field(default=None, metadata=serialised(omit_none=True))
    created: str | None = None  # UTC, ISO 8601
    samebits: str | None = None  # the version that wrote it
    environment: dict = field(default_factory=dict)  # the environment fingerprint
    determinism: dict | None = None  # what `deterministic_mode` set and found, if active
    # Keys this samebits does not know (a newer writer's): kept, so that nothing read is lost.
    extra: dict = field(default_factory=dict, metadata=serialised(flatten=True))

    @property
    def caps_tensors(self) -> bool:
        """Whether the header declares a size cap: only then may a step hold capped records."""
        return self.max_tensor_bytes is not None

    @classmethod
    def from_payload(cls, payload: bytes, where: str) -> "StreamHeader":
        """The header of a HEADER frame's payload; ``where`` ("FILE: header at byte N") starts
        every error.  Raises `StreamError` naming each field that is missing or of a wrong type."""
        if not bytes(payload[: len(fmt.MAGIC)]) == fmt.MAGIC:
            raise StreamError(f"{where} lacks the samebits magic.")
        try:
            value = json.loads(payload[len(fmt.MAGIC):])
        except (ValueError, RecursionError) as err:
            raise StreamError(f"{where} is not valid JSON ({err}).") from None
        return cls.read(value, where)

    @classmethod
    def read(cls, value, where: str) -> "StreamHeader":
        """Check and type a header's JSON object (see `from_payload`)."""
        if not isinstance(value, dict):
            raise StreamError(f"{where} is not a JSON object: the file is corrupt.")
        if value.get("schema") not in fmt.READABLE_SCHEMAS:
            raise StreamError(
                f"{where}: stream schema version {value.get('schema')!r}, this samebits reads versions "
                f"{', '.join(map(str, fmt.READABLE_SCHEMAS))}. Read it with the samebits version that "
                f"wrote it ({value.get('samebits', 'unknown')!s:.40}).")
        problems = [problem for check in _CHECKS if (problem := _problem(check, value))]
        if not problems and value["rank"] >= value["world_size"]:
            problems.append(f"rank {value['rank']} outside world size {value['world_size']}")
        if problems:
            raise StreamError(f"{where} is invalid ({'; '.join(problems)}): the file is corrupt or was not "
                              "written by samebits.Recorder.")
        return cls(**{key: item for key, item in value.items() if key in _NAMES},
                   extra={key: item for key, item in value.items() if key not in _NAMES})

    def payload(self) -> bytes:
        """The HEADER frame's payload (docs/stream.md): the magic, then the JSON, keys sorted."""
        return fmt.MAGIC + json.dumps(self.to_dict(), sort_keys=True).encode()


class _Check(NamedTuple):
    """What a field's JSON value must be, from its annotation and default."""

    name: str
    required: bool  # no default
    types: tuple  # the JSON types it may hold (exactly: a bool is no int)
    null: bool  # it may be null
    shown: str  # the annotation, for the error
    minimum: int | None


def _check_of(item: dataclasses.Field) -> _Check:
    allowed = item.type.split(" | ")
    return _Check(item.name, item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING,
                  tuple(_JSON_TYPES[name] for name in allowed if name != "None"), "None" in allowed,
                  " or ".join(allowed), _MINIMUM.get(item.name))


_CHECKS = tuple(_check_of(item) for item in dataclasses.fields(StreamHeader) if item.name != "extra")
_NAMES = frozenset(check.name for check in _CHECKS)


def _problem(check: _Check, header: dict) -> str | None:
    """What is wrong with the header's value of the field ``check`` names, or None."""
    if check.name not in header:
        return f"{check.name} is missing" if check.required else None
    value = header[check.name]
    if value is None:
        return None if check.null else f"{check.name} is null"
    if type(value) not in check.types:
        return f"{check.name} = {value!r:.40} is not {check.shown}"
    if check.minimum is not None and value < check.minimum:
        return f"{check.name} = {value} is below {check.minimum}"
    return None


__all__ = ["StreamHeader"]
