"""The files a command wrote, read back for the page: ``summary.json`` and ``certificate.json``.

Every input is read as untrusted: a regular file only, bounded in size and depth, and each
field the page reads checked for its type, so a damaged or edited file is one error naming the
file and the field, never a traceback or a page that misreads it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from samebits.errors import ConfigError
from samebits.runners._launch import STOPPED
from samebits.runners.across import AcrossResult
from samebits.runners.bisect import BisectResult
from samebits.runners.matrix import MatrixResult
from samebits.runners.verify import VerifyResult
from samebits.verdicts import ToDict, Verdict, json_type


MAX_JSON_BYTES = 64 << 20  # a summary or certificate larger than this is refused (they are kilobytes)
MAX_JSON_DEPTH = 64  # nesting deeper than this is refused (the files nest a few levels)
# The result type of each command whose summary reads back by the marks that write it
# (`ToDict.from_dict`): its names and types are the writer's, never restated here.
RESULTS: dict[str, type[ToDict]] = {result.summary_of: result for result in (BisectResult, VerifyResult,
                                                                             AcrossResult, MatrixResult)}


@dataclass(frozen=True)
class Summary:
    """A ``summary.json`` as read: the command that wrote it (the ``command`` every summary
    names, `samebits.verdicts.ToDict.summary_of`), its typed result
    where that command's result type reads back (`RESULTS`; None otherwise), and its dictionary."""

    command: str | None
    data: dict
    result: ToDict | None = None


def _summary(path: Path) -> Summary | None:
    """The ``summary.json`` in ``path`` read into its command's result (`RESULTS`; an older file
    checked field by field), None when there is none; `ConfigError` naming the file and the field
    when it is not a regular file, not JSON, or a field is unknown, missing or mistyped."""
    file = path / "summary.json"
    data = _json_file(file, "the summary.json a samebits command wrote")
    if data is None:
        return None
    command = "stopped" if data.get("verdict") == STOPPED else data.get("command")  # (`write_stopped`)
    if command in RESULTS:
        result = RESULTS[command].from_dict(data, source=file)
        if command == "bisect" and data.get("origin") and data["origin"].get("elements"):
            _check_fields(data["origin"]["elements"], _ELEMENTS_DETAIL, file, "origin.elements")
        return Summary(command, data, result)
    return Summary(command, data)  # (a command without a page is refused by `build_report`)


def _json_file(file: Path, expected: str) -> dict | None:
    """The JSON object in ``file`` (None when there is none), read as every input is: a regular
    file only (a FIFO must not block), at most `MAX_JSON_BYTES`, JSON nested at most
    `MAX_JSON_DEPTH` deep; `ConfigError` naming the file otherwise."""
    try:
        # O_NONBLOCK: a FIFO in place of the file must not block the open
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"{file}: cannot be read ({err.strerror or err}).") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "something else"
        raise ConfigError(f"{file}: {kind}, not a regular file; expected {expected}.")
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read(MAX_JSON_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"{file}: cannot be read ({err.strerror or err}).") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_JSON_BYTES >> 20} MiB; expected {expected} (a few kilobytes).")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ConfigError(f"{file}: cannot be read as JSON ({reason}); was the command interrupted while writing "
                          "it? Re-run the command, or report two of its run directories instead.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: not {expected} (a JSON object was expected, found {json_type(data)}).")
    if _depth(data) > MAX_JSON_DEPTH:
        raise ConfigError(f"{file}: nested more than {MAX_JSON_DEPTH} levels deep; expected {expected}.")
    return data


def _depth(value: Any) -> int:
    """How deep ``value`` nests (1 for a leaf), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, depth + 1) for child in children)
    return deepest


# What the page reads of each summary, by type: a dict spec lists the fields it may read (each
# optional: absent or null is an empty value), `_Each` a mapping's values (``null``: a value may
# be null), `[spec]` a list's items, `_Required` a field that must be present, and a type a leaf;
# anything not listed is shown as text, whatever it holds.
class _Each:
    def __init__(self, spec, null: bool = False):
        self.spec, self.null = spec, null


class _Required:
    def __init__(self, spec):
        self.spec = spec


_CHECK = {"verdict": str, "first_divergence": dict, "compared": dict, "notes": list, "incomplete": list, "by": str,
          "counts": _Each(int)}
_CONTROL = {"verdict": str, "differs": bool, "first_step": int, "layout": str, "run": str}
# The entries of a bisect origin's elements that no field types (`Elements.detail`, compare_elements'
# dict, written flattened), as the page reads them
_ELEMENTS_DETAIL = {"values": [dict], "first_indices": list}


# certificate.json (`samebits.runners.across.certificate`), as the page reads it
_CERT_CHECK = {"verdict": _Required(str), "by": str, "steps": int, "counts": _Each(int), "notes": [str],
               "incomplete": [str], "command": str, "first_divergence": dict}
_CERTIFICATE = {
    "verdict": _Required(str), "kind": str, "environment": dict, "reference": str,
    "layouts": [{"cell": str, "world_size": int, "overrides": [str], "command": str}],
    "steps": [int], "roots": _Each(_Each(str, null=True)), "roots_equal": bool,
    "checkpoints": _Each({"step": int, "path": str, "content_sha256": str, "state_sha256": str, "content_error": str,
                          "files": int, "files_sha256": str, "sha256": str, "state_parts": dict}),
    "checkpoints_equal": bool, "checkpoints_note": str,
    "resume_across": {"step": int, "from": str, "checks": _Each(_CERT_CHECK)},
    "invariant_reductions": [{"switch": str, "size": str, "covers": str}],
    "controls": [{**_CONTROL, "detail": str, "overrides": [str], "command": str}], "controls_note": str,
    "checks": _Each(_CERT_CHECK),
}


def _check_fields(value: Any, spec: Any, file: Path, where: str) -> None:
    if isinstance(spec, _Required):
        spec = spec.spec
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise _wrong_type(file, where, "an object", value)
        for key, inner in spec.items():
            at = f"{where}.{key}" if where else key
            if key not in value:
                if isinstance(inner, _Required):
                    raise ConfigError(f"{file}: field {at!r} is missing; is the file from this samebits version?")
                continue
            if value[key] is not None:
                _check_fields(value[key], inner, file, at)
        return
    if isinstance(spec, _Each):
        if not isinstance(value, dict):
            raise _wrong_type(file, where, "an object", value)
        for key, item in value.items():
            if item is not None or not spec.null:
                _check_fields(item, spec.spec, file, f"{where}.{key}")
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise _wrong_type(file, where, "a list", value)
        for index, item in enumerate(value):
            _check_fields(item, spec[0], file, f"{where}[{index}]")
        return
    if not isinstance(value, spec) or (spec is int and isinstance(value, bool)):
        raise _wrong_type(file, where, {str: "a string", int: "an integer", list: "a list", dict: "an object",
                                        bool: "true or false"}[spec], value)


def _wrong_type(file: Path, where: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{file}: field {where!r} must be {expected}, found {json_type(value)}; is the file from this "
                       "samebits version, and whole?")


def _verdict(value: Any, where: Path, what: str = "field 'verdict'") -> Verdict:
    if value is None:
        raise ConfigError(f"{where}: {what} is missing; is the file from this samebits version?")
    try:
        return Verdict(value)
    except ValueError:
        raise ConfigError(f"{where}: verdict {value!r} is not one of "
                          f"{', '.join(v.value for v in Verdict)}; is the file from this samebits version?") from None


def _certificate(path: Path) -> dict | None:
    """``path``/certificate.json checked field by field (`_CERTIFICATE`), or None when there is
    none; `ConfigError` naming the file and the field otherwise (as for summary.json)."""
    file = path / "certificate.json"
    data = _json_file(file, "the certificate `samebits verify --across` writes")
    if data is not None:
        _check_fields(data, _CERTIFICATE, file, "")
    return data
