"""`Recorder`: writes one rank's fingerprint stream, ``DIR/rank-NNNNN.sbs`` (docs/stream.md).

The API of recording: records become bytes in `_encoder`, files (stream, lock, step times,
run id) are `_files`.
"""

from __future__ import annotations

import atexit
import dataclasses
import operator
import os
import weakref
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from samebits import fingerprint
from samebits.errors import ConfigError, StreamError
from samebits.fingerprint import all_unsharded, local_part
from samebits.settings import RecordingSpec
from samebits.stream import _format as fmt
from samebits.stream._encoder import PendingStep, StepEncoder, index_frames
from samebits.stream._files import (RUN_ID_FILE, STEP_TIMES_SUFFIX, StepTimes, StreamFile, choose_run_id,
                                    sibling_run_id, stream_header)
from samebits.stream.phases import AFTER_OPTIMIZER_STEP, GLOBAL_PHASE_PREFIX, METRICS, optimizer_phase
from samebits.stream.reader import open_run
from samebits.stream._recorder_settings import RecorderSettings

__all__ = ["Recorder", "RecorderHook", "RecordingSpec", "GLOBAL_PHASE_PREFIX", "STEP_TIMES_SUFFIX", "RUN_ID_FILE"]


class Recorder:
    """Record per-step metrics and tensor digests of one rank into ``DIR/rank-NNNNN.sbs``.

    >>> rec = Recorder("runs/a", rank=0, world_size=1, config={"lr": 1e-3})
    >>> rec.metrics(0, loss=2.5)
    >>> rec.tensors(0, "params", model.named_parameters())
    >>> rec.close()

    Settings: arguments, then the ``SAMEBITS_*`` variables, then defaults (docs/stream.md,
    "Settings"; ``spec`` is a `RecordingSpec`).  A disabled or filtered-out recorder costs one
    attribute check.  ``reference``: an earlier run; `end_step` then says whether this step's
    root matches it.  ``append``: continue an existing stream, which is otherwise never
    overwritten.  One writer per stream: a second Recorder on it gets a `StreamError`.
    """

    _times: StepTimes | None = None  # the step-times side file, once the stream is open

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        spec: RecordingSpec | None = None,
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
        self.settings = s = RecorderSettings.resolve(
            directory=directory, rank=rank, world_size=world_size, flush_every=flush_every, enabled=enabled,
            spec=spec, steps=steps, ranks=ranks, phases=phases, include=include, exclude=exclude,
            max_tensor_bytes=max_tensor_bytes)
        self.rank, self.world_size = s.rank, s.world_size
        self.active = s.enabled and s.rank_selected
        self._stream: StreamFile | None = None
        self._encoder = StepEncoder(s)
        self._pending: PendingStep | None = None
        self._last_step: int | None = None
        self._index: list[tuple[int, int, int, int]] = []  # (step, records, root, frame offset)
        self._steps_since_flush = 0
        self._reference = None
        self._closed = False
        self._end_step_hooks: list[tuple] = []  # (before, after) callbacks: `on_end_step`
        self._own_work = None  # `around_own_work`: a context for the recorder's own torch work
        if not self.active:
            return
        s.directory.mkdir(parents=True, exist_ok=True)
        self.path = s.directory / fmt.stream_filename(s.rank)
        self._pid = os.getpid()  # the owning process: a forked child never writes this stream
        header = stream_header(s, coords, config)
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
        if append and self.path.exists():  # a continued stream keeps its own run id
            self._stream, held = StreamFile.append(self.path, s.rank, s.world_size)
            self._index, self._last_step = held.index, held.last_step
            self._encoder.adopt_names(held.names)
            header = dataclasses.replace(header, segment=held.segment, run_id=held.run_id,
                                         run_id_source=held.run_id_source)
        else:
            # A new stream of a resumed run takes the id of the run's other streams: it stays one run.
            chosen, source = \
                (sibling_run_id(s.directory, s.rank) if append else None) or choose_run_id(run_id, s.directory)
            self._stream = StreamFile.create(self.path)
            header = dataclasses.replace(header, run_id=chosen, run_id_source=source, segment=0)
        self._times = StepTimes(self.path, header)  # wall time per step, beside the stream: never compared
        self._stream.buffer += fmt.frame(fmt.FRAME_HEADER, header.payload())
        self._flush()
        _open_recorders.add(self)

    # -- recording --------------------------------------------------------------------

    def wants(self, step: int, phase: str) -> bool:
        """Whether `tensors`/`metrics` of ``phase`` at ``step`` would write anything (name
        filters apply later, per tensor), so a caller can skip building dropped records.
        `global_tensors` is collective: call it on every rank whatever this says."""
        return self.active and self.settings.selected(step, phase)

    def tensors(self, step: int, phase: str, named_tensors) -> None:
        """Record ``(name, tensor)`` pairs (or a mapping) under ``phase`` at ``step``: ``None`` as
        absent, tensors over the size cap without a digest.  Digests are fetched at step end."""
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
        return self._encoder.add_tensors(self._step(step), step, phase, named_tensors)

    def global_tensors(self, step: int, phase: str, named_tensors, group=None) -> None:
        """Record the digests of the *full* tensors behind sharded ones under ``global:<phase>``
        (docs/digest.md).  Collective: ranks this recorder leaves out call it too, and write
        nothing.  No size cap; ``None`` is absent."""
        self._collective_call(self._global_tensors, step, phase, named_tensors, group, None)

    def tensors_and_global(self, step: int, phase: str, named_tensors, group=None) -> None:
        """`tensors` of each tensor's local part, then `global_tensors`: the same records as those
        two calls, for less (an unsharded tensor is digested once for both).  Collective."""
        self._collective_call(self._tensors_and_global, step, phase, named_tensors, group)

    def _collective_call(self, method, step, phase: str, named_tensors, *args) -> None:
        """``method(step, phase, [(str name, tensor or None)], *args)`` inside the own-work hook,
        unless the recorder is off or does not record this step or phase (alike on every rank)."""
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
        plan, pending = self._encoder.plan_used, self._pending
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
        """``slots``: per tensor, where this step holds its local part's digest (from `_tensors`
        in this call), or None.  Returns `StepEncoder.add_global`'s answer (None: not recorded)."""
        if self.active:
            self._encoder.check_text(phase, "phase", step)
        present = [(name, tensor) for name, tensor in named if tensor is not None]
        present_slots = known = None
        if slots is not None:
            present_slots = [slot for slot, (_, tensor) in zip(slots, named) if tensor is not None]
            known = [slot is not None for slot in present_slots]
        _, result = fingerprint.global_body_sums(present, group=group, known=known)
        if result.sums.device.type == "cpu" and not bool(result.consistent):  # free on CPU; on a GPU a sync
            raise ConfigError(f"Recorder.global_tensors(step={step}, phase={phase!r}) on rank {self.rank}: the "
                              "ranks of a shard group passed different tensors (names, dtypes or global shapes); "
                              "every rank must pass the same names in the same order.")
        if not self.active:
            return None
        return self._encoder.add_global(self._step(step), step, phase, named, result, present_slots)

    def optimizer_step(self, step: int, *, grads=None, params=None, optimizer=None, number: int | None = None,
                       whole: Collection[str] = (), group=None) -> None:
        """The records after an optimizer step, in `phases.AFTER_OPTIMIZER_STEP` order (None: no
        records); ``number``: `phases.optimizer_phase`; phases in ``whole`` get global records too."""
        for phase, named in zip(AFTER_OPTIMIZER_STEP, (grads, params, optimizer)):
            if named is None:
                continue
            if phase in whole:
                self.tensors_and_global(step, optimizer_phase(phase, number), named, group)
            else:
                self.tensors(step, optimizer_phase(phase, number), named)

    def metrics(self, step: int, phase: str = METRICS, **values) -> None:
        """Record scalars with their exact bits: floats as float64, ints as int64, 0-dim tensors
        in their own dtype."""
        if not self.active:
            return
        if self._own_work is None:
            return self._metrics(step, phase, values)
        with self._own_work():
            self._metrics(step, phase, values)

    def _metrics(self, step: int, phase: str, values: dict) -> None:
        if step.__class__ is not int or not 0 <= step <= fmt.MAX_STEP:
            step = _check_step(step, self.rank)
        if not self.settings.selected(step, phase):
            return
        self._encoder.add_metrics(self._step(step), step, phase, values)

    def end_step(self, step: int | None = None) -> bool | None:
        """Finish the open step (optional: a later step or `close` does too) and check it against
        the reference: False on a differing root, True when equal, None without one.  Hooks
        of `on_end_step` run around it, also when it writes nothing."""
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
        """Call ``before(step)`` just before `end_step` writes (its records join that step) and
        ``after(step)`` just after (it may end the process).  ``.remove()`` the handle."""
        entry = (before, after)
        self._end_step_hooks.append(entry)
        return RecorderHook(lambda: self._end_step_hooks.remove(entry) if entry in self._end_step_hooks else None)

    def around_own_work(self, context) -> "RecorderHook":
        """Run `tensors` and `metrics` inside ``context()`` (e.g. a tracer's ``suspended``, so
        the recorder's own ops are never traced).  ``.remove()`` restores the previous one."""
        previous, self._own_work = self._own_work, context

        def remove() -> None:
            if self._own_work is context:
                self._own_work = previous

        return RecorderHook(remove)

    def close(self) -> None:
        """End the open step, write the closing frames and flush.  Idempotent; a no-op in a forked
        child (the stream is the parent's, and the child's exit runs this)."""
        if self._closed or not self.active:
            self._closed = True
            return
        if os.getpid() != self._pid:
            return
        if self._pending is not None:
            self.end_step()
        self._flush()
        self._stream.buffer += index_frames(self._index, self._stream.tell())
        self._flush()
        self._stream.release()
        self._times.close()
        self._closed = True
        _open_recorders.discard(self)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _step(self, step: int) -> PendingStep:
        """The open step, opened now (ending the one before) if ``step`` is a new one."""
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
        self._pending = PendingStep(step)
        return self._pending

    def _write_step(self, pending: PendingStep) -> tuple[int, int]:
        """Encodes the step into the stream's buffer; flushes every ``flush_every`` steps."""
        names_frame, frame, root = self._encoder.encode_step(pending)
        stream = self._stream
        buffer = stream.buffer
        if names_frame:
            buffer += names_frame
        self._index.append((pending.step, len(pending.records), root, stream.written + len(buffer)))  # its offset
        buffer += frame
        self._last_step = pending.step
        self._times.add(pending.step, pending.opened)
        self._steps_since_flush += 1
        if self._steps_since_flush >= self.settings.flush_every:
            self._flush()
        return root, len(pending.records)

    def _flush(self) -> None:
        """Hands the buffered frames to the OS (one write; they survive a SIGKILL of this process)."""
        self._stream.flush()
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


_open_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


class RecorderHook:
    """A registered Recorder hook; `remove` unregisters it (idempotent)."""

    def __init__(self, remove):
        self._remove = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


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
