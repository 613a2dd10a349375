"""The census as verify's explanation reads it: `Finding`, one run's census records per rank
and step (`Census`), and the facts about generators the findings rest on (did one move in a
step, before its first forward, was it made there).  The findings themselves are made by
`samebits.runners._resume_rules` (a resumed run) and `samebits.runners._explain` (independent runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from samebits.autorecord import EVENTS_FILE, NOTES_FILE
from samebits.checkpoint import CensusName, census_run
from samebits.errors import StreamError
from samebits.stream import open_run
from samebits.stream.phases import STATE, STATE_END
from samebits.verdicts import ToDict


@dataclass
class Finding(ToDict):
    """One claim about why two runs differ, with the record it rests on."""

    check: str  # "resume" | "independent"
    kind: str
    step: int
    rank: int
    says: str
    record: str | None = None
    site: str | None = None  # file.py:N, when the claim has a place
    generator: str | None = None  # kind generator/generator_consumed: torch_cpu, python, numpy, user:<site>


class Census:
    """One run's census records per (rank, step): {phase: {name: Record}} (occurrences of a
    name joined as name#k), and the events of its global generators."""

    def __init__(self, path: Path, phases: tuple[str, ...] | None, first: int, last: int):
        self.path = path
        self.events: dict[int, list[dict]] = {}
        self.steps: dict[tuple[int, int], dict[str, dict]] = {}
        run = open_run(path)
        self.ranks = list(run.ranks)
        for rank in run.ranks:
            for block in run.steps(rank):
                if block.step < first:
                    continue
                if block.step > last:
                    break
                phases_of: dict[str, dict] = {}
                for record in block.records():
                    if phases is not None and record.phase not in phases:
                        continue
                    name = record.name if record.occurrence == 0 else f"{record.name}#{record.occurrence}"
                    phases_of.setdefault(record.phase, {})[name] = record
                self.steps[(rank, block.step)] = phases_of

    def get(self, rank: int, step: int, phase: str) -> dict:
        return self.steps.get((rank, step), {}).get(phase, {})

    def events_of(self, rank: int) -> list[dict]:
        """The rank's log of restores, seeds and draws of the global generators (read once)."""
        if rank not in self.events:
            self.events[rank] = read_jsonl(self.path / EVENTS_FILE.format(rank=rank))
        return self.events[rank]


def read_census(directory: Path, first: int, last: int) -> Census | None:
    """The census of a run (`census_run`: its census stream, every phase of it; in a run
    recorded before 2026-12 by the recipe, its main stream's ``state`` phase); None when there
    is none."""
    where = census_run(directory)
    try:
        if where is not None:
            return Census(where, None if where != Path(directory) else (STATE,), first, last)
    except StreamError:
        return None
    return None


def differing_names(a: dict, b: dict) -> list[str]:
    return [name for name in a if name in b and not same_bits(a[name], b[name])]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.digest == b.digest and a.raw == b.raw


def moved_in_step(census: Census, rank: int, step: int, name: str) -> bool | None:
    """Did generator record ``name`` move between ``step``'s first forward (``state``) and the end
    of its optimizer step (``state_end``)?  None: not known (no ``state_end``, e.g. the recipe's)."""
    start, end = census.get(rank, step, STATE), census.get(rank, step, STATE_END)
    if name not in start or name not in end:
        return None
    return not same_bits(start[name], end[name])


def moved_before(census: Census, rank: int, step: int, name: str) -> bool | None:
    """Did generator record ``name`` move between the end of the step before (in the same
    process) and this step's first forward, where a loop draws the step's batch?  None: not
    known (the process's first step: nothing recorded before it)."""
    previous, start = census.get(rank, step - 1, STATE_END), census.get(rank, step, STATE)
    if name not in previous or name not in start:
        return None
    return not same_bits(previous[name], start[name])


def made_before(census: Census, rank: int, step: int, name: str) -> bool:
    """Was generator ``name`` made between the end of the step before (in the same process:
    its census has that step, without the generator) and this step's first forward (a
    dataset's reshuffle makes one there, draws the epoch's order and drops it)?"""
    previous = census.get(rank, step - 1, STATE_END)
    return bool(previous) and name not in previous and name in census.get(rank, step, STATE)


def batch_source(census: Census, rank: int, step: int, name: str) -> bool:
    """Could generator ``name`` have drawn the step's batch: it moved before the step's first
    forward, or, in the process's first step, it is one the program made (the global
    generators move before any step anyway, for the model's initialisation)."""
    before = moved_before(census, rank, step, name)
    return before is True or (before is None and CensusName.parse(name).kind == CensusName.USER_RNG)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    try:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict):
                out.append(item)
    except OSError:
        return []
    return out


def script_notes(directory: Path) -> list[dict]:
    """What samebits' callbacks said in a run (``notes-rank-*.jsonl``), every rank."""
    notes = []
    if directory.is_dir():
        for path in sorted(directory.glob(NOTES_FILE.replace("{rank:05d}", "*"))):
            notes += read_jsonl(path)
    return notes


def why_drawn(used: tuple[bool | None, ...], step: int, census_a: Census, census_other: Census, rank: int,
               name: str, batch_differs: bool) -> str:
    """Why a generator that differs explains ``step`` (the words of its finding), or "" when
    it does not: it moved during the step in one of the runs; or, when the step's batch
    differs, it moved before the step's first forward, where the batch is drawn."""
    if True in used:
        return f"and step {step} draws from it"
    if all(u is None for u in used):
        return f"whether step {step} draws from it is not recorded"
    if batch_differs and any(moved_before(census, rank, step, name) for census in (census_a, census_other)):
        return (f"it was drawn from before step {step}'s first forward, where the step's batch comes from, "
                "and the batch differs")
    if batch_differs and any(made_before(census, rank, step, name) for census in (census_a, census_other)):
        return (f"made after step {step - 1} ended and before step {step}'s first forward, where the step's batch "
                "comes from, and the batch differs")
    if batch_differs and any(batch_source(census, rank, step, name) for census in (census_a, census_other)):
        return (f"the program's own generator, not drawn from during step {step}; the step's batch differs, and "
                "whether the batch was drawn from it before the step's first forward is not recorded (a process's "
                "first step)")
    return ""
