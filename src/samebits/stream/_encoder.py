"""The stream encoder: records into bytes, one STEP frame per step (docs/stream.md).

A repeated `tensors` call reuses its *call plan* (records made, only new digests queued) and a
step with the last step's records its *step template* (payloads put in); tests/test_stream_encoding.py
and tests/test_stream_golden.py hold both to the record-by-record bytes.  Digests are computed
when recorded and fetched at step end, one device-to-host copy per device.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from samebits import fingerprint
from samebits.errors import ConfigError
from samebits.fingerprint import (StepFinalizer, StepFramer, body_sums_into, body_sums_of_checked, dtype_code,
                                  native_available)
from samebits.stream import _format as fmt
from samebits.stream.phases import GLOBAL_PHASE_PREFIX

_ABSENT_HEAD = bytes((0, fmt.FLAG_ABSENT, 0))  # dtype code 0 ("none"), flags, ndim 0
_MAX_CALL_PLANS = 64  # phases remembered (a program that makes up new phase names forgets them)
_FLOAT64_CODE, _INT64_CODE = dtype_code(torch.float64), dtype_code(torch.int64)
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")


@dataclass
class _DeviceQueue:
    """What one device holds for the step until its end: body sums, then metric bytes.  The
    CPU's sums go into the encoder's host buffer (`StepEncoder._host_sums`), not into ``sums``."""

    sums: list = field(default_factory=list)  # int64 tensors from fingerprint.body_sums (accelerators)
    num_sums: int = 0
    metrics: list = field(default_factory=list)  # uint8 tensors: each metric's raw bytes
    num_metric_bytes: int = 0


@dataclass
class PendingStep:
    step: int
    opened: float = field(default_factory=time.perf_counter)  # wall clock of its first record (step times)
    # (kind, phase, name, occurrence, head bytes, digest header, where): `where` is
    # (device, sum index) for a digested tensor, (device, offset, size) for a device metric,
    # (None, index into host_payloads) for a host metric, None for an absent or capped tensor.
    # Nothing in a record changes from step to step when the same things are recorded (the
    # values live in the sums and payloads), so equal record lists share one encoding.
    records: list = field(default_factory=list)
    devices: dict = field(default_factory=dict)  # device -> _DeviceQueue
    occurrences: dict = field(default_factory=dict)  # read through counts()
    # The occurrences of call plans reused in the step, merged into `occurrences` when something
    # reads them: a plan's records are of a phase new in the step, so no key is in two of them.
    plan_occurrences: list = field(default_factory=list)
    host_payloads: list = field(default_factory=list)  # the 8 bytes of each host metric
    tensor_phases: set = field(default_factory=set)  # phases with tensor records so far

    def counts(self) -> dict:
        """(kind, phase, name) -> records of it so far in the step."""
        if self.plan_occurrences:
            for occurrences in self.plan_occurrences:
                self.occurrences.update(occurrences)
            self.plan_occurrences.clear()
        return self.occurrences


@dataclass
class _CallPlan:
    """The records of one `tensors` call, reused while the next call of its phase, at the same
    point of its step, passes the same names and kinds of tensors (every decision of a record
    follows from those)."""

    names: list  # str only
    metas: list  # per tensor: (class, dtype, shape, device, layout), None for None
    device: object  # the one device digested on; None when nothing is digested
    base: int  # digests queued on that device before the call
    records: list
    occurrences: dict
    digest_positions: list  # positions in the call of the digested tensors, in order
    slots: list  # per position: the `where` of its digest, or None
    # `tensors_and_global` after it, when every global digest was its local one (nothing
    # sharded, nothing filtered or capped): the global records and their occurrences.
    global_records: list | None = None
    global_occurrences: dict | None = None
    # When every tensor of the call was digested as it is (row-major, no lazy negation or
    # conjugation) on the CPU with the compiled library: per tensor `_plain_key`, so that a
    # repeated call checks names, kinds and layout in one pass, and the byte sizes (fixed by
    # dtypes and shapes), so that it then reads only the addresses.
    plain_keys: list | None = None
    num_bytes: array | None = None


def _plain_key(name, t) -> tuple:
    """What a call plan's one-pass check compares: name, `_tensor_metas` (``is_cpu`` for the
    device: these plans are CPU-only) and the flags that let the digest read the tensor's memory
    as it is (raises for None and non-tensors).  No ``is_conj()``: only complex tensors carry the
    conjugate bit (torch asserts it), and a call with a complex tensor gets no plain keys."""
    return (name, t.__class__, t.dtype, t.shape, t.is_cpu, t.layout, t.is_contiguous(), t.is_neg())


def _digested_as_is(t) -> bool:
    """Whether the native digest reads ``t``'s memory as it is, and `_plain_key` covers it: on the
    CPU, row-major, not lazily negated, not complex (so never conjugated)."""
    return t.is_cpu and t.is_contiguous() and not t.is_neg() and not t.is_complex()


@dataclass
class _StepTemplate:
    """The encoding of a step's records, reused while a later step has equal records: its
    body with the payloads left zero, and where each payload goes."""

    records: list
    device: object  # the one device of the step's sums and metric bytes (None: none)
    sum_indices: np.ndarray  # per digested record, its index in the device's sums
    headers: np.ndarray  # uint64 digest headers, same order
    digest_at: np.ndarray  # intp [n, 8]: the body offsets of each digest's bytes
    metric_at: list  # (body offset, where) per metric record
    body: bytes
    # The same in one native call (compiled digest library loaded, digests on one device).
    finalizer: StepFinalizer | None = None


def _tensor_metas(pairs) -> list:
    """What a call plan is checked against: each tensor's kind (raises for non-tensors)."""
    return [(t.__class__, t.dtype, t.shape, t.device, t.layout) if t is not None else None for _, t in pairs]


class StepEncoder:
    """One stream's encoding state (see the module docstring).  ``settings``: the Recorder's
    `RecorderSettings` (the size cap and the name filters apply per record)."""

    def __init__(self, settings):
        self.settings = settings
        self._names: dict[str, int] = {}
        self._valid_names: set[str] = set()  # strings checked to be encodable
        self._names_hasher = fmt.new_names_hasher()  # the names key of the step root
        self._names_key: bytes | None = None  # its digest, until a name is added
        self._new_names: list[str] = []  # interned since the last step was encoded
        self._heads: dict[tuple, tuple[bytes, int]] = {}  # (dtype, shape, capped) -> (head bytes, header)
        self._encoded: dict[tuple, bytes] = {}  # a record's key -> its bytes up to the payload
        self._plans: dict[str, _CallPlan] = {}  # phase -> its last `tensors` call (see _CallPlan)
        self.plan_used: _CallPlan | None = None  # the plan the last `add_tensors` call used or made
        self._template: _StepTemplate | None = None  # the last step's encoding (see _StepTemplate)
        # The open step's CPU body sums, in one buffer reused every step (see _host_slots).
        self._host_sums = np.zeros(0, dtype=np.uint64)
        self._host_address = 0
        self._framer = StepFramer() if native_available() else None  # STEP frames in C

    def adopt_names(self, names: list[str]) -> None:
        """The names a continued stream interned already, in id order (they keep their ids)."""
        for text in names:
            self._names[text] = len(self._names)
            self._names_hasher.update(fmt.name_bytes(text))

    def add_tensors(self, pending: PendingStep, step: int, phase: str, named_tensors) -> list:
        """Adds the records of a `Recorder.tensors` call to the open step and queues their digests;
        returns the `where` of each position's digest (None where nothing is digested)."""
        if named_tensors.__class__ is list:
            pairs = named_tensors
        else:
            pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self.plan_used = None
        first_of_phase = phase not in pending.tensor_phases
        plan = self._plans.get(phase) if first_of_phase else None
        if plan is not None and plan.plain_keys is not None:  # names, kinds, layouts in one pass
            try:
                keys = [_plain_key(name, t) for name, t in pairs]
            except Exception:  # None, not a tensor: the paths below
                keys = None
            queue = pending.devices.get(plan.device)
            if keys == plan.plain_keys and (queue.num_sums if queue is not None else 0) == plan.base:
                pointers = [t.data_ptr() for _, t in pairs]
                if 0 not in pointers:  # straight into the host buffer: no tensor, nothing to gather later
                    if queue is None:
                        queue = pending.devices[plan.device] = _DeviceQueue()
                    body_sums_into(pointers, plan.num_bytes, self._host_slots(queue, len(pointers)))
                    queue.num_sums += len(pointers)
                    return self._reuse_plan(pending, phase, plan)
        if plan is not None and [name for name, _ in pairs] == plan.names:
            try:
                metas = _tensor_metas(pairs)
            except Exception:  # not a tensor, a nested tensor: the full path below says what is wrong
                metas = None
            queue = pending.devices.get(plan.device) if plan.device is not None else None
            if metas == plan.metas and (queue.num_sums if queue is not None else 0) == plan.base:
                if plan.digest_positions:  # the tensors were checked when the plan was made
                    tensors = [pairs[i][1] for i in plan.digest_positions]
                    if queue is None:
                        queue = pending.devices[plan.device] = _DeviceQueue()
                    self._queue_sums(queue, plan.device, body_sums_of_checked(tensors, plan.device), len(tensors))
                return self._reuse_plan(pending, phase, plan)
        return self._tensors_in_full(step, phase, pairs, pending, first_of_phase)

    def _reuse_plan(self, pending: PendingStep, phase: str, plan: _CallPlan) -> list:
        """Adds a call plan's records to the step (its digests are queued); returns its slots."""
        pending.records.extend(plan.records)
        pending.plan_occurrences.append(plan.occurrences)
        pending.tensor_phases.add(phase)
        self.plan_used = plan
        return plan.slots

    def _tensors_in_full(self, step: int, phase: str, pairs: list, pending: PendingStep,
                         first_of_phase: bool) -> list:
        """`add_tensors` record by record, checking everything; leaves a call plan when it can."""
        cap = self.settings.max_tensor_bytes
        # Build this call's records apart and commit them at the end: a bad tensor raises
        # before anything is added, so the open step stays consistent.
        records, occurrences = [], {}
        to_digest: dict[torch.device, tuple[int, list[torch.Tensor]]] = {}  # device -> (first index, tensors)
        self.check_text(phase, "phase", step)
        filters_names = self.settings.filters_names
        valid_names, heads = self._valid_names, self._heads
        slots: list = [None] * len(pairs)
        positions: list[int] = []  # of the digested tensors, in order
        all_str = True
        for position, (name, tensor) in enumerate(pairs):
            if name.__class__ is not str:
                name = str(name)
                all_str = False
            if filters_names and not self.settings.name_selected(phase, name):
                continue  # left out by include/exclude: no record, no digest
            if name not in valid_names:
                self.check_text(name, "name", step)
            key = (fmt.RECORD_TENSOR, phase, name)
            occurrence = occurrences.get(key)
            if occurrence is None:
                occurrence = pending.counts().get(key, 0)
            occurrences[key] = occurrence + 1
            if tensor is None:
                records.append((fmt.RECORD_TENSOR, phase, name, occurrence, _ABSENT_HEAD, 0, None))
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"Recorder.tensors(step={step}, phase={phase!r}): {name!r} is a "
                    f"{type(tensor).__name__}, not a torch.Tensor; record numbers with metrics()."
                )
            if tensor.layout is not torch.strided or tensor.is_nested:
                kind = "a nested tensor" if tensor.is_nested else f"a {tensor.layout} tensor"
                raise ConfigError(
                    f"Recorder.tensors(step={step}, phase={phase!r}): {name!r} is {kind}; only dense "
                    "(strided) tensors have a digest. Record its components (t.unbind() for nested, "
                    "t.to_dense() for sparse) under their own names."
                )
            capped = cap is not None and tensor.nbytes > cap
            dtype, shape = tensor.dtype, tensor.shape
            cached = heads.get((dtype, shape, capped))
            head, header = cached if cached is not None else self._tensor_head(dtype, shape, capped)
            if capped:
                records.append((fmt.RECORD_TENSOR, phase, name, occurrence, head, 0, None))
                continue
            device = tensor.device
            batch = to_digest.get(device)
            if batch is None:
                queue = pending.devices.get(device)
                batch = to_digest[device] = (queue.num_sums if queue else 0, [])
            where = (device, batch[0] + len(batch[1]))
            records.append((fmt.RECORD_TENSOR, phase, name, occurrence, head, header, where))
            batch[1].append(tensor)
            slots[position] = where
            positions.append(position)
        sums = {device: fingerprint.body_sums(batch) for device, (_, batch) in to_digest.items()}  # no sync
        for device, (_, batch) in to_digest.items():
            queue = pending.devices.get(device) or pending.devices.setdefault(device, _DeviceQueue())
            self._queue_sums(queue, device, sums[device], len(batch))
        pending.records.extend(records)
        pending.counts().update(occurrences)
        pending.tensor_phases.add(phase)
        if first_of_phase and all_str and len(to_digest) <= 1:
            try:
                metas = _tensor_metas(pairs)
            except Exception:  # a name filtered out before its value was looked at
                return slots
            (device, (base, _)), = to_digest.items() if to_digest else ((None, (0, None)),)
            if len(self._plans) >= _MAX_CALL_PLANS:
                self._plans.clear()
            num_bytes = plain_keys = None
            if device is not None and device.type == "cpu" and native_available() and len(positions) == len(pairs):
                if all(_digested_as_is(t) for _, t in pairs):  # every tensor digested, as it is
                    plain_keys = [_plain_key(name, t) for name, t in pairs]
                    num_bytes = array("Q", [t.nbytes for _, t in pairs])
            self._plans[phase] = self.plan_used = _CallPlan([name for name, _ in pairs], metas, device, base,
                                                            records, occurrences, positions, slots,
                                                            num_bytes=num_bytes, plain_keys=plain_keys)
        return slots

    def add_global(self, pending: PendingStep, step: int, phase: str, named: list, result,
                   present_slots: list | None):
        """Adds the records of a `Recorder.global_tensors` call: ``result`` is the call's
        `fingerprint.GlobalSums` (of the tensors that are not None, in order), ``present_slots``
        per such tensor the `where` of its local digest in this step when ``result`` reused it.
        Returns (records, occurrences) when every digest was reused and the phase was new in the
        step (what a call plan keeps), else None."""
        full_phase = GLOBAL_PHASE_PREFIX + str(phase)
        valid_names, heads = self._valid_names, self._heads
        for name, _ in named:
            if name not in valid_names:
                self.check_text(name, "name", step)
        device = result.sums.device
        reused = result.reused
        computed = not all(reused)
        queue = pending.devices.get(device) or pending.devices.setdefault(device, _DeviceQueue())
        base = queue.num_sums
        records, occurrences = [], {}
        first_of_phase = full_phase not in pending.tensor_phases
        seen = {} if first_of_phase else pending.counts()
        i = 0  # position in `names`: the present tensors, in order (names are unique)
        for name, tensor in named:
            key = (fmt.RECORD_TENSOR, full_phase, name)
            occurrence = occurrences.get(key, seen.get(key, 0))
            occurrences[key] = occurrence + 1
            if tensor is None:
                records.append((fmt.RECORD_TENSOR, full_phase, name, occurrence, _ABSENT_HEAD, 0, None))
                continue
            dtype, shape = result.dtypes[i], result.shapes[i]  # a tuple: keys the cache like a Size
            cached = heads.get((dtype, shape, False))
            head, header = cached if cached is not None else self._tensor_head(dtype, shape, False)
            records.append((fmt.RECORD_TENSOR, full_phase, name, occurrence, head, header,
                            present_slots[i] if reused[i] else (device, base + i)))
            i += 1
        if computed:
            self._queue_sums(queue, device, result.sums, len(result.reused))
        pending.records.extend(records)
        pending.counts().update(occurrences)
        pending.tensor_phases.add(full_phase)
        return (records, occurrences) if first_of_phase and not computed else None

    def add_metrics(self, pending: PendingStep, step: int, phase: str, values: dict) -> None:
        """Adds the records of a `Recorder.metrics` call (every value checked before any is added)."""
        self.check_text(phase, "phase", step)
        checked = []  # validate every value before recording any: a bad one leaves the step as it was
        for name, value in values.items():
            if value is None:
                continue
            self.check_text(name, "name", step)
            if isinstance(value, torch.Tensor):
                if value.is_nested or value.layout != torch.strided or value.numel() != 1:
                    size = "a nested" if value.is_nested else f"a {value.layout}" if value.layout != torch.strided \
                        else f"a {value.numel()}-element"
                    raise ConfigError(
                        f"Recorder.metrics(step={step}): {name!r} is {size} tensor; metrics are scalars "
                        "(one-element dense tensors). Record tensors with tensors()."
                    )
                checked.append((name, value, dtype_code(value.dtype)))
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Recorder.metrics(step={step}): {name!r} is a {type(value).__name__}; "
                    "pass a float, an int or a one-element tensor."
                )
            elif isinstance(value, float):
                checked.append((name, None, _F64.pack(value)))
            elif -(2**63) <= value < 2**63:
                checked.append((name, None, _I64.pack(value)))
            else:
                raise ConfigError(f"Recorder.metrics(step={step}): {name!r} = {value} does not fit in int64; "
                                  "pass it as a float or a tensor.")
        records, occurrences = pending.records, pending.counts()
        for name, value, encoded in checked:
            if value is not None:
                data = value.detach().reshape(1).clone().view(torch.uint8)  # a copy: values change
                queue = pending.devices.get(value.device) or pending.devices.setdefault(value.device, _DeviceQueue())
                where = (value.device, queue.num_metric_bytes, data.numel())
                queue.metrics.append(data)
                queue.num_metric_bytes += data.numel()
                code = encoded
            else:
                code, where = (_FLOAT64_CODE if isinstance(values[name], float) else _INT64_CODE), \
                    (None, len(pending.host_payloads))
                pending.host_payloads.append(encoded)
            key = (fmt.RECORD_METRIC, phase, name)
            occurrence = occurrences.get(key, 0)
            occurrences[key] = occurrence + 1
            records.append((fmt.RECORD_METRIC, phase, name, occurrence, bytes((code,)), 0, where))

    def _host_slots(self, queue: _DeviceQueue, count: int) -> int:
        """The address of ``count`` free sums after the CPU queue's in the host buffer (grown as
        needed, its contents kept)."""
        needed = queue.num_sums + count
        if needed > len(self._host_sums):
            grown = np.zeros(max(needed, 2 * len(self._host_sums), 256), dtype=np.uint64)
            grown[: queue.num_sums] = self._host_sums[: queue.num_sums]
            self._host_sums, self._host_address = grown, grown.ctypes.data
        return self._host_address + 8 * queue.num_sums

    def _queue_sums(self, queue: _DeviceQueue, device, sums: torch.Tensor, count: int) -> None:
        """Adds ``count`` body sums (an int64 tensor on ``device``) to the step's queue of that device."""
        if device.type == "cpu":
            self._host_slots(queue, count)
            self._host_sums[queue.num_sums : queue.num_sums + count] = sums.numpy().view(np.uint64)
        else:
            queue.sums.append(sums)
        queue.num_sums += count

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

    def _encode_prefixes(self, kind, phase, name, occurrence, head, payload_length) -> bytes:
        """The record's bytes up to its payload, as stored (names as interned ids)."""
        record = bytearray()
        fmt.encode_varint(self._intern(phase), record)
        fmt.encode_varint(self._intern(name), record)
        fmt.encode_varint(occurrence, record)
        record += head
        framed = bytearray((kind,))
        fmt.encode_varint(len(record) + payload_length, framed)
        framed += record
        return bytes(framed)

    def _intern(self, text: str) -> int:
        ident = self._names.get(text)
        if ident is None:
            ident = self._names[text] = len(self._names)
            self._new_names.append(text)
            self._names_hasher.update(fmt.name_bytes(text))
            self._names_key = None
        return ident

    def check_text(self, text, what: str, step) -> None:
        """Names and phases must be strings that encode to utf-8 (checked once each)."""
        if text in self._valid_names:
            return
        if not isinstance(text, str):
            raise ConfigError(f"Recorder at step {step}: the {what} {text!r} is a {type(text).__name__}; "
                              "pass a str.")
        try:
            text.encode()
        except UnicodeEncodeError as err:
            raise ConfigError(f"Recorder at step {step}: the {what} {text!r} cannot be stored as utf-8 ({err.reason} "
                              f"at position {err.start}); pass a valid string.") from None
        self._valid_names.add(text)

    def _fetch(self, pending: PendingStep) -> tuple[dict, dict]:
        """Per device, the step's body sums (a uint64 numpy array) and its metric bytes: one
        device-to-host copy per accelerator; the CPU's sums are already in the host buffer."""
        sums, metric_bytes = {}, {}
        for device, queue in pending.devices.items():
            if device.type == "cpu":
                sums[device] = self._host_sums[: queue.num_sums]
                metric_bytes[device] = b"".join([m.numpy().tobytes() for m in queue.metrics])
                continue
            parts = [s.view(torch.uint8) for s in queue.sums] + queue.metrics
            data = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
            sums[device] = data[: 8 * queue.num_sums].view(np.uint64)
            metric_bytes[device] = data[8 * queue.num_sums :].tobytes()
        return sums, metric_bytes

    def encode_step(self, pending: PendingStep) -> tuple[bytes, bytes | bytearray, int]:
        """The step's frames: a NAMES frame of the names it interned first (or b""), its STEP
        frame, and its root.  Fetches the step's digests (the one host synchronisation)."""
        template = self._template
        if template is not None and pending.records == template.records:
            body, body_ref = self._fill_template(template, pending)
        else:
            body, body_ref = self._encode_records(pending, *self._fetch(pending)), None
        if body_ref is None:  # what the native framer reads: bytes, or the finalizer's buffer
            body_ref = body = bytes(body)
        names_key = self._names_key
        if names_key is None:
            names_key = self._names_key = self._names_hasher.digest()
        names_frame = b""
        if self._new_names:
            names = bytearray()
            fmt.encode_varint(len(self._names) - len(self._new_names), names)
            fmt.encode_varint(len(self._new_names), names)
            names += b"".join(map(fmt.name_bytes, self._new_names))
            names_frame = fmt.frame(fmt.FRAME_NAMES, names)
            self._new_names.clear()
        if self._framer is not None:  # hash, varints and crc in one native call: the same bytes
            frame, root = self._framer.frame(names_key, pending.step, len(pending.records), body_ref, len(body))
        else:
            root = fmt.step_root(names_key, body)
            prefix = bytearray()
            fmt.encode_varint(pending.step, prefix)
            fmt.encode_varint(len(pending.records), prefix)
            prefix += fmt.pack_u64(root)
            frame = fmt.frame(fmt.FRAME_STEP, prefix + body)
        return names_frame, frame, root

    def _metric_payload(self, where, pending: PendingStep, metric_bytes: dict) -> bytes:
        if where[0] is None:
            return pending.host_payloads[where[1]]
        return metric_bytes[where[0]][where[1] : where[1] + where[2]]

    def _fill_template(self, template: _StepTemplate, pending: PendingStep) -> tuple[bytearray, Any]:
        """The step's body from the last step's encoding (equal records): its payloads put in.
        Returns (body, a ctypes pointer to it, or None): with the compiled library the copy and
        the digests are one native call, and on the CPU the sums are read where they are."""
        metric_bytes = None
        if template.finalizer is not None:
            if template.device.type == "cpu":
                body = template.finalizer.fill(self._host_address, pending.devices[template.device].num_sums)
            else:
                sums, metric_bytes = self._fetch(pending)
                device_sums = sums[template.device]
                body = template.finalizer.fill(device_sums.ctypes.data, len(device_sums))
            pointer = template.finalizer.pointer
        else:
            sums, metric_bytes = self._fetch(pending)
            body, pointer = bytearray(template.body), None
            if len(template.sum_indices):
                values = sums[template.device][template.sum_indices]
                packed = np.frombuffer(fingerprint.finalize_packed(values, template.headers), dtype=np.uint8)
                np.frombuffer(body, dtype=np.uint8)[template.digest_at] = packed.reshape(-1, 8)
        if template.metric_at:
            if metric_bytes is None:
                metric_bytes = self._fetch(pending)[1]
            for offset, where in template.metric_at:
                payload = self._metric_payload(where, pending, metric_bytes)
                body[offset : offset + len(payload)] = payload
        return body, pointer

    def _encode_records(self, pending: PendingStep, sums: dict, metric_bytes: dict) -> bytearray:
        """The step's body record by record; leaves its encoding as the template for the next."""
        # The step's digests, finalized at once: packed[8k : 8k + 8] is the k-th digested record's.
        digested = [r for r in pending.records if r[6] is not None and r[0] == fmt.RECORD_TENSOR]
        if len(sums) == 1:  # one device: the usual case
            (device_sums,) = sums.values()
            sum_indices = np.array([r[6][1] for r in digested], dtype=np.intp)
            values = device_sums[sum_indices]
        else:
            sum_indices = None
            values = np.empty(len(digested), dtype=np.uint64)
            groups: dict = {}  # device -> (positions in `digested`, indices into that device's sums)
            for position, record in enumerate(digested):
                group = groups.get(record[6][0]) or groups.setdefault(record[6][0], ([], []))
                group[0].append(position)
                group[1].append(record[6][1])
            for device, (positions, indices) in groups.items():
                values[positions] = sums[device][indices]
        headers = np.array([r[5] for r in digested], dtype=np.uint64)
        packed = fingerprint.finalize_packed(values, headers)
        body = bytearray()
        encoded = self._encoded
        at = 0
        digest_at, metric_at = [], []
        for kind, phase, name, occurrence, head, _, where in pending.records:
            if where is None:
                payload = b""
            elif kind == fmt.RECORD_TENSOR:
                payload = packed[at : at + 8]
                at += 8
            else:
                payload = self._metric_payload(where, pending, metric_bytes)
            key = (kind, phase, name, occurrence, head, len(payload))
            prefixes = encoded.get(key)
            if prefixes is None:
                prefixes = encoded[key] = self._encode_prefixes(*key)
            body += prefixes
            if where is not None and kind == fmt.RECORD_TENSOR:
                digest_at.append(len(body))
            elif where is not None:
                metric_at.append((len(body), where))
            body += payload
        self._template = None
        if len(sums) <= 1:  # one device (or none): its sums are indexed as in this step
            sum_indices = sum_indices if sums else np.zeros(0, dtype=np.intp)
            body = bytes(body)
            finalizer = StepFinalizer(body, sum_indices, headers, np.array(digest_at, dtype=np.int64)) \
                if len(sum_indices) and native_available() else None
            self._template = _StepTemplate(
                list(pending.records), next(iter(sums), None), sum_indices, headers,
                np.array(digest_at, dtype=np.intp).reshape(-1, 1) + np.arange(8, dtype=np.intp),
                metric_at, body, finalizer)
        return body


def index_frames(index: list[tuple[int, int, int, int]], index_offset: int) -> bytes:
    """The closing frames: INDEX (every step's step, record count, root and frame offset) at
    ``index_offset``, then CLOSE (which points at it)."""
    payload = bytearray()
    fmt.encode_varint(len(index), payload)
    for step, count, root, offset in index:
        fmt.encode_varint(step, payload)
        fmt.encode_varint(count, payload)
        payload += fmt.pack_u64(root)
        fmt.encode_varint(offset, payload)
    return fmt.frame(fmt.FRAME_INDEX, payload) + fmt.frame(fmt.FRAME_CLOSE, fmt.pack_u64(index_offset) + fmt.CLOSE_MAGIC)
