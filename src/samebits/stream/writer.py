"""`Recorder`: writes one rank's fingerprint stream.

Tensors are digested *when they are recorded* (their values may change in place right
after), but on an accelerator the digests stay on the device until the step ends; then
one device-to-host copy per device fetches the whole step.  Nothing here synchronises
the host per tensor.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import struct
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from samebits import fingerprint
from samebits.fingerprint._spec import dtype_code
from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.stream.environment import environment_fingerprint
from samebits.stream.settings import RecorderSettings

_ABSENT_HEAD = bytes((0, fmt.FLAG_ABSENT, 0))  # dtype code 0 ("none"), flags, ndim 0
_FLOAT64_CODE, _INT64_CODE = dtype_code(torch.float64), dtype_code(torch.int64)
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")


@dataclass
class _DeviceQueue:
    """What one device holds for the step until its end: body sums, then metric bytes."""

    sums: list = field(default_factory=list)  # int64 tensors from fingerprint.body_sums
    num_sums: int = 0
    metrics: list = field(default_factory=list)  # uint8 tensors: each metric's raw bytes
    num_metric_bytes: int = 0


@dataclass
class _PendingStep:
    step: int
    # (kind, phase, name, occurrence, head bytes, digest header, where): `where` is
    # (device, sum index) for a digested tensor, (device, offset, size) for a device metric,
    # bytes for a host metric, None for an absent or capped tensor.
    records: list = field(default_factory=list)
    devices: dict = field(default_factory=dict)  # device -> _DeviceQueue
    occurrences: dict = field(default_factory=dict)


class Recorder:
    """Record per-step metrics and tensor digests of one rank into ``DIR/rank-NNNNN.sbs``.

    >>> rec = Recorder("runs/a", rank=0, world_size=1, config={"lr": 1e-3})
    >>> rec.metrics(0, loss=2.5)
    >>> rec.tensors(0, "params", model.named_parameters())
    >>> rec.close()

    Every argument left as ``None`` falls back to an environment variable (see
    `RecorderSettings`), then to a default: rank and world size come from
    ``torch.distributed`` or ``RANK``/``WORLD_SIZE``.  A recorder that is disabled, or
    whose rank or step is filtered out, does nothing and costs one attribute check.

    ``reference``: the directory of an earlier run; `end_step` then compares this step's
    root with the reference's and returns False on a mismatch (a live check).
    ``append``: continue an existing stream (a resumed process); otherwise an existing
    stream is an error, never overwritten.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        config: Mapping[str, Any] | None = None,
        coords: Mapping[str, int] | None = None,
        run_id: str | None = None,
        steps: str | range | None = None,
        ranks: str | Iterable[int] | None = None,
        max_tensor_bytes: int | None = None,
        flush_every: int | None = None,
        enabled: bool | None = None,
        phases: str | Iterable[str] | None = None,
        append: bool = False,
        reference: str | os.PathLike | None = None,
    ):
        self.settings = RecorderSettings.resolve(
            directory=directory,
            rank=rank,
            world_size=world_size,
            steps=steps,
            ranks=ranks,
            max_tensor_bytes=max_tensor_bytes,
            flush_every=flush_every,
            enabled=enabled,
            phases=phases,
        )
        s = self.settings
        self.rank, self.world_size = s.rank, s.world_size
        self.active = s.enabled and s.rank_selected
        self._file = None
        self._pending: _PendingStep | None = None
        self._last_step: int | None = None
        self._names: dict[str, int] = {}
        self._heads: dict[tuple, bytes] = {}
        self._index: list[tuple[int, int, int, int]] = []  # (step, records, root, frame offset)
        self._encoded: dict[tuple, tuple[bytes, bytes]] = {}
        self._new_names: list[str] = []
        self._buffer = bytearray()
        self._steps_since_flush = 0
        self._num_steps = self._num_records = 0
        self._reference = None
        self._closed = False
        if not self.active:
            return
        s.directory.mkdir(parents=True, exist_ok=True)
        self.path = s.directory / fmt.stream_filename(s.rank)
        header = {
            "schema": fmt.SCHEMA_VERSION,
            "run_id": run_id or os.environ.get("SAMEBITS_RUN_ID") or _launcher_run_id() or uuid.uuid4().hex,
            "rank": s.rank,
            "world_size": s.world_size,
            "coords": dict(coords or {}),
            "config": _jsonable(dict(config or {})),
            "window": [s.step_start, s.step_stop],
            "phases": sorted(s.phases) if s.phases is not None else None,
            "max_tensor_bytes": s.max_tensor_bytes,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "samebits": _samebits_version(),
            "environment": environment_fingerprint(),
            "determinism": _determinism_record(),
        }
        if append and self.path.exists():
            self._open_for_append(header)
        else:
            try:
                self._file = open(self.path, "xb")
            except FileExistsError:
                raise StreamError(
                    f"{self.path} already exists: samebits never overwrites a stream. "
                    "Record into a new directory, delete the old run, or pass append=True "
                    "to continue it (a resumed run)."
                ) from None
            header["segment"] = 0
        self._buffer += fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(header, sort_keys=True).encode())
        self._flush()
        if reference is not None:
            from samebits.stream.reader import open_run

            self._reference = open_run(reference).stream(s.rank).steps()
            self._reference_step = None
        _open_recorders.add(self)

    # -- recording --------------------------------------------------------------------

    def tensors(self, step: int, phase: str, named_tensors) -> None:
        """Record ``(name, tensor)`` pairs (or a mapping) under ``phase`` at ``step``.

        ``None`` tensors are recorded as absent; tensors over the size cap keep shape and
        dtype but no digest.  Digests are computed now, fetched at the end of the step.
        """
        if not self.active or not self.settings.selected(step, phase):
            return
        pending = self._step(step)
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        cap = self.settings.max_tensor_bytes
        records, occurrences = pending.records, pending.occurrences
        to_digest: dict[torch.device, tuple[int, list[torch.Tensor]]] = {}  # device -> (first index, tensors)
        for name, tensor in named_tensors:
            name = str(name)
            key = (fmt.RECORD_TENSOR, phase, name)
            occurrence = occurrences.get(key, 0)
            occurrences[key] = occurrence + 1
            if tensor is None:
                records.append((fmt.RECORD_TENSOR, phase, name, occurrence, _ABSENT_HEAD, 0, None))
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"Recorder.tensors(step={step}, phase={phase!r}): {name!r} is a "
                    f"{type(tensor).__name__}, not a torch.Tensor; record numbers with metrics()."
                )
            capped = cap is not None and tensor.nbytes > cap
            head, header = self._tensor_head(tensor.dtype, tensor.shape, capped)
            if capped:
                records.append((fmt.RECORD_TENSOR, phase, name, occurrence, head, 0, None))
                continue
            device = tensor.device
            batch = to_digest.get(device)
            if batch is None:
                queue = pending.devices.get(device) or pending.devices.setdefault(device, _DeviceQueue())
                batch = to_digest[device] = (queue.num_sums, [])
            records.append((fmt.RECORD_TENSOR, phase, name, occurrence, head, header,
                            (device, batch[0] + len(batch[1]))))
            batch[1].append(tensor)
        for device, (_, batch) in to_digest.items():
            queue = pending.devices[device]
            queue.sums.append(fingerprint.body_sums(batch))  # int64 [n] on the device: no sync
            queue.num_sums += len(batch)

    def metrics(self, step: int, phase: str = "metrics", **values) -> None:
        """Record scalars with their exact bits: Python floats as float64, ints as int64,
        0-dim tensors in their own dtype (kept on the device until the step ends)."""
        if not self.active or not self.settings.selected(step, phase):
            return
        pending = self._step(step)
        records, occurrences = pending.records, pending.occurrences
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"Recorder.metrics(step={step}): {name!r} has {value.numel()} elements; "
                        "metrics are scalars. Record tensors with tensors()."
                    )
                data = value.detach().reshape(1).clone().view(torch.uint8)  # a copy: values change
                queue = pending.devices.get(value.device) or pending.devices.setdefault(value.device, _DeviceQueue())
                where = (value.device, queue.num_metric_bytes, data.numel())
                queue.metrics.append(data)
                queue.num_metric_bytes += data.numel()
                code = dtype_code(value.dtype)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Recorder.metrics(step={step}): {name!r} is a {type(value).__name__}; "
                    "pass a float, an int or a one-element tensor."
                )
            else:
                code, where = (_FLOAT64_CODE, _F64.pack(value)) if isinstance(value, float) else \
                    (_INT64_CODE, _I64.pack(value))
            key = (fmt.RECORD_METRIC, phase, name)
            occurrence = occurrences.get(key, 0)
            occurrences[key] = occurrence + 1
            records.append((fmt.RECORD_METRIC, phase, name, occurrence, bytes((code,)), 0, where))

    def end_step(self, step: int | None = None) -> bool | None:
        """Finish the current step: fetch its digests, write it, and check it against the
        reference run if one was given.  Returns False when the step's root differs from
        the reference's, True when equal, None without a reference or such a step there.
        Calling it is optional: a record of a later step, or `close`, ends a step too."""
        if not self.active or self._pending is None:
            return None
        if step is not None and step != self._pending.step:
            raise ValueError(f"end_step({step}) but the open step is {self._pending.step}")
        root, count = self._write_step(self._pending)
        self._pending = None
        return self._check_reference(self._last_step, root, count)

    def close(self) -> None:
        """End the open step, write the closing frame and flush.  Idempotent."""
        if self._closed or not self.active:
            self._closed = True
            return
        if self._pending is not None:
            self.end_step()
        self._flush()
        index = bytearray()
        fmt.encode_varint(len(self._index), index)
        for step, count, root, offset in self._index:
            fmt.encode_varint(step, index)
            fmt.encode_varint(count, index)
            index += fmt.pack_u64(root)
            fmt.encode_varint(offset, index)
        index_offset = self._file.tell()
        self._buffer += fmt.frame(fmt.FRAME_INDEX, index)
        self._buffer += fmt.frame(fmt.FRAME_CLOSE, fmt.pack_u64(index_offset) + fmt.CLOSE_MAGIC)
        self._flush()
        self._file.close()
        self._closed = True
        _open_recorders.discard(self)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _step(self, step: int) -> _PendingStep:
        if self._closed:
            raise StreamError(f"Recorder for {self.path} is closed; open a new one to record more.")
        pending = self._pending
        if pending is not None and pending.step == step:
            return pending
        if pending is not None:
            if step < pending.step:
                raise ValueError(
                    f"step {step} recorded after step {pending.step} on rank {self.rank}: steps "
                    "must not decrease within a stream (count optimizer steps)."
                )
            self.end_step()
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} on rank {self.rank} was already written to {self.path}; steps must "
                "increase. A resumed run that replays steps should record into a new directory."
            )
        self._pending = _PendingStep(step)
        return self._pending

    def _tensor_head(self, dtype, shape, capped) -> tuple[bytes, int]:
        """(dtype code, flags, ndim, sizes) as bytes, and the digest header of (dtype, shape):
        the same for a tensor every step, so cached."""
        key = (dtype, shape, capped)
        cached = self._heads.get(key)
        if cached is None:
            encoded = bytearray((dtype_code(dtype), fmt.FLAG_CAPPED if capped else 0, len(shape)))
            for size in shape:
                fmt.encode_varint(size, encoded)
            cached = self._heads[key] = (bytes(encoded), fingerprint.header(dtype, shape))
        return cached

    def _encode_prefixes(self, kind, phase, name, occurrence, head, payload_length) -> tuple[bytes, bytes]:
        """The record's bytes up to its payload, in the stream (ids) and for the root (strings)."""
        tail = bytearray()
        fmt.encode_varint(occurrence, tail)
        tail += head
        record = bytearray()
        fmt.encode_varint(self._intern(phase), record)
        fmt.encode_varint(self._intern(name), record)
        record += tail
        framed = bytearray((kind,))
        fmt.encode_varint(len(record) + payload_length, framed)
        framed += record
        canonical = bytes((kind,)) + phase.encode() + b"\0" + name.encode() + b"\0" + bytes(tail)
        return bytes(framed), canonical

    def _intern(self, text: str) -> int:
        ident = self._names.get(text)
        if ident is None:
            ident = self._names[text] = len(self._names)
            self._new_names.append(text)
        return ident

    def _write_step(self, pending: _PendingStep) -> tuple[int, int]:
        sums, metric_bytes = {}, {}
        for device, queue in pending.devices.items():  # one device-to-host copy per device
            parts = [s.view(torch.uint8) for s in queue.sums] + queue.metrics
            data = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
            sums[device] = data[: 8 * queue.num_sums].view(np.uint64)
            metric_bytes[device] = data[8 * queue.num_sums :].tobytes()
        digested = [r for r in pending.records if r[0] == fmt.RECORD_TENSOR and r[6] is not None]
        body_sums = [0] * len(digested)
        groups: dict = {}  # device -> (positions in `digested`, indices into that device's sums)
        for position, record in enumerate(digested):
            group = groups.get(record[6][0]) or groups.setdefault(record[6][0], ([], []))
            group[0].append(position)
            group[1].append(record[6][1])
        for device, (positions, indices) in groups.items():
            for position, value in zip(positions, sums[device][indices].tolist()):
                body_sums[position] = value
        digests = iter(fingerprint.finalize(body_sums, [r[5] for r in digested]))
        body = bytearray()
        canonical = bytearray()  # what the step root hashes: records with strings, not ids
        encoded = self._encoded
        for kind, phase, name, occurrence, head, _, where in pending.records:
            if where is None:
                payload = b""
            elif kind == fmt.RECORD_TENSOR:
                payload = fmt.pack_u64(next(digests))
            elif isinstance(where, bytes):
                payload = where
            else:
                payload = metric_bytes[where[0]][where[1] : where[1] + where[2]]
            key = (kind, phase, name, occurrence, head, len(payload))
            prefixes = encoded.get(key)
            if prefixes is None:
                prefixes = encoded[key] = self._encode_prefixes(*key)
            body += prefixes[0]
            body += payload
            canonical += prefixes[1]
            canonical += payload
        root_value = int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "little")
        if self._new_names:
            names = bytearray()
            fmt.encode_varint(len(self._names) - len(self._new_names), names)
            fmt.encode_varint(len(self._new_names), names)
            for text in self._new_names:
                data = text.encode()
                fmt.encode_varint(len(data), names)
                names += data
            self._buffer += fmt.frame(fmt.FRAME_NAMES, names)
            self._new_names.clear()
        prefix = bytearray()
        fmt.encode_varint(pending.step, prefix)
        fmt.encode_varint(len(pending.records), prefix)
        prefix += fmt.pack_u64(root_value)
        self._index.append((pending.step, len(pending.records), root_value,
                            self._file.tell() + len(self._buffer)))
        self._buffer += fmt.frame(fmt.FRAME_STEP, prefix + body)
        self._last_step = pending.step
        self._num_steps += 1
        self._num_records += len(pending.records)
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.settings.flush_every:
            self._flush()
        return root_value, len(pending.records)

    def _flush(self) -> None:
        if self._buffer:
            self._file.write(self._buffer)
            self._buffer.clear()
        self._file.flush()  # reaches the OS: survives SIGKILL of this process
        self._steps_since_flush = 0

    def _check_reference(self, step: int, root: int, count: int) -> bool | None:
        if self._reference is None:
            return None
        ref = self._reference_step
        while ref is None or ref.step < step:
            ref = next(self._reference, None)
            if ref is None:
                self._reference = None  # the reference ended: nothing more to check
                return None
        self._reference_step = ref
        if ref.step != step:
            return None
        return ref.root == root and ref.num_records == count

    def _open_for_append(self, header: dict) -> None:
        from samebits.stream.reader import StreamReader

        existing = StreamReader(self.path)
        last = None
        for block in existing.steps():
            last = block.step
            self._index.append((block.step, block.num_records, block.root, block.offset))
        if existing.stop_reason is not None and existing.stop_reason.startswith("truncated"):
            import warnings

            warnings.warn(f"samebits: appending to {self.path}, which was {existing.stop_reason}; "
                          "the torn frame is dropped.", stacklevel=3)
        self._last_step = last
        for text in existing.names:
            self._names[text] = len(self._names)
        header["segment"] = existing.num_segments
        self._file = open(self.path, "r+b")
        self._file.truncate(existing.end_offset)  # drop a torn tail frame, never a complete one
        self._file.seek(existing.end_offset)


_open_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


@atexit.register
def _close_open_recorders() -> None:  # a script that forgot close() still gets its last step
    for recorder in list(_open_recorders):
        try:
            recorder.close()
        except Exception:
            pass


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _launcher_run_id() -> str | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "", "none") else run_id


def _samebits_version() -> str:
    from samebits import __version__

    return __version__


def _determinism_record():
    try:
        from samebits.determinism import active_record
    except ImportError:
        return None
    return active_record()
