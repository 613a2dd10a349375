"""What one open step of a traced rank knows (`StepState`) and its module stack (`Frame`s):
made by `Tracer.begin_step`, dropped by `Tracer.finish_step`, changed only through its methods.
"""

from __future__ import annotations

import weakref

import torch

from samebits._torchutil import AutogradScopes
from samebits.trace._config import PRE_PHASE
from samebits.trace._tensors import geometry, version_of


class Frame:
    """One module call on the module stack of a step."""

    __slots__ = ("fqn", "count", "phase", "recorded", "is_root", "forward_n")

    def __init__(self, fqn: str, count: int, phase: str, recorded: bool, is_root: bool):
        self.fqn, self.count, self.phase, self.recorded, self.is_root = fqn, count, phase, recorded, is_root
        self.forward_n: int | None = None  # a top-level forward: its number (forward/<root>:n)


class StepState:
    """What the open step of a traced rank knows; made fresh for each step.  ``level`` is the
    rung in force (0: not selected), ``special`` the perturb/dump specs for this rank and step;
    event numbers, seen tensors, the module stack and call sites change only through methods."""

    __slots__ = ("step", "level", "special", "ops_needed", "stage", "scope", "frames", "autograd",
                 "call_sites", "_numbers", "_seen")

    def __init__(self, step: int, level: int, special: list, ops_needed: bool):
        self.step, self.level, self.special, self.ops_needed = step, level, special, ops_needed
        self.stage = PRE_PHASE  # until the step's first forward, backward or optimizer step
        self.scope = ""
        self.frames: list[Frame] = []
        self.autograd = AutogradScopes()  # backward op -> (scope, call site) of the forward op
        self.call_sites: dict[str, str] = {}  # "phase|event id" -> call site
        self._numbers: dict[tuple, int] = {}
        self._seen: dict[int, tuple] = {}

    def next_number(self, kind: str, key) -> int:
        """The next occurrence number of ``key`` among events of ``kind`` in this step."""
        full = (kind, key)
        n = self._numbers.get(full, 0)
        self._numbers[full] = n + 1
        return n

    def peek_number(self, kind: str, key) -> int:
        return self._numbers.get((kind, key), 0)

    def enter_stage(self, stage: str) -> None:
        if self.stage == PRE_PHASE and stage != PRE_PHASE:
            # What the step's "pre" work made (the previous iteration's logging, a resumed
            # process's start-up) is recorded again where it is first used after it, so that
            # the phases after "pre" can be compared on their own (a resume bisect drops "pre").
            self._seen.clear()
        self.stage = stage

    def push(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.scope = frame.fqn

    def pop(self) -> Frame | None:
        if not self.frames:
            return None
        frame = self.frames.pop()
        self.scope = self.frames[-1].fqn if self.frames else ""
        return frame

    def recomputing(self) -> bool:
        return any(f.phase == "recompute" for f in self.frames)

    def note_call_site(self, phase: str, event_id: str, site: str | None) -> None:
        if site is not None:
            self.call_sites[f"{phase}|{event_id}"] = site

    # each tensor version is recorded once per step
    # (entries: id -> (version, weakref, source, weakref of the tensor a view follows, or None))
    def is_seen(self, t: torch.Tensor) -> bool:
        entry = self._seen.get(id(t))
        if entry is not None and entry[1]() is t:
            viewed = entry[3]() if entry[3] is not None else None
            if viewed is not None:  # a view output: seen while what it views is
                return self.is_seen(viewed)
            # (what it viewed is gone, e.g. a gradient `detach`ed into .grad: by then the view
            # shares its version counter, so the version it had is the view's)
            return entry[0] is not None and entry[0] == version_of(t)
        base = t._base  # a view of a recorded base holds recorded bytes
        return base is not None and self.is_seen(base)

    def source_of(self, t: torch.Tensor) -> str | None:
        """Where the recorded bytes of ``t`` (at its current version) were first seen in this
        step: ``phase|record name`` (a view: its base's, with its offset, sizes and strides).
        Names do not depend on arrival order, so two runs that give an op the same tensors
        give it the same sources, in the same order or not."""
        entry = self._seen.get(id(t))
        if entry is not None and entry[1]() is t:
            return entry[2] if self.is_seen(t) else None
        source = self.source_of(t._base) if t._base is not None else None
        return None if source is None else source + geometry(t)

    def mark_seen(self, t: torch.Tensor, source: str | None = None) -> None:
        version = version_of(t)
        if version is None:
            return
        entry = self._seen.get(id(t))
        if entry is not None and entry[1]() is t and (entry[0] == version or (entry[3] is not None and self.is_seen(t))):
            return  # already seen at this version: it keeps its first source
        self._seen[id(t)] = (version, weakref.ref(t), source, None)

    def mark_view(self, t: torch.Tensor, viewed: torch.Tensor, source: str | None) -> None:
        """``t`` is a view op's output of the seen tensor ``viewed``: seen while ``viewed`` is (in
        the dispatch mode its own version counter says nothing yet)."""
        if version_of(t) is None:
            return
        self._seen[id(t)] = (version_of(viewed), weakref.ref(t), source, weakref.ref(viewed))

    def mark_all_seen(self, pairs, prefix: str = "") -> None:
        """Mark each (label, tensor) seen; its source is ``prefix + label``."""
        for label, t in pairs:
            self.mark_seen(t, prefix + str(label))

    def unseen(self, pairs) -> list:
        return [(label, t) for label, t in pairs if not self.is_seen(t)]
