"""Verify's findings for a resumed run C against A: one small rule per kind of finding, in one
ordered table (`_RULES`) that is also the order findings are shown in (`ordered`).

Each rule reads a `_ResumeStep` (the census records that differ at one rank's step, and the
facts several rules share, each worked out once) and yields its findings; a rule may read the
findings of the rules before it (``input_batch`` is said only when no data or generator
finding explains the batch), and an ``alone`` rule's finding is the step's whole explanation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from samebits.checkpoint import CensusName, describe_state_record, has_scheduler
from samebits.runners._census_facts import Census, Finding, differing_names, moved_in_step, same_bits, why_drawn
from samebits.stream.phases import INPUTS, PARAMS, RESTORED_OPTIMIZER, RESTORED_PARAMS, STATE
from samebits.stream.phases import OPTIMIZER as OPTIMIZER_PHASE


@dataclass
class _ResumeStep:
    """What the rules read about one rank's step of a resumed run C against A: the census
    records that differ (less those that also differ between A and B, and loader positions
    that are no evidence) and the facts several rules share, each worked out once."""

    census_a: Census
    census_c: Census
    main_a: dict
    rank: int
    step: int
    resume_at: int
    state_a: dict
    state_c: dict
    differing: list[str]
    findings: list[Finding] = field(default_factory=list)  # the step's findings so far, in table order

    def finding(self, kind: str, says: str, record: str | None = None, **extra) -> Finding:
        return Finding("resume", kind, self.step, self.rank, says, record, **extra)

    def named(self, names, *kinds: str) -> list[str]:
        return [n for n in names if CensusName.parse(n).kind in kinds]

    @cached_property
    def scheduled(self) -> list[str]:
        return self.named(self.differing, CensusName.SCHEDULER)

    @cached_property
    def loader(self) -> str | None:
        """The first loader record that differs: its position (or state) was not restored."""
        return next(iter(self.named(self.differing, CensusName.DATA_POSITION, CensusName.DATA_STATE)), None)

    @cached_property
    def changed_inputs(self) -> list[str]:
        at = (self.rank, self.step, INPUTS)
        return differing_names(self.census_a.get(*at), self.census_c.get(*at))

    @cached_property
    def generators(self) -> list[tuple[str, tuple | None, str]]:
        """(name, restored then drawn, why it explains the step) of each generator that differs
        and explains the step: one nobody drew from explains nothing."""
        census_a, census_c, rank, step = self.census_a, self.census_c, self.rank, self.step
        events = census_c.events_of(rank)
        out = []
        for name in (n for n in self.differing if CensusName.parse(n).is_generator):
            consumed = (_restored_then_drawn(events, CensusName.parse(name).generator()[0], self.state_a[name],
                                             self.state_c[name], self.resume_at) if step == self.resume_at else None)
            used = (moved_in_step(census_a, rank, step, name), moved_in_step(census_c, rank, step, name))
            why = why_drawn(used, step, census_a, census_c, rank, name, bool(self.changed_inputs))
            if consumed is not None or why:
                out.append((name, consumed, why))
        return out

    @cached_property
    def batch_from(self) -> int | None:
        """The step of A whose batch C's batch of this step is (None: not A's, or not changed)."""
        return _batch_replayed(self.census_a, self.rank, self.census_c.get(self.rank, self.step, INPUTS),
                               self.changed_inputs, self.step)

    @property
    def batch_from_old_order(self) -> bool:
        """C's batch is an earlier batch of A at the same data position: the data order was
        drawn from a generator in an earlier state (the generator's finding says so)."""
        return (self.batch_from is not None and self.batch_from != self.step + 1 and self.loader is None
                and bool(self.generators))


def _comes_and_goes(name: str) -> bool:
    parsed = CensusName.parse(name)
    return parsed.kind == CensusName.USER_RNG or parsed.is_loader


def resume_step(census_a, census_b, census_c, main_a, rank, step, resume_at) -> list[Finding]:
    state_a, state_c = census_a.get(rank, step, STATE), census_c.get(rank, step, STATE)
    if not state_a or not state_c:
        return []
    ambient = set(differing_names(state_a, census_b.get(rank, step, STATE))) if census_b is not None else set()
    differing = [n for n in differing_names(state_a, state_c) if n not in ambient]
    # Loaders come and go (a library may wrap the loader it resumes, e.g. to skip batches): a
    # position is compared only when both runs hold the same loaders, and one run holding more
    # loaders than the other is no finding by itself.
    loaders = lambda state: {n for n in state if CensusName.parse(n).is_loader}  # noqa: E731
    if loaders(state_a) != loaders(state_c):
        differing = [n for n in differing if not CensusName.parse(n).is_loader]
    differing = [n for n in differing if not CensusName.parse(n).is_loader
                 or _position_of_training(census_a, rank, step, n, state_a, state_c)]
    facts = _ResumeStep(census_a, census_c, main_a, rank, step, resume_at, state_a, state_c, differing)
    for rule in _RULES:
        if rule.find is None:
            continue
        found = list(rule.find(facts))
        if found and rule.alone:
            return found
        facts.findings += found
    return facts.findings


def _position_of_training(census_a: Census, rank: int, step: int, name: str, state_a: dict, state_c: dict) -> bool:
    """Is loader record ``name`` a training data position that C did not restore?  A loader
    whose position A's steps do not move (an evaluation loader, drawn before training or
    between evaluations) feeds no training step (litgpt's validation loader, made at the
    training loader's line).  A stateful loader's state_dict (data.state.<site>) is where it
    is; the batches its newest iterator yielded count from wherever that iterator was made
    (litgpt makes a new one after torchdata's restore), so the count alone is no finding."""
    values = [census_a.get(rank, other, STATE).get(name) for other in (step - 1, step, step + 1)]
    values = [v for v in values if v is not None]
    if len(values) >= 2 and all(same_bits(v, values[0]) for v in values[1:]):
        return False
    parsed = CensusName.parse(name)
    if parsed.kind == CensusName.DATA_STATE:
        return True
    state = str(parsed.loader_state())
    return not (state in state_a and state in state_c and same_bits(state_a[state], state_c[state]))


# --- the rules, one per kind of finding ----------------------------------------------------


def _off_by_one(s: _ResumeStep):
    """C's progress at its first step is A's of the step before or after."""
    progress = [n for n in s.differing if _is_progress(n)]
    if s.step != s.resume_at or not progress:
        return
    for other in (s.step - 1, s.step + 1):
        state_other = s.census_a.get(s.rank, other, STATE)
        if state_other and all(n in state_other and same_bits(state_other[n], s.state_c[n]) for n in progress):
            yield s.finding("off_by_one", f"C's training progress at its step {s.step} (census records "
                            f"{', '.join(progress)}) equals A's at step {other}, not at step {s.step}: the resume is "
                            f"off by one (C resumed the checkpoint of step {other} but is numbered from {s.step}; pass "
                            f"--resume-at {other}, or save at step {s.step})", progress[0])
            return


def _model_params(s: _ResumeStep):
    """The parameters a resumed process begins with are not A's after the step before."""
    main, restored = s.main_a.get(s.rank, {}), s.census_c.get(s.rank, s.step, RESTORED_PARAMS)
    if s.step != s.resume_at or not main.get(PARAMS) or not restored:
        return
    wrong = [n for n, r in main[PARAMS].items() if n in restored and not same_bits(r, restored[n])]
    if wrong:
        yield s.finding("model_params", f"the model's parameters as C's step {s.step} begins differ from A's after "
                        f"step {s.step - 1} ({len(wrong)} of {len(main[PARAMS])}, first {wrong[0]}): the weights were "
                        "not loaded from the checkpoint, or were changed after the load (a stray re-initialisation, "
                        "e.g. model.apply(init) or reset_parameters() after load_state_dict)", f"params:{wrong[0]}")


def _optimizer_state(s: _ResumeStep):
    """The optimizer state a resumed process begins with, its records C lacks or has, its step
    counts or group settings that differ."""
    found = list(_restored_optimizer(s)) + list(_absent(s, "optimizer_state"))
    yield from found
    records = [n for n in s.named(s.differing, CensusName.OPTIMIZER) if CensusName.parse(n).field != "lr"]
    if records and not found:
        name = sorted(records)[0]
        yield s.finding("optimizer_state", f"{describe_state_record(name)} (step {s.step})", name)


def _restored_optimizer(s: _ResumeStep):
    saved = s.main_a.get(s.rank, {}).get(OPTIMIZER_PHASE)
    if s.step != s.resume_at or saved is None or not s.census_c.get(s.rank, s.step, RESTORED_PARAMS):
        return
    restored = s.census_c.get(s.rank, s.step, RESTORED_OPTIMIZER)
    lost = [n for n in saved if n not in restored]
    wrong = [n for n in saved if n in restored and not same_bits(saved[n], restored[n])]
    if saved and len(lost) == len(saved):
        yield s.finding("optimizer_state", f"C's optimizer holds no state as step {s.step} begins (A's holds "
                        f"{len(saved)} state tensors after step {s.step - 1}, e.g. {next(iter(saved))}): the "
                        "optimizer state was not restored (optimizer.load_state_dict(checkpoint['optimizer']) "
                        "missing, or called on another optimizer)", f"optimizer:{next(iter(saved))}")
    elif lost or wrong:
        first = (lost or wrong)[0]
        yield s.finding("optimizer_state", f"C's optimizer state as step {s.step} begins differs from A's after step "
                        f"{s.step - 1} ({len(lost)} state tensors missing, {len(wrong)} different; first {first}): "
                        "the optimizer state was restored only in part, or changed after the load",
                        f"optimizer:{first}")


def _scheduler(s: _ResumeStep):
    yield from _absent(s, "scheduler")
    if s.scheduled:
        yield s.finding("scheduler", _scheduler_says(s.census_a, s.census_c, s.rank, s.step, s.scheduled, s.state_c),
                        _scheduler_record(s.scheduled))


def _grad_scaler(s: _ResumeStep):
    yield from _absent(s, "grad_scaler")
    for name in s.named(s.differing, CensusName.SCALER):
        yield s.finding("grad_scaler", f"{describe_state_record(name)} (step {s.step})", name)


def _iteration_counter(s: _ResumeStep):
    """A learning rate that differs with no LR scheduler state differing: the loop sets it."""
    lr = [n for n in s.named(s.differing, CensusName.OPTIMIZER) if CensusName.parse(n).field == "lr"]
    if not lr or s.scheduled:
        return
    same_as = _matching_step(s.census_a, s.rank, STATE, lr[0], s.state_c[lr[0]], s.step)
    evidence = f" (C's learning rate at step {s.step} is A's at step {same_as})" if same_as is not None else ""
    # a scheduler is named only in a program that has one (its census records sched<i>.*)
    others = ("the program has no LR scheduler" if not has_scheduler(s.state_a) and not has_scheduler(s.state_c)
              else "no LR scheduler state differs")
    yield s.finding("iteration_counter", f"the learning rate of optimizer {CensusName.parse(lr[0]).key} differs at "
                    f"step {s.step} and {others}{evidence}: the script sets the LR itself, from an iteration counter "
                    "that was not restored from the checkpoint (restore it, e.g. iter_num = checkpoint['iter_num'])",
                    lr[0])


def _data_position(s: _ResumeStep):
    """A loader at another position; a batch that is one of A's other batches."""
    yield from _absent(s, "data_position")
    if s.loader is not None:
        yield s.finding("data_position", f"{describe_state_record(s.loader)} (step {s.step}: skip the batches "
                        "already seen, or save and load the loader's state)", s.loader,
                        site=CensusName.parse(s.loader).site)
    batch_from, step = s.batch_from, s.step
    if batch_from is None or s.batch_from_old_order:
        return  # the same position, an earlier batch: the generator's finding says it
    if batch_from == step + 1:
        how = ("the resumed run drew again a batch that A had drawn before the checkpoint (a prefetched "
               "batch not saved with the checkpoint, or the RNG saved after the prefetch)")
    else:
        how = (f"the data position was not restored (C replays A's step {batch_from}: the loader did not "
               "skip the batches already seen, or its state was not loaded)" if batch_from < step
               else "C's data is ahead")
    yield s.finding("data_position", f"the input batch of step {step} differs: C's batch is A's batch of step "
                    f"{batch_from}: {how}", f"inputs:{s.changed_inputs[0]}")


def _generator_consumed(s: _ResumeStep):
    """A generator restored, then drawn from before the step began."""
    for name, consumed, _ in s.generators:
        if consumed is None:
            continue
        restore, draws, exact = consumed
        label = CensusName.parse(name).generator()[1]
        by = "; ".join(f"{d.get('by', 'code')} at {d.get('site')}" for d in draws) or \
            "code that ran between the restore and the step's first forward"
        if exact:
            says = (f"{label} was restored to A's state of step {s.step} at {restore.get('site')} "
                    f"({restore.get('call')}), then drawn from before the step began, by {by}: restore it "
                    "after that, or give that code its own generator")
        else:
            says = (f"{label} was restored at {restore.get('site')} ({restore.get('call')}), then drawn from "
                    f"before step {s.step} began, by {by}, and is not in A's state there: the checkpoint holds "
                    "its state from another point than where the resumed run restores it (e.g. saved after a "
                    "prefetched batch that the resumed run draws again: save the batch, or the state before "
                    "the prefetch)")
        # the place is where it was drawn from, when known (not the restore: it is not the cause)
        yield s.finding("generator_consumed", says, name, site=draws[0].get("site") if draws else None,
                        generator=CensusName.parse(name).generator()[0])


def _generator(s: _ResumeStep):
    """A generator in another state that the step draws from (or C lacks or has)."""
    yield from _absent(s, "generator")
    order_evidence = (f"; C's batch of step {s.step} is A's batch of step {s.batch_from}: the data order was drawn "
                      "from it in an earlier state") if s.batch_from_old_order else ""
    for name, consumed, why in s.generators:
        if consumed is None:
            ident = CensusName.parse(name).generator()[0]
            yield s.finding("generator", f"{describe_state_record(name)} ({why}{order_evidence})", name,
                            generator=ident, site=ident.removeprefix("user:") if ident.startswith("user:") else None)


def _input_batch(s: _ResumeStep):
    """A batch that differs while no recorded state explains it."""
    if s.changed_inputs and s.batch_from is None and not any(
            f.kind in ("data_position", "generator", "generator_consumed") for f in s.findings):
        yield s.finding("input_batch", f"the input batch of step {s.step} differs ({s.changed_inputs[0]}) while no "
                        "recorded state explains it: the data pipeline gives another batch after the resume",
                        f"inputs:{s.changed_inputs[0]}")


# The census kinds a rule above reads; a record of any other kind (one the census learned after
# these rules were written, or `OTHER`) that differs is still said, in its own words.
_KINDS_WITH_A_RULE = frozenset({*CensusName.GENERATOR_KINDS, CensusName.OPTIMIZER, CensusName.SCHEDULER,
                                CensusName.SCALER, CensusName.DATA_POSITION, CensusName.DATA_STATE})


def _other_state(s: _ResumeStep):
    """State no rule above reads that differs: named by its record and `describe_state_record`,
    so a new kind of census record is never a silent difference."""
    for name in s.differing:
        if CensusName.parse(name).kind not in _KINDS_WITH_A_RULE:
            yield s.finding("other_state", f"{describe_state_record(name, s.state_a)} (step {s.step})", name)


def _absent(s: _ResumeStep, kind: str):
    """Records of ``kind`` one run has and the other lacks (one per optimizer, scheduler, scaler),
    but for those that come and go: the program's own generators, made by site, and the loaders
    (a library may wrap the loader it resumes)."""
    missing, extra = ([n for n in mine if n not in theirs and not _comes_and_goes(n)]
                      for mine, theirs in ((s.state_a, s.state_c), (s.state_c, s.state_a)))
    for name in _one_per_component(missing):
        if _kind_of(name) == kind:
            yield s.finding(kind, f"C has no {CensusName.parse(name).subject()} at step {s.step}, A has: was it "
                            f"created and restored on resume?{_absent_words(name)}", name)
    for name in _one_per_component(extra):
        if _kind_of(name) == kind:
            yield s.finding(kind, f"C has a {CensusName.parse(name).subject()} at step {s.step} that A does not have",
                            name)


class _Rule(NamedTuple):
    kind: str
    find: Callable[[_ResumeStep], Iterable[Finding]] | None  # None: a kind found elsewhere
    alone: bool = False  # a finding of this kind is the step's whole explanation


# Every kind of finding, most specific first: the order `ordered` sorts them in and, for a
# resumed step, the order the rules run in (a rule may read the findings of those before it).
_RULES = (
    _Rule("off_by_one", _off_by_one, alone=True),
    _Rule("script_said", None),  # what samebits' callbacks said in C (explain_resume)
    _Rule("initial_params", None),  # independent runs (explain_independent)
    _Rule("model_params", _model_params),
    _Rule("optimizer_state", _optimizer_state),
    _Rule("scheduler", _scheduler),
    _Rule("grad_scaler", _grad_scaler),
    _Rule("iteration_counter", _iteration_counter),
    _Rule("data_position", _data_position),
    _Rule("generator_consumed", _generator_consumed),
    _Rule("generator", _generator),
    _Rule("input_batch", _input_batch),
    _Rule("other_state", _other_state),
    _Rule("order", None),  # independent runs (explain_independent)
)


def _scheduler_record(scheduled: list[str]) -> str:
    """The scheduler record a finding rests on: its position first (what a restore sets)."""
    for field in ("last_epoch", "step_count", "lr"):
        for name in scheduled:
            if name.partition(".")[2] == field:
                return name
    return scheduled[0]


def _scheduler_says(census_a: Census, census_c: Census, rank: int, step: int, scheduled: list[str],
                    state_c: dict) -> str:
    """An LR scheduler in another state as ``step`` begins: its position (``last_epoch``), with
    A's step whose position C's equals (a scheduler that starts over is at A's step 0), and the
    learning rate the optimizer uses: equal at this step when the optimizer's state restored its
    param groups' lr, then the first step where it differs (the scheduler's next step moves it
    from its own position), as the census shows it."""
    record = _scheduler_record(scheduled)
    number, what = CensusName.parse(record).key, CensusName.parse(record).field_words()
    same_as = _matching_step(census_a, rank, STATE, record, state_c[record], step) if record in state_c else None
    where = ""
    if same_as is not None:
        where = f": C's is A's at step {same_as}" + (", the scheduler starts over" if same_as == 0 else "")
    says = f"LR scheduler {number}'s {what} differs as step {step} begins{where}"
    lr_names = sorted(n for n in census_a.get(rank, step, STATE) if CensusName.parse(n).kind == CensusName.OPTIMIZER
                      and n.endswith(".lr"))
    if lr_names:
        name = lr_names[0]
        later = [other for other in sorted({at for (r, at) in census_c.steps if r == rank}) if other >= step]
        first_lr = None
        for other in later:
            lr_a, lr_c = census_a.get(rank, other, STATE).get(name), census_c.get(rank, other, STATE).get(name)
            if lr_a is not None and lr_c is not None and not same_bits(lr_a, lr_c):
                first_lr = other
                break
        if first_lr == step:
            says += f"; the learning rate the optimizer uses differs at step {step} too"
        elif first_lr is not None:
            says += (f"; the learning rate the optimizer uses is still A's at step {step} (the optimizer's state "
                     f"restored its param groups' lr) and differs from step {first_lr} on, after the scheduler "
                     "steps from its own position")
        elif later:
            says += (f"; the learning rate the optimizer uses is A's at step {step} (the optimizer's state restored "
                     "its param groups' lr); the scheduler's next step sets it from the scheduler's own position")
    return says + ": the scheduler was not restored; restore it with scheduler.load_state_dict(checkpoint['scheduler'])"


def ordered(findings: list[Finding]) -> list[Finding]:
    """Most specific first (a stable sort by kind, in the order of `_RULES`), then by step and rank."""
    rank_of = {rule.kind: i for i, rule in enumerate(_RULES)}
    return sorted(findings, key=lambda f: (f.step, rank_of.get(f.kind, len(_RULES)), f.rank))


def _is_progress(name: str) -> bool:
    parsed = CensusName.parse(name)
    return ((parsed.kind == CensusName.OPTIMIZER and parsed.field in ("step", "lr"))
            or parsed.kind == CensusName.SCHEDULER or parsed.is_loader)


def _one_per_component(names: list[str]) -> list[str]:
    """The first record of each optimizer, LR scheduler and GradScaler among ``names`` (a
    scheduler that is absent lacks its three records: one finding), every other record."""
    seen, out = set(), []
    for name in names:
        parsed = CensusName.parse(name)
        component = parsed.head if parsed.is_component else name
        if component not in seen:
            seen.add(component)
            out.append(name)
    return out


def _absent_words(name: str) -> str:
    """What an absent record is, where its subject does not already say it (a generator's record)."""
    return "" if CensusName.parse(name).is_component else f" ({describe_state_record(name)})"


_KIND_OF = {CensusName.OPTIMIZER: "optimizer_state", CensusName.SCHEDULER: "scheduler", CensusName.SCALER: "grad_scaler",
            CensusName.DATA_POSITION: "data_position", CensusName.DATA_STATE: "data_position"}


def _kind_of(name: str) -> str:
    """The kind of finding a census record that one run lacks makes."""
    return _KIND_OF.get(CensusName.parse(name).kind, "generator")


def _matching_step(census: Census, rank: int, phase: str, name: str, record, around: int) -> int | None:
    for (r, step), phases in sorted(census.steps.items()):
        if r == rank and step != around and name in phases.get(phase, {}) and same_bits(phases[phase][name], record):
            return step
    return None


def _batch_replayed(census: Census, rank: int, inputs: dict, changed: list[str], around: int) -> int | None:
    """The step of A whose batch C's batch of step ``around`` is: every input equal, else the
    first input that differs found by its digest among all of A's inputs (any forward of a
    step, any name: a batch a resumed run draws again)."""
    if not changed:
        return None
    for (r, step), phases in sorted(census.steps.items()):  # every input (the first forward's) equal
        mine = phases.get(INPUTS, {})
        if r == rank and step != around and mine and all(n in mine and same_bits(mine[n], inputs[n]) for n in inputs):
            return step
    record = inputs[changed[0]]
    if record.digest is None:
        return None
    for (r, step), phases in sorted(census.steps.items()):
        if r == rank and step != around and any(same_bits(mine, record) for mine in phases.get(INPUTS, {}).values()):
            return step
    return None


def _restored_then_drawn(events: list[dict], generator: str, record_a, record_c, resume_at: int):
    """(the restore, the draws after it, exact) when C restored ``generator`` before its first
    step and then drew from it before that step's first forward (its state there is not the
    restored one); ``exact``: the restored state was A's state at that step's start, so the
    draws alone make the difference.  None otherwise."""
    wanted = f"{record_a.digest:016x}" if record_a.digest is not None else None
    now = f"{record_c.digest:016x}" if record_c.digest is not None else None
    restore, draws = None, []
    for event in events:
        if event.get("generator") != generator or event.get("step") != resume_at:
            continue
        if event.get("event") == "restored":
            restore, draws = event, []
        elif event.get("event") == "seeded":
            restore, draws = None, []  # a seed after the restore: another story
        elif event.get("event") == "drawn" and restore is not None:
            draws.append(event)
    if restore is None or restore.get("digest") is None or restore.get("digest") == now:
        return None  # no restore, or nothing drew from it after the restore
    exact = restore.get("digest") == wanted
    if not exact and restore.get("library"):
        return None  # a library restoring a state it saved itself (Lightning's isolate_rng): no checkpoint's
    return restore, draws, exact


__all__ = ["resume_step", "ordered"]
