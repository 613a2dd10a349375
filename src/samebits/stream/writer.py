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
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from samebits import fingerprint
from samebits.fingerprint._spec import dtype_code
from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.stream.environment import environment_fingerprint
from samebits.stream.settings import RecorderSettings


@dataclass
class _PendingStep:
    step: int
    records: list = field(default_factory=list)  # (kind, phase, name, head_bytes, digest slot | value)
    device_parts: dict = field(default_factory=dict)  # device -> list of uint8 tensors
    device_sizes: dict = field(default_factory=dict)  # device -> bytes queued so far
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
        if not self.active or not self.settings.step_selected(step):
            return
        pending = self._step(step)
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        cap = self.settings.max_tensor_bytes
        to_digest: list[torch.Tensor] = []
        slots: list[list] = []
        for name, tensor in named_tensors:
            if tensor is None:
                self._add(pending, fmt.RECORD_TENSOR, phase, name, bytes((0, fmt.FLAG_ABSENT, 0)), None)
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"Recorder.tensors(step={step}, phase={phase!r}): {name!r} is a "
                    f"{type(tensor).__name__}, not a torch.Tensor; record numbers with metrics()."
                )
            shape = tuple(tensor.shape)
            num_bytes = tensor.numel() * tensor.element_size()
            capped = cap is not None and num_bytes > cap
            head = self._tensor_head(tensor.dtype, shape, capped)
            if capped:
                self._add(pending, fmt.RECORD_TENSOR, phase, name, head, None)
                continue
            slot = [tensor.dtype, shape, num_bytes, None]
            self._add(pending, fmt.RECORD_TENSOR, phase, name, head, slot)
            to_digest.append(tensor)
            slots.append(slot)
        if to_digest:
            self._queue_body_sums(pending, to_digest, slots)

    def metrics(self, step: int, phase: str = "metrics", **values) -> None:
        """Record scalars with their exact bits: Python floats as float64, ints as int64,
        0-dim tensors in their own dtype (kept on the device until the step ends)."""
        if not self.active or not self.settings.step_selected(step):
            return
        pending = self._step(step)
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"Recorder.metrics(step={step}): {name!r} has {value.numel()} elements; "
                        "metrics are scalars. Record tensors with tensors()."
                    )
                value = value.detach().reshape(1)
                slot = [value.dtype, None, value.element_size(), None]
                self._add(pending, fmt.RECORD_METRIC, phase, name, bytes((dtype_code(value.dtype),)), slot)
                self._queue_bytes(pending, value.device, value.clone().view(torch.uint8), slot)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Recorder.metrics(step={step}): {name!r} is a {type(value).__name__}; "
                    "pass a float, an int or a one-element tensor."
                )
            else:
                dtype = torch.float64 if isinstance(value, float) else torch.int64
                raw = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
                slot = [dtype, None, 8, raw]
                self._add(pending, fmt.RECORD_METRIC, phase, name, bytes((dtype_code(dtype),)), slot)

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

    def _tensor_head(self, dtype, shape, capped) -> bytes:
        """dtype code, flags, ndim, sizes: the same for a tensor every step, so cached."""
        key = (dtype, shape, capped)
        head = self._heads.get(key)
        if head is None:
            encoded = bytearray((dtype_code(dtype), fmt.FLAG_CAPPED if capped else 0, len(shape)))
            for size in shape:
                fmt.encode_varint(size, encoded)
            head = self._heads[key] = bytes(encoded)
        return head

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

    def _add(self, pending, kind, phase, name, head, slot) -> None:
        key = (kind, phase, name)
        occurrence = pending.occurrences.get(key, 0)
        pending.occurrences[key] = occurrence + 1
        pending.records.append((kind, phase, str(name), occurrence, head, slot))

    def _queue_body_sums(self, pending, tensors, slots) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append(index)
        for device, indices in by_device.items():
            sums = fingerprint.body_sums([tensors[i] for i in indices])  # int64 [n], on device
            parts = pending.device_parts.setdefault(device, [])
            offset = pending.device_sizes.get(device, 0)
            for position, i in enumerate(indices):
                slots[i][3] = (device, offset + 8 * position)
            parts.append(sums.view(torch.uint8))
            pending.device_sizes[device] = offset + 8 * len(indices)

    def _queue_bytes(self, pending, device, data, slot) -> None:
        offset = pending.device_sizes.get(device, 0)
        pending.device_parts.setdefault(device, []).append(data)
        pending.device_sizes[device] = offset + data.numel()
        slot[3] = (device, offset)

    def _write_step(self, pending: _PendingStep) -> tuple[int, int]:
        fetched = {  # one device-to-host copy per device for the whole step
            device: (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy().tobytes()
            for device, parts in pending.device_parts.items()
        }
        tensor_sums, tensor_headers, tensor_positions = [], [], []
        for index, (kind, _, _, _, _, slot) in enumerate(pending.records):
            if kind == fmt.RECORD_TENSOR and slot is not None:
                device, offset = slot[3]
                tensor_sums.append(fmt.unpack_u64(fetched[device], offset))
                tensor_headers.append(fingerprint.header(slot[0], slot[1]))
                tensor_positions.append(index)
        digests = dict(zip(tensor_positions, fingerprint.finalize(tensor_sums, tensor_headers)))
        body = bytearray()
        canonical = bytearray()  # what the step root hashes: records with strings, not ids
        encoded = self._encoded
        for index, (kind, phase, name, occurrence, head, slot) in enumerate(pending.records):
            if slot is None:
                payload = b""
            elif kind == fmt.RECORD_METRIC:
                where = slot[3]
                payload = where if isinstance(where, bytes) else fetched[where[0]][where[1] : where[1] + slot[2]]
            else:
                payload = fmt.pack_u64(digests[index])
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
