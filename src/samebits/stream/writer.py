"""`Recorder`: writes one rank's fingerprint stream.

Tensors are digested *when they are recorded* (their values may change in place right
after), but on an accelerator the digests stay on the device until the step ends; then
one device-to-host copy per device fetches the whole step.  Nothing here synchronises
the host per tensor.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import importlib.metadata
import json
import math
import operator
import os
import socket
import struct
import time
import uuid
import warnings
import weakref
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from samebits import fingerprint, settings
from samebits.determinism import active_record
from samebits.fingerprint import _native
from samebits.fingerprint._digest import body_sums_of_checked
from samebits.fingerprint._global import all_unsharded, local_part
from samebits.fingerprint._spec import dtype_code
from samebits.errors import ConfigError, StreamError
from samebits.stream import _format as fmt
from samebits.stream.environment import environment_fingerprint
from samebits.stream.reader import StreamReader, open_run
from samebits.stream.settings import RecorderSettings

_ABSENT_HEAD = bytes((0, fmt.FLAG_ABSENT, 0))  # dtype code 0 ("none"), flags, ndim 0
_MAX_CALL_PLANS = 64  # phases remembered (a program that makes up new phase names forgets them)
# Phases of records made by `Recorder.global_tensors`: digests of full (global) tensors.
GLOBAL_PHASE_PREFIX = "global:"
_FLOAT64_CODE, _INT64_CODE = dtype_code(torch.float64), dtype_code(torch.int64)
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")


@dataclass
class _DeviceQueue:
    """What one device holds for the step until its end: body sums, then metric bytes.  The
    CPU's sums go into the Recorder's host buffer (`Recorder._host_sums`), not into ``sums``."""

    sums: list = field(default_factory=list)  # int64 tensors from fingerprint.body_sums (accelerators)
    num_sums: int = 0
    metrics: list = field(default_factory=list)  # uint8 tensors: each metric's raw bytes
    num_metric_bytes: int = 0


@dataclass
class _PendingStep:
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
    """The records of one `tensors` call, made again without per-record work while the next
    call of its phase, at the same point of its step (first of that phase, the same number of
    digests queued before it), passes the same names and the same kinds of tensors.  Every
    decision of a record (name filters, size cap, head, occurrence) follows from those."""

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
    finalizer: _native.StepFinalizer | None = None


def _tensor_metas(pairs) -> list:
    """What a call plan is checked against: each tensor's kind (raises for non-tensors)."""
    return [(t.__class__, t.dtype, t.shape, t.device, t.layout) if t is not None else None for _, t in pairs]


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

    One writer per stream: the stream file is locked (``flock``) while a Recorder has it
    open, and a second Recorder on the same stream (another process, or this one) gets a
    `StreamError` naming the file and the holder.
    """

    _times: "_StepTimes | None" = None  # the step-times side file, once the stream is open

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
        include: str | Iterable[str] | None = None,
        exclude: str | Iterable[str] | None = None,
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
            include=include,
            exclude=exclude,
        )
        s = self.settings
        self.rank, self.world_size = s.rank, s.world_size
        self.active = s.enabled and s.rank_selected
        self._file = None
        self._lock_note: Path | None = None
        self._pending: _PendingStep | None = None
        self._last_step: int | None = None
        self._names: dict[str, int] = {}
        self._valid_names: set[str] = set()  # strings checked to be encodable
        self._names_hasher = fmt.new_names_hasher()  # the names key of the step root
        self._names_key: bytes | None = None  # its digest, until a name is added
        self._written = 0  # the file offset the buffer starts at
        self._heads: dict[tuple, bytes] = {}
        self._index: list[tuple[int, int, int, int]] = []  # (step, records, root, frame offset)
        self._encoded: dict[tuple, tuple[bytes, bytes]] = {}
        self._plans: dict[str, _CallPlan] = {}  # phase -> its last `tensors` call (see _CallPlan)
        self._plan_used: _CallPlan | None = None  # the plan the last `_tensors` call used or made
        self._template: _StepTemplate | None = None  # the last step's encoding (see _StepTemplate)
        self._new_names: list[str] = []
        self._buffer = bytearray()
        # The open step's CPU body sums, in one buffer reused every step (see _host_slots).
        self._host_sums = np.zeros(0, dtype=np.uint64)
        self._host_address = 0
        self._framer = _native.StepFramer() if _native.available() else None  # STEP frames in C
        self._steps_since_flush = 0
        self._num_steps = self._num_records = 0
        self._reference = None
        self._closed = False
        self._end_step_hooks: list[tuple] = []  # (before, after) callbacks: `on_end_step`
        self._own_work = None  # `around_own_work`: a context for the recorder's own torch work
        if not self.active:
            return
        s.directory.mkdir(parents=True, exist_ok=True)
        self.path = s.directory / fmt.stream_filename(s.rank)
        self._pid = os.getpid()  # the owning process: a forked child never writes this stream
        header = {
            "schema": fmt.SCHEMA_VERSION,
            fmt.DIGEST_VERSION_KEY: fingerprint.DIGEST_VERSION,
            "run_id": None,  # chosen below, once nothing can refuse the Recorder before it writes
            "run_id_source": None,
            "rank": s.rank,
            "world_size": s.world_size,
            "coords": dict(coords or {}),
            "config": _jsonable(dict(config or {})),
            "window": [s.step_start, s.step_stop],
            "phases": sorted(s.phases) if s.phases is not None else None,
            "ranks": sorted(s.ranks) if s.ranks is not None else None,
            "max_tensor_bytes": s.max_tensor_bytes,
            **({"include": list(s.include), "exclude": list(s.exclude)} if s.filters_names else {}),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "samebits": _samebits_version(),
            "environment": environment_fingerprint(),
            "determinism": _determinism_record(),
        }
        if reference is not None:  # before creating anything: a bad reference leaves no file behind
            reference_run = open_run(reference)
            if reference_run.digest_version != fingerprint.DIGEST_VERSION:
                raise ConfigError(
                    f"reference run {reference_run.path} was recorded with digest version "
                    f"{reference_run.digest_version}; this samebits computes digest version "
                    f"{fingerprint.DIGEST_VERSION}, so no step could match. Re-record the reference "
                    "with this samebits, or record without a reference."
                )
            self._reference = reference_run.stream(s.rank).steps()
            self._reference_step = None
        appending = append and self.path.exists()
        if not appending:
            # A stream continued by `append` keeps its own run id (`_open_for_append`); a new
            # stream of a resumed run takes the id of the run's other streams: it stays one run.
            header["run_id"], header["run_id_source"] = \
                (_sibling_run_id(s.directory, s.rank) if append else None) or _choose_run_id(run_id, s.directory)
        if appending:
            try:
                self._open_for_append(header)
            except BaseException:
                if self._file is not None:
                    self._release()
                raise
        else:
            try:
                self._file = open(self.path, "xb", buffering=0)  # unbuffered: one write per flush
            except FileExistsError:
                raise StreamError(
                    f"{self.path} already exists: samebits never overwrites a stream. "
                    "Record into a new directory, delete the old run, or pass append=True "
                    "to continue it (a resumed run)."
                ) from None
            except OSError as err:
                raise StreamError(f"{self.path}: cannot create the stream ({err.strerror}).") from None
            self._lock()
            header["segment"] = 0
        self._times = _StepTimes(self.path, header)  # wall time per step, beside the stream: never compared
        self._written = self._file.tell()
        self._buffer += fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(header, sort_keys=True).encode())
        self._flush()
        _open_recorders.add(self)

    # -- recording --------------------------------------------------------------------

    def wants(self, step: int, phase: str) -> bool:
        """Whether `tensors`/`metrics` of ``phase`` at ``step`` would write anything: the
        recorder is enabled, this rank is recorded and the step and phase pass their filters.
        Lets a caller skip *building* records that would be dropped (a state census, captured
        activations): ``if rec.wants(step, "state"): rec.tensors(step, "state", census())``.
        Name filters (include/exclude) apply per tensor later.  `global_tensors` is collective:
        call it on every rank whatever this says."""
        return self.active and self.settings.selected(step, phase)

    def tensors(self, step: int, phase: str, named_tensors) -> None:
        """Record ``(name, tensor)`` pairs (or a mapping) under ``phase`` at ``step``.

        ``None`` tensors are recorded as absent; tensors over the size cap keep shape and
        dtype but no digest.  Digests are computed now, fetched at the end of the step.
        """
        if not self.active:
            return
        if self._own_work is not None:
            with self._own_work():
                self._tensors(step, phase, named_tensors)
                return
        self._tensors(step, phase, named_tensors)

    def _tensors(self, step: int, phase: str, named_tensors) -> list | None:
        """Records the call's tensors; returns the `where` of each position's digest (None where
        nothing is digested), or None when the step or phase is not recorded."""
        if step.__class__ is not int or not 0 <= step <= fmt.MAX_STEP:  # before the window check:
            step = _check_step(step, self.rank)  # a bad step is an error, never silently dropped
        if not self.settings.selected(step, phase):
            return None
        pending = self._step(step)
        if named_tensors.__class__ is list:
            pairs = named_tensors
        else:
            pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self._plan_used = None
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
                    _native.body_sums_into(pointers, plan.num_bytes, self._host_slots(queue, len(pointers)))
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

    def _reuse_plan(self, pending: _PendingStep, phase: str, plan: _CallPlan) -> list:
        """Adds a call plan's records to the step (its digests are queued); returns its slots."""
        pending.records.extend(plan.records)
        pending.plan_occurrences.append(plan.occurrences)
        pending.tensor_phases.add(phase)
        self._plan_used = plan
        return plan.slots

    def _tensors_in_full(self, step: int, phase: str, pairs: list, pending: _PendingStep,
                         first_of_phase: bool) -> list:
        """`_tensors` record by record, checking everything; leaves a call plan when it can."""
        cap = self.settings.max_tensor_bytes
        # Build this call's records apart and commit them at the end: a bad tensor raises
        # before anything is added, so the open step stays consistent.
        records, occurrences = [], {}
        to_digest: dict[torch.device, tuple[int, list[torch.Tensor]]] = {}  # device -> (first index, tensors)
        self._check_text(phase, "phase", step)
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
                self._check_text(name, "name", step)
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
            if device is not None and device.type == "cpu" and _native.available() and len(positions) == len(pairs):
                if all(_digested_as_is(t) for _, t in pairs):  # every tensor digested, as it is
                    plain_keys = [_plain_key(name, t) for name, t in pairs]
                    num_bytes = array("Q", [t.nbytes for _, t in pairs])
            self._plans[phase] = self._plan_used = _CallPlan([name for name, _ in pairs], metas, device, base,
                                                             records, occurrences, positions, slots,
                                                             num_bytes=num_bytes, plain_keys=plain_keys)
        return slots

    def global_tensors(self, step: int, phase: str, named_tensors, group=None) -> None:
        """Record the digests of the *full* tensors behind sharded ones (DTensor, FSDP2
        parameters, Megatron tensor-parallel shards over ``group``; plain tensors as they
        are) under the phase ``GLOBAL_PHASE_PREFIX + phase``, with their global shape and
        dtype: layout-independent records that ``samebits diff --by global`` compares across
        runs of different parallel layouts (docs/digest.md, "Global digests").

        Collective (`samebits.fingerprint.global_digests`): every rank of each shard group
        calls it at the same step with the same names in the same order, ranks that this
        recorder leaves out (``SAMEBITS_RANKS``) too: they take part and write nothing.
        Every recorded rank records the same digests; ``None`` (no gradient) is recorded as
        absent.  The size cap does not apply.  One int64 all-reduce per group; on an
        accelerator the sums stay there until the step's one copy to the host.
        """
        self._collective_call(self._global_tensors, step, phase, named_tensors, group, None)

    def tensors_and_global(self, step: int, phase: str, named_tensors, group=None) -> None:
        """`tensors` of each tensor's local part (a DTensor's ``to_local()``, any other tensor as
        it is) under ``phase``, then `global_tensors` of the tensors under ``global:phase``: the
        same records, in the same order, as those two calls, for less.  A tensor that is not
        sharded is digested once for both of its records (its global digest is its local one),
        and the local parts of the call in one batch.  Collective, like `global_tensors`."""
        self._collective_call(self._tensors_and_global, step, phase, named_tensors, group)

    def _collective_call(self, method, step, phase: str, named_tensors, *args) -> None:
        """Checks the step, lists ``named_tensors`` as (str name, tensor or None) pairs and
        calls ``method(step, phase, named, *args)`` inside the recorder's own-work hook, unless
        the recorder is off or does not record this step or phase (the same on every rank)."""
        if not self.settings.enabled:
            return
        if step.__class__ is not int or not 0 <= step <= fmt.MAX_STEP:
            step = _check_step(step, self.rank)
        if not self.settings.selected(step, phase):
            return
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        named = [(name if name.__class__ is str else str(name), tensor) for name, tensor in named_tensors]
        own_work = self._own_work
        if own_work is not None:
            with own_work():
                method(step, phase, named, *args)
        else:
            method(step, phase, named, *args)

    def _tensors_and_global(self, step: int, phase: str, named: list, group) -> None:
        if not self.active:  # a rank left out takes part in the reduction and records nothing
            self._global_tensors(step, phase, named, group, None)
            return
        unsharded = all_unsharded([tensor for _, tensor in named])
        slots = self._tensors(step, phase, named if unsharded else
                              [(name, local_part(tensor) if tensor is not None else None) for name, tensor in named])
        plan, pending = self._plan_used, self._pending
        full_phase = GLOBAL_PHASE_PREFIX + str(phase)
        if unsharded and plan is not None and plan.global_records is not None \
                and full_phase not in pending.tensor_phases:
            # The same call as when the plan's global records were made, and nothing sharded:
            # every global record is its local record's digest again (no collective to join).
            pending.records.extend(plan.global_records)
            pending.plan_occurrences.append(plan.global_occurrences)
            pending.tensor_phases.add(full_phase)
            return
        made = self._global_tensors(step, phase, named, group, slots)
        if plan is not None and made is not None:
            plan.global_records, plan.global_occurrences = made

    def _global_tensors(self, step: int, phase: str, named: list, group, slots: list | None):
        """``slots``: per tensor, where this step already holds the digest of its local part
        (from `_tensors` in this same call), or None; reused for the unsharded ones.  Returns
        (records, occurrences) when every digest was reused and the phase was new in the step
        (what a call plan keeps), else None."""
        full_phase = GLOBAL_PHASE_PREFIX + str(phase)
        if self.active:
            self._check_text(phase, "phase", step)
        present = [(name, tensor) for name, tensor in named if tensor is not None]
        present_slots = known = None
        if slots is not None:
            present_slots = [slot for slot, (_, tensor) in zip(slots, named) if tensor is not None]
            known = [slot is not None for slot in present_slots]
        names, result = fingerprint.global_body_sums(present, group=group, known=known)
        if result.sums.device.type == "cpu" and not bool(result.consistent):  # free on CPU; on a GPU a sync
            raise ConfigError(f"Recorder.global_tensors(step={step}, phase={phase!r}) on rank {self.rank}: the "
                              "ranks of a shard group passed different tensors (names, dtypes or global shapes); "
                              "every rank must pass the same names in the same order.")
        if not self.active:
            return
        pending = self._step(step)
        valid_names, heads = self._valid_names, self._heads
        for name, _ in named:
            if name not in valid_names:
                self._check_text(name, "name", step)
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
            self._queue_sums(queue, device, result.sums, len(names))
        pending.records.extend(records)
        pending.counts().update(occurrences)
        pending.tensor_phases.add(full_phase)
        return (records, occurrences) if first_of_phase and not computed else None

    def metrics(self, step: int, phase: str = "metrics", **values) -> None:
        """Record scalars with their exact bits: Python floats as float64, ints as int64,
        0-dim tensors in their own dtype (kept on the device until the step ends)."""
        if not self.active:
            return
        if self._own_work is not None:
            with self._own_work():
                return self._metrics(step, phase, values)
        return self._metrics(step, phase, values)

    def _metrics(self, step: int, phase: str, values: dict) -> None:
        if step.__class__ is not int or not 0 <= step <= fmt.MAX_STEP:
            step = _check_step(step, self.rank)
        if not self.settings.selected(step, phase):
            return
        pending = self._step(step)
        self._check_text(phase, "phase", step)
        checked = []  # validate every value before recording any: a bad one leaves the step as it was
        for name, value in values.items():
            if value is None:
                continue
            self._check_text(name, "name", step)
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

    def end_step(self, step: int | None = None) -> bool | None:
        """Finish the current step: fetch its digests, write it, and check it against the
        reference run if one was given.  Returns False when the step's root differs from
        the reference's, True when equal, None without a reference or such a step there.
        Calling it is optional: a record of a later step, or `close`, ends a step too.
        Hooks registered with `on_end_step` run around it (also when it writes nothing)."""
        if not self._end_step_hooks:
            return self._end_step(step)
        hooks = list(self._end_step_hooks)
        for before, _ in hooks:
            if before is not None:
                before(step)
        result = self._end_step(step)
        for _, after in hooks:
            if after is not None:
                after(step)
        return result

    def _end_step(self, step: int | None) -> bool | None:
        if not self.active or self._pending is None:
            return None
        if step is not None and step != self._pending.step:
            raise ConfigError(f"end_step({step}) but the open step is {self._pending.step}")
        root, count = self._write_step(self._pending)
        self._pending = None
        return self._check_reference(self._last_step, root, count)

    # -- hooks (a tracer's) ---------------------------------------------------------------

    def on_end_step(self, before=None, after=None) -> "RecorderHook":
        """Call ``before(step)`` just before `end_step` writes a step (records it makes belong
        to that step) and ``after(step)`` just after (it may end the process); ``step`` is
        what `end_step` was given (None: the open step).  ``.remove()`` the returned handle."""
        entry = (before, after)
        self._end_step_hooks.append(entry)
        return RecorderHook(lambda: self._end_step_hooks.remove(entry) if entry in self._end_step_hooks else None)

    def around_own_work(self, context) -> "RecorderHook":
        """Run `tensors` and `metrics` inside ``context()`` (a context manager factory), e.g. a
        tracer's ``suspended``: the recorder's own copies and views are then never traced as
        the program's ops.  One at a time; ``.remove()`` the handle to restore the previous one."""
        previous, self._own_work = self._own_work, context

        def remove() -> None:
            if self._own_work is context:
                self._own_work = previous

        return RecorderHook(remove)

    def close(self) -> None:
        """End the open step, write the closing frame and flush.  Idempotent.  In a forked child
        of the process that opened it, it does nothing: the stream, its lock note and its step
        times are the parent's (the child's exit runs this at exit; it must not end them)."""
        if self._closed or not self.active:
            self._closed = True
            return
        if os.getpid() != self._pid:
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
        self._release()
        self._closed = True
        _open_recorders.discard(self)

    def _release(self) -> None:
        if self._lock_note is not None:
            try:
                self._lock_note.unlink()
            except OSError:
                pass
            self._lock_note = None
        self._file.close()  # releases the lock
        if self._times is not None:
            self._times.close()

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
                raise ConfigError(
                    f"step {step} recorded after step {pending.step} on rank {self.rank}: steps "
                    "must not decrease within a stream (count optimizer steps)."
                )
            self.end_step()
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(
                f"step {step} on rank {self.rank} was already written to {self.path}; steps must "
                "increase. A resumed run that replays steps should record into a new directory."
            )
        self._pending = _PendingStep(step)
        return self._pending

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
        return bytes(framed)

    def _intern(self, text: str) -> int:
        ident = self._names.get(text)
        if ident is None:
            ident = self._names[text] = len(self._names)
            self._new_names.append(text)
            self._names_hasher.update(fmt.name_bytes(text))
            self._names_key = None
        return ident

    def _check_text(self, text, what: str, step) -> None:
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

    def _fetch(self, pending: _PendingStep) -> tuple[dict, dict]:
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

    def _write_step(self, pending: _PendingStep) -> tuple[int, int]:
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
        offset = self._written + len(self._buffer)
        if self._framer is not None:  # hash, varints and crc in one native call: the same bytes
            frame, root_value = self._framer.frame(names_key, pending.step, len(pending.records), body_ref, len(body))
        else:
            root_value = fmt.step_root(names_key, body)
            prefix = bytearray()
            fmt.encode_varint(pending.step, prefix)
            fmt.encode_varint(len(pending.records), prefix)
            prefix += fmt.pack_u64(root_value)
            frame = fmt.frame(fmt.FRAME_STEP, prefix + body)
        self._buffer += frame
        self._index.append((pending.step, len(pending.records), root_value, offset))
        self._last_step = pending.step
        self._times.add(pending.step, pending.opened)
        self._num_steps += 1
        self._num_records += len(pending.records)
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.settings.flush_every:
            self._flush()
        return root_value, len(pending.records)

    def _metric_payload(self, where, pending: _PendingStep, metric_bytes: dict) -> bytes:
        if where[0] is None:
            return pending.host_payloads[where[1]]
        return metric_bytes[where[0]][where[1] : where[1] + where[2]]

    def _fill_template(self, template: _StepTemplate, pending: _PendingStep) -> tuple[bytearray, Any]:
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

    def _encode_records(self, pending: _PendingStep, sums: dict, metric_bytes: dict) -> bytearray:
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
            finalizer = _native.StepFinalizer(body, sum_indices, headers, np.array(digest_at, dtype=np.int64)) \
                if len(sum_indices) and _native.available() else None
            self._template = _StepTemplate(
                list(pending.records), next(iter(sums), None), sum_indices, headers,
                np.array(digest_at, dtype=np.intp).reshape(-1, 1) + np.arange(8, dtype=np.intp),
                metric_at, body, finalizer)
        return body

    def _flush(self) -> None:
        """Hands the buffered frames to the OS (one write; they survive a SIGKILL of this process)."""
        buffer = self._buffer
        if buffer:
            if os.getpid() != self._pid:
                raise StreamError(
                    f"{self.path} belongs to the Recorder of process {self._pid}; this is process {os.getpid()}, "
                    "a fork of it: a forked child never writes its parent's stream. Open a Recorder of its own "
                    "in the child (another directory or rank), or record in the parent.")
            done = self._file.write(buffer)  # the file is unbuffered: this is the system call
            while done < len(buffer):  # a short write (rare for a file): the rest
                done += self._file.write(memoryview(buffer)[done:])
            self._written += len(buffer)
            buffer.clear()
        self._times.flush_some()
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
        try:
            self._file = open(self.path, "r+b", buffering=0)
        except OSError as err:
            raise StreamError(f"{self.path}: cannot open the stream to append ({err.strerror}).") from None
        self._lock()  # before reading: a live writer may still be adding frames
        existing = StreamReader(self.path)
        try:
            mine = (header["rank"], header["world_size"])
            theirs = (existing.header["rank"], existing.header["world_size"])
            if mine != theirs:
                raise StreamError(
                    f"{self.path}: cannot append: the stream was recorded by rank {theirs[0]} of world size "
                    f"{theirs[1]}, and this Recorder is rank {mine[0]} of world size {mine[1]}. A run keeps its "
                    "world size and ranks (the reduction order changes with them): record the resumed run into a "
                    "new directory and compare it with --from-step.")
            if existing.digest_version != fingerprint.DIGEST_VERSION:
                raise StreamError(
                    f"{self.path}: cannot append: the stream was recorded with digest version "
                    f"{existing.digest_version}, this samebits computes digest version "
                    f"{fingerprint.DIGEST_VERSION} (steps of both could not be compared). Record the "
                    "resumed run into a new directory, or re-record it from the start."
                )
            last = None
            for block in existing.steps():
                last = block.step
                self._index.append((block.step, block.num_records, block.root, block.offset))
            if existing.stop_reason is not None and existing.stop_reason.startswith("truncated"):
                warnings.warn(f"samebits: appending to {self.path}, which was {existing.stop_reason}; "
                              "the torn frame is dropped.", stacklevel=3)
            names, end_offset, num_segments = list(existing.names), existing.end_offset, existing.num_segments
            run_id, run_id_source = existing.header.get("run_id"), existing.header.get("run_id_source")
        finally:
            existing.close()
        self._last_step = last
        for text in names:
            self._names[text] = len(self._names)
            self._names_hasher.update(fmt.name_bytes(text))
        header["segment"] = num_segments
        header["run_id"] = run_id
        header["run_id_source"] = run_id_source
        self._file.truncate(end_offset)  # drop a torn tail frame, never a complete one
        self._file.seek(end_offset)

    def _lock(self) -> None:
        """Hold an exclusive lock on the stream file while this Recorder writes it, and leave
        a note saying who holds it (read by the writer that is refused)."""
        note = self.path.with_name(f".{self.path.name}.lock")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                warnings.warn(f"samebits: cannot lock {self.path} ({err.strerror}); make sure one process "
                              "writes it.", stacklevel=4)
                return
            self._file.close()
            self._file = None
            try:
                holder = note.read_text().strip()[:200] or "unknown"
            except OSError:
                holder = "unknown"
            raise StreamError(
                f"{self.path} is being written by another Recorder (holder: {holder}): one writer per "
                "stream. Wait for it to close, give this process another rank or directory, or "
                "append once the other writer has finished."
            ) from None
        try:
            note.write_text(f"pid {os.getpid()} on {socket.gethostname()} since "
                            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            self._lock_note = note
        except OSError:
            pass  # the lock holds without the note; only the message is less specific

_open_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


class RecorderHook:
    """A registered Recorder hook; `remove` unregisters it (idempotent)."""

    def __init__(self, remove):
        self._remove = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


STEP_TIMES_SUFFIX = ".steptimes"


class _StepTimes:
    """``rank-NNNNN.steptimes`` beside the stream: when each step's first record came and when
    the step was written (``time.perf_counter`` seconds since this segment started), one
    ``step<TAB>opened<TAB>written`` line per step after a JSON header line per segment.  The
    comparator reads only ``.sbs`` files, so timings never make two runs differ; `samebits
    tax` reads them (docs/stream.md, docs/tax.md).  A file that cannot be written costs a
    warning, never the recording."""

    FLUSH_STEPS = 64  # step times reach the OS at least this often, and at close

    def __init__(self, stream_path: Path, header: dict):
        self.path = stream_path.with_suffix(STEP_TIMES_SUFFIX)
        self._steps: list[tuple[int, float, float]] = []  # (step, opened, written), not yet formatted
        self._origin = time.perf_counter()
        self._lines: list[str] = [json.dumps({"schema": "samebits.step_times/1", "rank": header["rank"],
                                              "segment": header.get("segment", 0), "run_id": header["run_id"],
                                              "clock": "perf_counter seconds since the segment started"}) + "\n"]
        try:
            self._file = open(self.path, "a")
        except OSError as err:
            warnings.warn(f"samebits: cannot write step times to {self.path} ({err.strerror}); recording goes on "
                          "without them (samebits tax needs them).", stacklevel=4)
            self._file = None

    def add(self, step: int, opened: float) -> None:
        self._steps.append((step, opened, time.perf_counter()))

    def flush_some(self) -> None:
        """`flush` every FLUSH_STEPS steps: a step's own write stays one system call."""
        if len(self._steps) >= self.FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        origin = self._origin
        self._lines += [f"{step}\t{opened - origin:.6f}\t{written - origin:.6f}\n" for step, opened, written in self._steps]
        self._steps.clear()
        if self._file is not None and self._lines:
            self._file.write("".join(self._lines))
            self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


@atexit.register
def _close_open_recorders() -> None:  # a script that forgot close() still gets its last step
    for recorder in list(_open_recorders):
        if getattr(recorder, "_pid", None) != os.getpid():
            continue  # a forked child's copy of its parent's recorder: the parent closes it
        try:
            recorder.close()
        except Exception:
            pass


def _check_step(step, rank: int) -> int:
    """Steps are integers in [0, 2**63): refuse anything else at record time."""
    try:
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"step {step!r} on rank {rank} is a {type(step).__name__}; steps are integers "
                          "(count optimizer steps from 0).") from None
    if isinstance(step, bool) or not 0 <= value <= fmt.MAX_STEP:
        raise ConfigError(f"step {step!r} on rank {rank} is outside 0..2**63-1; steps are non-negative "
                          "integers (count optimizer steps from 0).")
    return value


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


RUN_ID_FILE = ".samebits-run-id"  # in a run directory: the id its ranks agreed on (source "directory")
_RUN_ID_KEY = "samebits/run_id"  # in the process group's store: the id its ranks agreed on


def _choose_run_id(run_id, directory: Path) -> tuple[str, str]:
    """(run id, its source): the same for every rank of one run whenever the ranks can agree
    on one (docs/stream.md, "The header"): the argument, ``SAMEBITS_RUN_ID``, the launcher's
    (torchrun's ``TORCHELASTIC_RUN_ID``), the process group's (the first rank to ask sets it in
    the group's store), the run directory's (the first rank to create it writes it there), and
    only then this process's own."""
    if run_id:
        return str(run_id), "argument"
    value = settings.read("SAMEBITS_RUN_ID")
    if value:
        return value, "SAMEBITS_RUN_ID"
    value = _launcher_run_id()
    if value:
        return value, "TORCHELASTIC_RUN_ID"
    fresh = uuid.uuid4().hex
    agreed = _process_group_run_id(fresh)
    if agreed:
        return agreed, "process group"
    agreed = _directory_run_id(directory, fresh)
    if agreed:
        return agreed, "directory"
    return fresh, "random"


def _valid_run_id(value) -> str | None:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    value = value.strip() if isinstance(value, str) else ""
    return value if 0 < len(value) <= 200 and value.isprintable() else None


def _process_group_run_id(fresh: str) -> str | None:
    """The run id of the initialised process group: the first rank to ask stores ``fresh`` in
    the group's store (compare-and-set), every later one reads it.  None without a group."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        return _valid_run_id(store.compare_set(_RUN_ID_KEY, "", fresh))
    except Exception:  # no store, or one without compare-and-set: not agreed this way
        return None


def _directory_run_id(directory: Path, fresh: str) -> str | None:
    """The run id in ``directory``'s `RUN_ID_FILE`, written now (atomically: a hard link of a
    complete file, so the first rank wins and no rank reads half an id) if there is none."""
    target = directory / RUN_ID_FILE
    try:
        return _valid_run_id(target.read_text())
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError):
        return None
    temporary = directory / f"{RUN_ID_FILE}.{os.getpid()}.{fresh[:8]}.tmp"
    try:
        temporary.write_text(fresh + "\n")
        try:
            os.link(temporary, target)
        except FileExistsError:
            pass
        finally:
            temporary.unlink(missing_ok=True)
        return _valid_run_id(target.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _sibling_run_id(directory: Path, rank: int) -> tuple[str, str] | None:
    """(run id, source) of another rank's stream in ``directory`` (the lowest rank), or None:
    a resumed run that starts a stream beside the ones it continues takes their id."""
    for path in sorted(directory.glob("rank-*" + fmt.STREAM_SUFFIX)):
        if path.name == fmt.stream_filename(rank):
            continue
        try:
            reader = StreamReader(path)
        except StreamError:
            continue
        header = reader.header
        reader.close()
        if isinstance(header.get("run_id"), str):
            return header["run_id"], header.get("run_id_source")
    return None


def _samebits_version() -> str:
    try:
        return importlib.metadata.version("samebits")  # not `samebits.__version__`: a layer up
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _determinism_record():
    return active_record()
