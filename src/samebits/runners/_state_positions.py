"""Where a resumed run's training state stands against the run it resumed, step by step.

The census holds digests, not values, so what is exact is which of A's steps holds the same
bits: `state_positions` says, for every census record at every step of B's window, whether B's
state is A's of the same step (restored), of another step (the position it holds), or of none.
`samebits report` draws it.  Records that are no evidence about a checkpoint are left out with
the reason, as verify's findings leave them out (`samebits.runners._explain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from samebits.checkpoint import CensusName, census_run
from samebits.errors import StreamError
from samebits.stream import open_run
from samebits.stream.phases import INPUTS, STATE, STATE_END
from samebits.verdicts import ToDict, serialised


@dataclass
class StateTrack(ToDict):
    """One census record of run b against run a: per step of b's window, the step of a holding
    the same bits (``positions``; None: no step of a), the steps only one run has it, and for a
    generator the steps it moved in each run."""

    dict_keys = ("record", "title", "differs_at", "positions", "only_in", "drawn_a", "drawn_b")

    name: str = field(metadata=serialised(key="record"))
    title: str
    positions: dict[int, int | None] = field(default_factory=dict)
    only_in: dict[int, str] = field(default_factory=dict)  # step -> "a" | "b"
    drawn_a: list[int] = field(default_factory=list)
    drawn_b: list[int] = field(default_factory=list)

    @property
    def differs_at(self) -> list[int]:
        return sorted({s for s, t in self.positions.items() if t != s} | set(self.only_in))

    @property
    def is_generator(self) -> bool:
        return CensusName.parse(self.name).is_generator

    def says(self, label_a: str = "A", label_b: str = "C") -> str:
        """The first step where it differs, in words: whose step b's state is."""
        steps = self.differs_at
        if not steps:
            return f"{label_b}'s {self.title} is {label_a}'s at every compared step"
        step = steps[0]
        if step in self.only_in:
            return f"step {step}: only {label_a if self.only_in[step] == 'a' else label_b} has a {self.title}"
        held = self.positions[step]
        if held is None:
            return f"step {step}: {label_b}'s {self.title} matches no step of {label_a}"
        gap = step - held
        how = f"{abs(gap)} step{'s' if abs(gap) != 1 else ''} {'behind' if gap > 0 else 'ahead'}"
        return f"step {step}: {label_b} holds {label_a}'s {self.title} of step {held} ({how})"

    def dict_extras(self) -> dict:
        return {"differs_at": self.differs_at}


@dataclass
class StatePicture(ToDict):
    """What the census says of b against a on one rank: the records that differ (``tracks``,
    earliest first), the titles of those equal throughout, those left out with why, and the
    steps of a whose census was read (the picture's vertical axis)."""

    tracks: list[StateTrack] = field(metadata=serialised(key="differ"))
    same: list[str]
    left_out: list[tuple[str, str]] = field(metadata=serialised(
        convert=lambda left: [{"title": title, "why": why} for title, why in left]))
    steps_a: list[int] = field(metadata=serialised(skip=True))
    window: list[int] = field(metadata=serialised(skip=True))  # b's census steps compared


def state_title(name: str) -> str:
    """What a person calls census record ``name`` (the step's inputs, taken as one record, too)."""
    return "input batch (data position)" if name == INPUTS else CensusName.parse(name).title()


_Signature = tuple  # a record's bits: (dtype, shape, flags, digest, raw), equal only when the state is


def _read(directory: Path, rank: int) -> dict[int, dict[str, dict[str, _Signature]]] | None:
    """Run ``directory``'s census of ``rank``: step -> {"state": {name: bits}, "state_end": ...,
    with the step's inputs as one record}; None when it has none."""
    where = census_run(directory)
    if where is None or where == Path(directory):  # no census stream (a run recorded before 2026-12)
        return None
    try:
        run = open_run(where)
    except (StreamError, OSError):
        return None
    if rank not in run.files:
        return None
    steps: dict[int, dict[str, dict[str, _Signature]]] = {}
    try:
        for block in run.steps(rank):
            state, end, inputs = {}, {}, []
            for record in block.records():
                name = record.name if record.occurrence == 0 else f"{record.name}#{record.occurrence}"
                bits = (record.dtype, tuple(record.shape or ()), record.flags, record.digest, record.raw)
                if record.phase == STATE:
                    state[name] = bits
                elif record.phase == STATE_END:
                    end[name] = bits
                elif record.phase == INPUTS:
                    inputs.append((name, bits))
            if inputs:
                state[INPUTS] = tuple(sorted(inputs))
            steps[block.step] = {STATE: state, STATE_END: end}
    except StreamError:
        return None
    return steps


def _moved(census: dict, name: str) -> list[int]:
    """The steps in which generator ``name`` moved: from the step's first forward to the end of
    its optimizer step, or since the step before ended (a batch drawn before the forward)."""
    moved = []
    for step in sorted(census):
        start, end = census[step][STATE].get(name), census[step][STATE_END].get(name)
        before = census.get(step - 1, {}).get(STATE_END, {}).get(name)
        if start is not None and ((end is not None and end != start) or (before is not None and before != start)):
            moved.append(step)
    return moved


def state_positions(dir_a: str | Path, dir_b: str | Path, rank: int, start: int,
                    independent: str | Path | None = None) -> StatePicture | None:
    """Run b's census against run a's on ``rank`` from step ``start`` on; None when either has no
    census there.  ``independent``: a's independent twin (verify's B), whose differences are left out."""
    census_a, census_b = _read(Path(dir_a), rank), _read(Path(dir_b), rank)
    if not census_a or not census_b:
        return None
    twin = _read(Path(independent), rank) if independent is not None else None
    window = [s for s in sorted(census_b) if s >= start]
    if not window:  # b's census holds no compared step: nothing is known, nothing is "the same"
        return None
    names: list[str] = []
    for census in (census_a, census_b):
        for step in sorted(census):
            names.extend(n for n in census[step][STATE] if n not in names)
    tracks, same, left_out = [], [], []
    for name in names:
        track = StateTrack(name, state_title(name))
        held_at: dict[_Signature, list[int]] = {}
        for step in sorted(census_a):
            bits = census_a[step][STATE].get(name)
            if bits is not None:
                held_at.setdefault(bits, []).append(step)
        for step in window:
            mine = census_b[step][STATE].get(name)
            theirs = census_a.get(step, {}).get(STATE, {}).get(name)
            if mine is None and theirs is None:
                continue
            if mine is None or (theirs is None and step in census_a):
                track.only_in[step] = "a" if mine is None else "b"
            elif mine == theirs:
                track.positions[step] = step
            else:  # the nearest step of a holding b's bits (the earlier on a tie), or none
                found = held_at.get(mine, [])
                track.positions[step] = min(found, key=lambda s: (abs(s - step), s)) if found else None
        if not track.differs_at:
            same.append(track.title)
            continue
        if twin is not None and any(twin.get(s, {}).get(STATE, {}).get(name) !=
                                    census_a.get(s, {}).get(STATE, {}).get(name)
                                    for s in window if s in twin and s in census_a):
            left_out.append((track.title, "differs between the independent runs A and B too: not about the "
                                          "checkpoint"))
            continue
        if track.is_generator:
            track.drawn_a = [s for s in _moved(census_a, name) if s >= start]
            track.drawn_b = [s for s in _moved(census_b, name) if s >= start]
            known = any(census[s][STATE_END] for census in (census_a, census_b) for s in census)
            if known and not track.drawn_a and not track.drawn_b:
                left_out.append((track.title, "drawn in no compared step of either run: its state explains "
                                              "nothing"))
                continue
        tracks.append(track)
    tracks.sort(key=lambda t: t.differs_at[0])  # stable: the census order within a step
    return StatePicture(tracks, same, left_out, sorted(census_a), window)


__all__ = ["StatePicture", "StateTrack", "state_positions", "state_title"]
