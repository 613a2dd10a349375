"""The sentences of `samebits bisect`: what each kind of finding concludes, in words.

`Conclusions` is the half of the bisector (`samebits.runners._bisect_narrow._Bisector`) that
turns what its narrowing established into an `Origin` and its one-sentence conclusion; it
reads the bisector's stages, notes and census, and asks it for more evidence through
``_dump`` (the origin's inputs and outputs, element by element) and ``_event_site`` /
``_collective_site`` (a call site), which run the program again.
"""

from __future__ import annotations

from dataclasses import dataclass

from samebits.checkpoint import CensusName, describe_state_record
from samebits.stream.phases import AFTER_OPTIMIZER_STEP
from samebits.runners._bisect_result import BisectResult, ControlFlow, Elements, Origin
from samebits.trace import OriginFinding, describe_record

MAX_RERUNS = 3  # pairs of runs a narrowing stage may take to see its divergence again

# ATen ops that draw from a generator: an origin among them is a generator's state.
RNG_OPS = frozenset({
    "aten::bernoulli", "aten::bernoulli_", "aten::native_dropout", "aten::dropout", "aten::feature_dropout",
    "aten::alpha_dropout", "aten::rand", "aten::rand_like", "aten::randn", "aten::randn_like", "aten::randint",
    "aten::randint_like", "aten::randperm", "aten::normal", "aten::normal_", "aten::uniform_", "aten::random_",
    "aten::exponential_", "aten::cauchy_", "aten::log_normal_", "aten::geometric_", "aten::multinomial",
    "aten::poisson", "aten::rrelu_with_noise", "aten::_fused_dropout", "aten::_standard_gamma",
})


@dataclass
class _Evidence:
    """What the narrowing stages established, for the conclusion."""

    module_origin: OriginFinding | None = None  # a module whose inputs matched and whose output differs
    subtree: str | None = None  # where rung 3 looked
    ops_finding: OriginFinding | None = None  # rung 3's first difference (when it was not an op origin)
    reproduced: bool = True


class Conclusions:
    """The conclusion of each kind of finding (see the module docstring)."""

    def _shortcut(self, found: OriginFinding, result: BisectResult) -> Origin | None:
        """Findings that end the bisection where they are seen."""
        if found.classification == "control_flow":
            result.control_flow = _control_flow(found)
            anchor = self._anchor(found.step)
            if (self.resume_step is not None and found.step == self.resume_step and found.phase == "optimizer"
                    and anchor is not None and anchor[1].phase == "optimizer"):
                return self._optimizer_state(found, anchor)
            return Origin.of(found, None, "control_flow",
                                f"the runs take different paths at step {found.step} on rank {found.rank}: "
                                f"{found.parted or found.detail}")
        if found.classification == "order":
            return self._explain_order(found)
        if found.category == "phase" and found.role == "in" and (found.event_id or "").startswith("forward/"):
            root = found.event_id.partition("/")[2].rpartition(":")[0]
            model = "the model's forward" if root == "model" else f"the forward of top-level module {root}"
            text = (f"the input batch differs at step {found.step} (input {found.label} of {model}, on rank "
                    f"{found.rank}): the origin is before the model (data loader / dataset / sampler)")
            generators = _torch_generators(found)
            if generators:  # the batch was drawn from a torch generator that was already in another state
                return Origin.of(found, None, "generator",
                                    "; ".join(describe_state_record(name) for name in generators)
                                    + f". So {text[0].lower()}{text[1:]}", state_differs=generators)
            return Origin.of(found, None, "input_batch", text + self._state_sentence(found, ". Also: "))
        if found.category in ("op", "probe") and found.permuted:
            site = f" at {found.call_site}" if found.call_site else ""
            return Origin.of(found, None, "order",
                                f"same values, different order: {found.op}{site} (step {found.step}, phase "
                                f"{found.phase}, rank {found.rank}) received the same tensors in another order "
                                f"({found.detail}). Something iterated in an order that changes between runs "
                                "feeds it (a Python set, PYTHONHASHSEED, a dict keyed by ids, a file listing)")
        if found.category == "collective" and found.permuted:
            site = found.call_site or self._collective_site(found)
            found.call_site = site
            op = (found.event_id or "").rpartition("/")[2].rpartition(":")[0]
            return Origin.of(found, None, "order",
                                f"same values, different order: at step {found.step} on rank {found.rank} the "
                                f"{op} calls{' at ' + site if site else ''} received the same tensors in another "
                                "order (the collective order differs). The calls are issued in an order that "
                                "changes between runs (a Python set, PYTHONHASHSEED, a dict keyed by ids): every "
                                "rank must issue its collectives in one fixed order")
        if found.classification == "origin" and found.category == "state":
            return Origin.of(found, None, "initial_state",
                                f"the parameters differ before step {found.step}, the first traced step "
                                f"({found.label} on rank {found.rank}): initialisation (its seed) or the "
                                "loaded checkpoint differs, so no training op is the origin")
        # Python's and NumPy's generators differ between any two processes that do not seed them
        # (and never feed an ATen op): they are no evidence of what a resume restores.
        names = [name for name in found.state_differs if not CensusName.parse(name).is_generator]
        if self.from_step is not None and found.step == self.from_step and names and not _torch_generators(found):
            # B resumed at this step, each side repeats itself, and the state census taken at the
            # step's start, before any op, already differs: what the checkpoint saves and restores.
            # (A torch generator that differs is narrowed on instead: to the RNG op that draws from it.)
            listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            return Origin.of(found, None, "resume_state",
                           f"the resumed run starts step {found.step} in another state than the run it resumes "
                           f"(rank {found.rank}): {listed} differ at the step's start, before any op ran, and each "
                           "side repeats itself: the checkpoint does not save or restore them. "
                           + self._describe(names[0], found),
                           state_differs=names)
        return None

    def _describe(self, name: str, finding: OriginFinding) -> str:
        """The sentence for census record ``name`` that differs at ``finding``'s step start,
        naming only what the program has (its census there: `describe_state_record`)."""
        return describe_state_record(name, self.census_present.get((finding.rank, finding.step)))

    def _state_sentence(self, finding: OriginFinding, prefix: str) -> str:
        if not finding.state_differs:
            return ""
        return prefix + "; ".join(self._describe(name, finding) for name in finding.state_differs) + "."

    def _reconcile(self, origin: Origin) -> Origin:
        """The conclusion never contradicts an earlier stage: after "phase P of step S: inputs
        matched, output differs", a final kind about step S is about phase P, about the state the
        step started from (`resume_state`), or becomes `not_localised` (saying what was ruled out)."""
        if origin.kind in ("resume_state", "not_localised", "replicas"):
            return origin
        anchor = self._anchor(origin.step)
        if anchor is None:
            return origin
        number, evidence = anchor
        if _same_phase(evidence.phase, origin.phase):
            return origin
        stage = self.stages[number - 1]
        self.notes.append(f"stage {number} ({stage.name}) found phase {evidence.phase} at step {evidence.step} to be "
                          f"where inputs matched and the output differs; the finer stages concluded {origin.kind} in "
                          f"phase {origin.phase}, which cannot explain it: not localised")
        text = (f"not localised: stage {number} ({stage.name}, rung {stage.rung}) found the first difference at "
                f"{evidence.where()}: {evidence.detail}; but the finer stages' first difference is in phase "
                f"{origin.phase} ({origin.kind}: {origin.conclusion}), outside phase {evidence.phase}, so it does "
                f"not explain it. Ruled out: every value recorded before phase {evidence.phase} of step "
                f"{evidence.step} matched; the difference arises in phase {evidence.phase}, from a value its trace "
                "does not record (state kept across steps, or code outside torch)")
        return Origin.of(evidence, None, "not_localised", text + self._state_sentence(evidence, " Also: "))

    def _anchor(self, step: int) -> tuple[int, OriginFinding] | None:
        """The earliest stage's evidence at ``step``: (stage number, finding) of the first stage
        that found an event there whose inputs matched and whose output differs."""
        for number, stage in enumerate(self.stages, 1):
            found = stage.finding
            if found is not None and found.classification == "origin" and found.step == step \
                    and found.category != "state":
                return number, found
        return None

    def _optimizer_state(self, found: OriginFinding, anchor: tuple[int, OriginFinding]) -> Origin:
        """A resume bisect whose optimizer step, given the same gradients and parameters (an
        earlier stage: its inputs matched, its output differs), runs other ops than the run it
        resumes: the optimizer's own state (moments, momentum buffers) was not restored."""
        number, evidence = anchor
        a_has = describe_record(found.a)
        b_has = describe_record(found.b)
        return Origin.of(found, None, "resume_state",
                       f"the resumed run's optimizer state differs at step {found.step} (rank {found.rank}): its "
                       f"optimizer step got the same gradients and parameters (stage {number}: "
                       f"{evidence.detail}) but runs other ops than the run it resumes (a: {a_has}; b: {b_has}): "
                       "the optimizer's own state (momentum buffers, moments, step counts) is not saved or "
                       "restored by the checkpoint (optimizer.load_state_dict)", state_differs=[])

    def _explain_order(self, found: OriginFinding) -> Origin:
        """Same values, another order: say what was reordered, and where it comes from."""
        reordered = found.reordered
        if reordered is not None and _is_optimizer_order(found):
            site = found.call_site or self._event_site(found)
            found.call_site = site
            return Origin.of(found, None, "order",
                           f"same values, different order: the optimizer's parameters are in another order at step "
                           f"{found.step} (rank {found.rank}): it holds the same parameters with the same values, "
                           f"in another order (a: {_some(reordered['a'])}; b: {_some(reordered['b'])})"
                           + (f", for the optimizer built at {site}" if site else "")
                           + ". Its param groups are built from something iterated in an order that changes between "
                           "runs (a Python set, PYTHONHASHSEED, a dict keyed by ids): nothing differs in value yet, "
                           "but whatever follows that order does (clipping or foreach kernels over the list, and "
                           "its state_dict: a checkpoint's state goes to other parameters)")
        what = f": {found.detail}" if found.detail else ""
        return Origin.of(found, None, "order",
                       f"same values, different order: the runs recorded the same values in another order at step "
                       f"{found.step} (rank {found.rank}){what}. Something iterated in an order that changes between "
                       "runs (a Python set, a dict keyed by ids, hooks or threads) decides it")

    def _finish(self, final: OriginFinding, subtree: str | None, evidence: _Evidence) -> Origin:
        """The origin object and its conclusion, with the dump for an op, probe or collective."""
        elements = None
        rng_op = final.category == "op" and final.op in RNG_OPS  # its conclusion needs no element data
        if final.classification == "origin" and final.category in ("op", "collective", "probe") and not rng_op:
            elements = self._dump(final, subtree)
        if not evidence.reproduced:
            return Origin.of(final, None, "not_localised",
                                f"not localised: the runs first differ at step {final.step} ({final.where()}), "
                                f"but {MAX_RERUNS} re-runs at a finer rung did not diverge again (a rare race); "
                                "run the bisect again, or with more steps")
        if final.classification == "origin" and final.category in ("op", "probe", "collective"):
            if elements is not None and not elements.differing:
                # The dumps hold no difference: the origin rests on the trace's digests, and the
                # dumps' equal outputs are no element detail of it ("0 of N differ, max 0 ulp").
                origin = self._explain_origin(final, None)
                origin.conclusion += (f". Its dumps did not reproduce the difference: output {elements.output} of "
                                      f"{final.op or final.event_id} was equal in the dump runs "
                                      f"({' vs '.join(elements.pair)}, {elements.total} elements), so the "
                                      "difference did not recur there (a race that fires only sometimes); no "
                                      "element detail. Run the bisect again for it")
                return origin
            return self._explain_origin(final, elements)
        if evidence.module_origin is not None and evidence.ops_finding is not None:
            module = evidence.module_origin
            ops = evidence.ops_finding
            return Origin.of(module, None, "below_dispatcher",
                                f"below the dispatcher: module {module.module or '(root)'} (step {module.step}, "
                                f"rank {module.rank}) received identical inputs and its output differs, yet no "
                                f"ATen op inside it is an origin (rung 3's first difference there: {ops.where()}, "
                                f"{ops.classification}: {ops.detail}). A call the dispatcher does not see inside "
                                "it (a custom kernel, a C++ extension, a library call) made the difference: put "
                                "a samebits.trace.TraceProbe around that call")
        ruled_out = ["the initial parameters matched", "the model's inputs matched up to the divergent step"]
        if evidence.subtree is not None:
            ruled_out.append(f"no ATen op in {evidence.subtree or 'the whole model'} at step {final.step} has "
                             "matching inputs and a differing output")
        text = (f"not localised: the first difference is {final.where()} ({final.classification}: {final.detail}). "
                "Ruled out: " + "; ".join(ruled_out) + ". The value was written by code the trace does not "
                "cover here (outside the traced module subtree, or outside torch)")
        return Origin.of(final, None, "not_localised", text + self._state_sentence(final, " Also: "))

    def _explain_origin(self, final: OriginFinding, elements: Elements | None) -> Origin:
        site = f" at {final.call_site}" if final.call_site else ""
        what = f"{final.op or final.event_id}{site}"
        if final.category == "op" and final.op in RNG_OPS:
            generators = _torch_generators(final)
            if generators:
                text = "; ".join(describe_state_record(name) for name in generators)
                return Origin.of(final, elements, "generator",
                                    f"{text} (step {final.step}, rank {final.rank}): the RNG op {what} drew "
                                    "different numbers from identical inputs", state_differs=generators)
            return Origin.of(final, elements, "generator",
                                f"the RNG op {what} drew different numbers from identical inputs at step "
                                f"{final.step} on rank {final.rank}: the generator it draws from was in another "
                                "state (a torch.Generator passed to it, seeded from something that changes, or "
                                "not restored on resume)")
        if elements is not None and not elements.inputs_identical:
            # The trace saw every input recorded before the op match; its dumps say otherwise.
            if elements.inputs_permuted:
                return Origin.of(final, elements, "order",
                               f"same values, different order: {what} (step {final.step}, phase {final.phase}, rank "
                               f"{final.rank}) was given the same input tensors in another order (its dumps: "
                               f"inputs {', '.join(elements.inputs_differ[:6])} hold each other's values). Something "
                               "iterated in an order that changes between runs feeds it (a Python set, "
                               "PYTHONHASHSEED, a dict keyed by ids, a file listing)")
            return Origin.of(final, elements, "not_localised",
                           f"not localised: the first difference is the output of {what} (step {final.step}, phase "
                           f"{final.phase}, rank {final.rank}), but its dumps show its inputs differ "
                           f"({', '.join(elements.inputs_differ[:6])}) although every value recorded before it "
                           "matched: a value computed before it reached it through another argument, so it is not "
                           "the origin. Ruled out: every traced value before it at that step")
        if elements is not None and elements.same_values:
            return Origin.of(final, elements, "order",
                                f"same values, different order: the output of {what} (step {final.step}, rank "
                                f"{final.rank}) holds the same values in another order. Something iterated in an "
                                "order that changes between runs feeds it (a Python set, a dict keyed by ids, "
                                "PYTHONHASHSEED, a file listing)")
        kind = {"op": "op", "probe": "probe", "collective": "collective"}[final.category]
        text = f"origin: {what} (step {final.step}, phase {final.phase}, rank {final.rank}): {final.detail}"
        if final.catalog:
            text += f". Known: {final.catalog}"
        return Origin.of(final, elements, kind, text)


def _torch_generators(finding: OriginFinding) -> list[str]:
    """The torch generators among the census records that differ at the finding's step start
    (ATen ops draw from these; Python's and NumPy's generators never feed them)."""
    return [name for name in finding.state_differs if CensusName.parse(name).is_torch_generator]


def _same_phase(evidence: str | None, final: str | None) -> bool:
    """A finer stage's phase is about the evidence's phase (recomputation runs in backward)."""
    def norm(phase):
        return "backward" if phase == "recompute" else phase
    return evidence is None or norm(evidence) == norm(final)


def _is_optimizer_order(found: OriginFinding) -> bool:
    """An order finding over what the optimizer holds in its parameter order: the gradients it
    is given and its parameters and state after the step (traced ``reduce:N``/``optimizer:N``,
    or zero-code recording's ``grads``, ``params`` and ``optimizer`` records)."""
    if found.category == "phase":
        return (found.event_id or "").startswith(("reduce:", "optimizer:"))
    phase = (found.phase or "").rpartition(".")[2]
    return found.category == "record" and phase in AFTER_OPTIMIZER_STEP


def _some(labels: list[str], n: int = 4) -> str:
    return ", ".join(labels[:n]) + (f", ... ({len(labels)} in all)" if len(labels) > n else "")


def _control_flow(finding: OriginFinding) -> ControlFlow:
    return ControlFlow(finding.step, finding.rank, finding.parted or finding.detail)
