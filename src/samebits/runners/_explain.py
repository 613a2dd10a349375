"""What differs between two runs' training state when they diverge: verify's findings.

Differences between the runs' state census records (`_census_facts` reads them) become
`Finding`s, each a claim with its evidence, most specific first; a resumed run's are made by
`_resume_rules` (one small rule per kind, in order).  The kinds and the rules that keep a
finding honest (a generator only if it moved in the step, state that also differs A to B left
out of a resume, a batch looked up among all of A's) are docs/resume.md's table.
"""

from __future__ import annotations

from pathlib import Path

from samebits.checkpoint import CENSUS_DIR, CensusName
from samebits.errors import StreamError
from samebits.runners._census_facts import (Census, Finding, batch_source, differing_names, moved_in_step, read_census,
                                         script_notes, why_drawn)
from samebits.runners._resume_rules import ordered, resume_step
from samebits.stream import open_run
from samebits.stream.phases import AFTER_OPTIMIZER_STEP, INPUTS, PARAMS, RESTORED_PARAMS, STATE, split_optimizer_phase
from samebits.stream.phases import OPTIMIZER as OPTIMIZER_PHASE


# --- resume ------------------------------------------------------------------------------


def explain_resume(dir_a: Path, dir_b: Path | None, dir_c: Path, resume_at: int, diverged_at: int) -> list[Finding]:
    """Findings for a resumed run C that differs from A from ``diverged_at`` on: the first step
    in ``resume_at..diverged_at`` (per rank) whose state differs, what differs there."""
    last = diverged_at + 1
    census_a = read_census(dir_a, 0, last)  # from step 0: which earlier step C's LR or batch matches
    census_c = read_census(dir_c, max(0, resume_at - 1), last)
    findings: list[Finding] = []
    for note in script_notes(dir_c):
        findings.append(Finding("resume", "script_said", int(note.get("step", resume_at) or resume_at),
                                int(note.get("rank", 0) or 0), f"{note.get('owner', 'samebits')} said: "
                                f"{note.get('message', '')}"))
    if census_a is None or census_c is None:
        return findings
    census_b = read_census(dir_b, max(0, resume_at - 1), last) if dir_b is not None and dir_b.exists() else None
    main_a = _main_records(dir_a, resume_at - 1) if (dir_c / CENSUS_DIR).is_dir() else {}
    for rank in census_a.ranks:
        for step in range(resume_at, diverged_at + 1):
            found = resume_step(census_a, census_b, census_c, main_a, rank, step, resume_at)
            if found:
                findings += found
                break
    findings += _trained_past(dir_a, dir_c, resume_at)
    return findings


def _last_steps(directory: Path) -> dict[int, int]:
    """The last step each rank of a run recorded in its main stream."""
    last: dict[int, int] = {}
    try:
        run = open_run(directory)
        for rank in run.ranks:
            for block in run.steps(rank):
                last[rank] = block.step
    except StreamError:
        return last
    return last


def _trained_past(dir_a: Path, dir_c: Path, resume_at: int) -> list[Finding]:
    """A resumed run that records steps past the end of the run it resumes: its step counter was not restored."""
    last_a, last_c = _last_steps(dir_a), _last_steps(dir_c)
    findings = []
    for rank, end_a in sorted(last_a.items()):
        end_c = last_c.get(rank)
        if end_c is None or end_c <= end_a:
            continue
        ran = end_c - resume_at + 1
        again = (f": it ran {ran} steps from step {resume_at}, A's whole length again, as a counter that starts "
                 "from 0 does" if ran == end_a + 1 else "")
        findings.append(Finding(
            "resume", "iteration_counter", end_a + 1, rank,
            f"C trains past A's end: A's last step is {end_a}, C goes on to step {end_c}{again}. The step counter "
            "was not restored from the checkpoint (a loop's iteration counter, the Trainer's global step, "
            "torchtitan's train_state): restore it with the rest of the checkpoint", "steps"))
    return findings


def _main_records(directory: Path, step: int) -> dict[int, dict[str, dict]]:
    """A's main-stream params and optimizer records of ``step``, per rank."""
    try:
        run = open_run(directory)
    except StreamError:
        return {}
    out: dict[int, dict[str, dict]] = {}
    for rank in run.ranks:
        try:
            for block in run.steps(rank):
                if block.step > step:
                    break
                if block.step == step:
                    phases: dict[str, dict] = {}
                    for record in block.records():
                        if record.phase in (PARAMS, OPTIMIZER_PHASE) and record.occurrence == 0:
                            phases.setdefault(record.phase, {})[record.name] = record
                    out[rank] = phases
        except StreamError:
            continue
    return out


# --- for bisect --------------------------------------------------------------------------


def census_suspects(names: list[str], dir_a: Path, dir_b: Path, rank: int,
                    step: int) -> tuple[list[str], list[str]]:
    """(suspects, unused) among the census records that differ at ``step``'s start on ``rank``:
    ``names`` (a trace's) and every census record that differs there; ``unused``: generators
    neither run drew from in the step or before its first forward (one whose use is not known
    stays a suspect)."""
    censuses = [read_census(directory, max(0, step - 1), step) for directory in (dir_a, dir_b)]
    if any(census is None for census in censuses):
        return list(names), []
    state_a, state_b = (census.get(rank, step, STATE) for census in censuses)
    names = list(names) + [name for name in differing_names(state_a, state_b) if name not in names]
    unused = [name for name in names if CensusName.parse(name).is_generator
              and all(moved_in_step(census, rank, step, name) is False and not batch_source(census, rank, step, name)
                      for census in censuses)]
    return [name for name in names if name not in unused], unused


def census_names(directory: Path, rank: int, step: int) -> set[str] | None:
    """Every record name of a run's census at ``step``'s start on ``rank`` (what the program has),
    None when it has no census there."""
    census = read_census(directory, step, step)
    if census is None:
        return None
    names = census.get(rank, step, STATE)
    return set(names) if names else None


# --- independent runs --------------------------------------------------------------------


def explain_independent(dir_a: Path, dir_b: Path, diverged_at: int, order: str | None = None,
                        order_phase: str | None = None, order_rank: int = 0) -> list[Finding]:
    """Findings for two independent runs that differ from ``diverged_at`` on: generators the step
    draws from in other states, the input batch, and ``order`` (a divergence of equal records in
    another order, in ``order_phase`` on ``order_rank``: `order_says`)."""
    census_a = read_census(dir_a, 0, diverged_at + 1)
    census_b = read_census(dir_b, 0, diverged_at + 1)
    findings: list[Finding] = []
    if order:
        findings.append(Finding("independent", "order", diverged_at, order_rank,
                                order_says(order, order_phase, dir_a, diverged_at, order_rank)))
    if census_a is None or census_b is None:
        return findings
    for rank in census_a.ranks:
        initial = _initial_params(census_a, census_b, rank)
        if initial is not None:
            findings.append(initial)
        for step in range(0, diverged_at + 1):
            state_a, state_b = census_a.get(rank, step, STATE), census_b.get(rank, step, STATE)
            changed = differing_names(census_a.get(rank, step, INPUTS), census_b.get(rank, step, INPUTS))
            found = []
            for name in differing_names(state_a, state_b):
                if not CensusName.parse(name).is_generator:
                    continue
                used = (moved_in_step(census_a, rank, step, name), moved_in_step(census_b, rank, step, name))
                why = why_drawn(used, step, census_a, census_b, rank, name, bool(changed))
                if not why:
                    continue
                ident, label = CensusName.parse(name).generator()
                found.append(Finding("independent", "generator", step, rank,
                                     f"{label} is in another state in B than in A at the start of step {step} "
                                     f"({why}): it is seeded from something that changes between runs (the time, "
                                     f"a process id, os.urandom); seed it with a constant [census record {name}]",
                                     name, site=ident.removeprefix("user:") if ident.startswith("user:") else None,
                                     generator=ident))
            if changed and not found:
                found.append(Finding("independent", "input_batch", step, rank,
                                     f"the input batch of step {step} differs between A and B ({changed[0]}) while "
                                     "no generator drawn from in the step, or before its first forward, differs: "
                                     "the data pipeline draws from an unseeded source (a worker's generator, a "
                                     "time seed); `samebits bisect` narrows it", f"inputs:{changed[0]}"))
            if found:
                findings += found
                break
    return findings


def _zero_code(directory: Path) -> bool:
    """Was the run recorded by zero-code recording (its stream's environment says so)?"""
    try:
        run = open_run(directory)
        env = run.headers[run.ranks[0]].environment.get("env") or {}
    except (StreamError, IndexError, OSError, AttributeError):
        return False
    return env.get("SAMEBITS_AUTORECORD") == "1"


def order_says(detail: str, phase: str | None, dir_a: Path, step: int, rank: int) -> str:
    """A divergence of the same records in another order, said with whose order it is: zero-code
    recording writes the after-step phases in the optimizer's parameter order."""
    said = detail.removeprefix(f"step {step}, rank {rank}, ")  # the finding carries its step and rank
    plain, number = split_optimizer_phase(phase or "")
    if plain not in AFTER_OPTIMIZER_STEP or not _zero_code(dir_a):
        return said
    owner = f"optimizer {number}" if number is not None else "the optimizer"
    return (f"{said}. This is {owner}'s parameter order (the gradients, parameters and optimizer state are recorded in the order the "
            "optimizer holds its parameters): its param groups were built in another order in each run, from "
            "something iterated in an order that changes between runs (a Python set, whose order changes with "
            "PYTHONHASHSEED, or a dict keyed by ids); build them from a list in a fixed order, e.g. "
            "model.named_parameters(). Nothing differs in value yet; a sum over them (a gradient norm, a "
            "flattened buffer) would")


def _initial_params(census_a: Census, census_b: Census, rank: int) -> Finding | None:
    """The parameters as step 0 begins (``restored.params``) that differ between independent runs."""
    params_a, params_b = census_a.get(rank, 0, RESTORED_PARAMS), census_b.get(rank, 0, RESTORED_PARAMS)
    wrong = differing_names(params_a, params_b)
    if not wrong:
        return None
    return Finding("independent", "initial_params", 0, rank,
                   f"the initial parameters differ before step 0 ({len(wrong)} of {len(params_a)}, first {wrong[0]}): "
                   "the model is built from weights initialised differently in each run, before any training step "
                   "(no torch.manual_seed before the model is built, a seed that changes, or another checkpoint "
                   "loaded); seed torch with a constant before building the model", f"params:{wrong[0]}")


__all__ = ["Finding", "explain_resume", "explain_independent", "ordered", "script_notes", "census_suspects",
           "census_names"]
