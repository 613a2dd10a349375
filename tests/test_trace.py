"""Tracing rungs, ids, the noise filter and origin classification, in one process (fast).

End-to-end bisection over subprocesses is in test_bisect.py.
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist
import pytest

import samebits
from samebits.trace import EventSpec, TraceConfig, attach, attach_from_env, compare_elements, find_origins
from samebits.trace import TraceProbe as probe
from samebits.trace._config import parse_record, split_op_id
from samebits.trace._tracer import active


class Scale(torch.nn.Module):
    def forward(self, x):
        buffer = torch.empty_like(x)  # uninitialised: must never be recorded
        buffer.fill_(0.5)
        return x * buffer


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), Scale(), torch.nn.Linear(8, 2))


def train(directory, config: TraceConfig | None, *, steps=3, model=None, extra=None):
    """A tiny explicit training loop traced with `attach`; returns the run directory."""
    model = model or make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    rec = samebits.Recorder(directory, rank=0, world_size=1)
    tracer = attach(model, rec, config) if config is not None else attach_from_env(model, rec)
    try:
        for step in range(steps):
            with tracer.step(step):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                loss = model(x).square().mean()
                if extra is not None:
                    loss = extra(step, loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.metrics(step, loss=loss.detach())
                rec.end_step(step)
    finally:
        tracer.close()
        rec.close()
    return directory


def records(directory, step=0, rank=0):
    for block in samebits.open_run(directory).stream(rank).steps():
        if block.step == step:
            return block.records()
    return []


def traced(recs):
    return [(parse_record(r.phase, r.name), r) for r in recs if parse_record(r.phase, r.name)]


# -- configuration ---------------------------------------------------------------------------


def test_config_from_environment_and_back():
    env = {"SAMEBITS_TRACE": "ops", "SAMEBITS_TRACE_STEPS": "3", "SAMEBITS_TRACE_RANKS": "0,2-3",
           "SAMEBITS_TRACE_MODULE": "layers.1", "SAMEBITS_TRACE_STACK": "1",
           "SAMEBITS_TEST_PERTURB": "step=2,rank=1,op=aten::mm:3", "SAMEBITS_TRACE_STOP_AFTER": "3"}
    config = TraceConfig.from_env(env)
    assert (config.level, config.step_start, config.step_stop) == (3, 3, 4)
    assert config.ranks == {0, 2, 3} and config.module == "layers.1" and config.call_sites
    assert config.perturb == EventSpec(2, 1, "aten::mm:3") and config.perturb.is_global_op_count
    assert TraceConfig.from_env(config.to_env()) == config
    assert config.in_subtree("layers.1.ffn") and not config.in_subtree("layers.10")
    assert not TraceConfig.from_env({}).enabled


@pytest.mark.parametrize("env, words", [
    ({"SAMEBITS_TRACE": "everything"}, "phases, modules, ops"),
    ({"SAMEBITS_TRACE": "ops", "SAMEBITS_TRACE_STEPS": "x"}, "START:STOP"),
    ({"SAMEBITS_TEST_PERTURB": "step=1,rank=0"}, "needs step=, rank= and id="),
    ({"SAMEBITS_TRACE_DUMP_OP": "step=1,rank=0,id=a/aten::mm:0,phase=sideways"}, "phase must be one of"),
])
def test_config_errors_name_the_variable_and_the_fix(env, words):
    with pytest.raises(ValueError, match=words):
        TraceConfig.from_env(env)


def test_record_names_parse_back():
    ref = parse_record("trace:op:backward", "layers.1.ffn/aten::index_put:0|out:0")
    assert ref.category == "op" and ref.training_phase == "backward" and ref.role == "out"
    assert split_op_id(ref.event_id) == ("layers.1.ffn", "aten::index_put", 0)
    assert parse_record("grads", "w") is None


# -- recording -------------------------------------------------------------------------------


def test_tracing_off_installs_nothing(tmp_path, monkeypatch):
    for name in ("SAMEBITS_TRACE", "SAMEBITS_TEST_PERTURB", "SAMEBITS_TRACE_DUMP_OP", "SAMEBITS_TRACE_STOP_AFTER"):
        monkeypatch.delenv(name, raising=False)
    backward = torch.autograd.backward
    from torch.nn.modules import module

    hooks = len(module._global_forward_pre_hooks)
    run = train(tmp_path / "off", None)
    assert torch.autograd.backward is backward and len(module._global_forward_pre_hooks) == hooks
    assert not traced(records(run))


def test_rung_three_records_every_phase_with_scoped_ids(tmp_path):
    run = train(tmp_path / "a", TraceConfig(level=3))
    refs = traced(records(run, step=0))
    categories = {(ref.category, ref.training_phase) for ref, _ in refs}
    assert {("state", "init"), ("phase", "forward"), ("phase", "backward"), ("phase", "reduce"),
            ("phase", "optimizer"), ("module", "backward"), ("op", "forward"), ("op", "backward"),
            ("op", "optimizer")} <= categories
    # module forward records would repeat tensors the ops already recorded: none at rung 3
    assert ("module", "forward") not in categories
    ids = {ref.event_id for ref, _ in refs if ref.category == "op"}
    assert {"0/aten::addmm:0", "1/aten::tanh:0", "2/aten::mul:0", "3/aten::addmm:0", "0/aten::mm:0"} <= ids
    # the noise filter: empty_like's output is never recorded, nor fill_'s garbage input
    assert not any("empty" in i for i in ids)
    assert [ref.role for ref, _ in refs if ref.event_id == "2/aten::fill_:0"] == ["out"]
    # each tensor version once: tanh's input is addmm's output, so tanh records no input
    assert [ref.role for ref, _ in refs if ref.event_id == "1/aten::tanh:0"] == ["out"]
    # later steps have no initial-state records, and their ids restart
    later = {ref.event_id for ref, _ in traced(records(run, step=1))}
    assert "params" not in later and "0/aten::addmm:0" in later


def test_rung_two_records_modules_by_fqn_and_call(tmp_path):
    model = make_model()
    model.append(model[1])  # Tanh called twice: calls 0 and 1
    run = train(tmp_path / "a", TraceConfig(level=2), model=model, steps=1)
    ids = {(ref.event_id, ref.training_phase, ref.role) for ref, _ in traced(records(run))
           if ref.category == "module"}
    assert {("1:0", "forward", "out"), ("1:1", "forward", "out"), ("0:0", "forward", "out"),
            ("3:0", "backward", "in"), ("3:0", "backward", "out"), ("3.weight@grad", "backward", "out")} <= ids
    assert not any(ref.category == "op" for ref, _ in traced(records(run)))


def test_gradient_accumulation_returns_to_forward(tmp_path):
    model = make_model()

    def second_micro_batch(step, loss):  # the first micro-batch's backward, then a forward again
        loss.backward()
        return model(torch.ones(5, 4)).sum()

    run = train(tmp_path / "a", TraceConfig(level=1), model=model, extra=second_micro_batch, steps=1)
    forwards = [(ref.event_id, ref.training_phase) for ref, _ in traced(records(run))
                if ref.category == "phase" and ref.event_id.startswith("forward/") and ref.role == "out"]
    assert forwards == [("forward/model:0", "forward"), ("forward/model:1", "forward")]


def test_step_window_and_module_subtree(tmp_path):
    run = train(tmp_path / "a", TraceConfig(level=3, step_start=1, step_stop=2, module="3"))
    assert not traced(records(run, step=0)) and not traced(records(run, step=2))
    refs = traced(records(run, step=1))
    scopes = {split_op_id(ref.event_id)[0] for ref, _ in refs if ref.category == "op"}
    assert scopes == {"3"}
    assert {ref.event_id for ref, _ in refs if ref.category == "module"} >= {"3:0", "3.weight@grad"}


def test_recomputation_is_marked(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    run = train(tmp_path / "a", TraceConfig(level=3), model=Checkpointed(), steps=1)
    phases = {ref.training_phase for ref, _ in traced(records(run)) if ref.category in ("op", "module")}
    assert "recompute" in phases


def test_probe_records_a_boundary(tmp_path):
    @probe("custom_kernel")
    def kernel(x):
        return x.exp()

    def extra(step, loss):
        with probe("block", loss) as p:
            out = kernel(loss) - 1
            p.outputs(out)
        return out

    run = train(tmp_path / "a", TraceConfig(level=2), extra=extra, steps=1)
    ids = {ref.event_id for ref, _ in traced(records(run)) if ref.category == "probe"}
    assert ids == {"/probe:custom_kernel:0", "/probe:block:0"}


class RawKernel(torch.nn.Module):
    """Writes memory without an ATen op (as a Triton kernel does) on its `nudge_call`-th call."""

    def __init__(self, nudge_call=None, probed=False):
        super().__init__()
        self.nudge_call, self.probed, self.calls = nudge_call, probed, 0

    def kernel(self, y):
        if self.calls == self.nudge_call:
            y.detach().numpy()[0, 0] += 1e-3
        return y

    def forward(self, x):
        self.calls += 1
        y = x * 2
        y = probe("raw_kernel")(self.kernel)(y) if self.probed else self.kernel(y)
        return y + 1


@pytest.mark.parametrize("probed, origin_id", [(False, "4/aten::add:0"), (True, "4/probe:raw_kernel:0")])
def test_a_kernel_below_the_dispatcher_shows_one_hop_later_unless_probed(tmp_path, probed, origin_id):
    def model(nudge):
        net = make_model()
        net.append(RawKernel(nudge_call=nudge, probed=probed))
        return net

    clean = train(tmp_path / "a", TraceConfig(level=3), model=model(None))
    nudged = train(tmp_path / "b", TraceConfig(level=3), model=model(2))
    origin = find_origins(clean, nudged).first
    assert (origin.classification, origin.step, origin.event_id) == ("origin", 1, origin_id)


# -- origins ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, phase, op_id", [
    ("step=1,rank=0,op=0/aten::addmm:0", "forward", "0/aten::addmm:0"),
    ("step=1,rank=0,op=aten::mm:1", "backward", "3/aten::mm:1"),       # global count: 2nd mm of the step
    ("step=2,rank=0,op=/aten::addcdiv_:1,phase=optimizer", "optimizer", "/aten::addcdiv_:1"),
])
def test_a_perturbed_op_is_the_origin(tmp_path, spec, phase, op_id):
    clean = train(tmp_path / "a", TraceConfig(level=3))
    nudged = train(tmp_path / "b", TraceConfig(level=3, perturb=EventSpec.parse(spec, "test")))
    report = find_origins(clean, nudged)
    origin = report.first
    assert origin.classification == "origin" and report.origins == [origin]
    assert (origin.step, origin.rank, origin.phase, origin.event_id) == (int(spec[5]), 0, phase, op_id)
    assert origin.op == split_op_id(op_id)[1] and origin.module == split_op_id(op_id)[0]


def test_trace_command_prints_origins(tmp_path, capsys):
    from samebits.cli import main

    clean = train(tmp_path / "a", TraceConfig(level=3))
    nudged = train(tmp_path / "b", TraceConfig(level=3, perturb=EventSpec(1, 0, "0/aten::addmm:0")))
    assert main(["trace", str(clean), str(clean)]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    assert main(["trace", str(clean), str(nudged)]) == 1
    out = capsys.readouterr().out
    assert "origins, earliest first:" in out and "rank 0, step 1, phase forward, module 0, op aten::addmm" in out


def test_untraced_code_makes_a_receiver(tmp_path):
    # Perturb an op in module 0 but trace only module 3's subtree: module 3's input already
    # differs when it arrives.
    config = TraceConfig(level=3, module="3")
    clean = train(tmp_path / "a", config)
    nudged = train(tmp_path / "b", config.with_(perturb=EventSpec(1, 0, "0/aten::addmm:0")))
    finding = find_origins(clean, nudged).first
    assert finding.classification == "receiver" and finding.role == "in"
    assert (finding.category, finding.event_id, finding.module) == ("module", "3:0", "3")
    assert not find_origins(clean, nudged).origins


def test_identical_runs_and_a_different_initialisation(tmp_path):
    a = train(tmp_path / "a", TraceConfig(level=1))
    b = train(tmp_path / "b", TraceConfig(level=1))
    assert find_origins(a, b).identical
    model = make_model()
    with torch.no_grad():
        model[0].bias[0] += 1e-3
    c = train(tmp_path / "c", TraceConfig(level=1), model=model)
    origin = find_origins(a, c).first
    assert (origin.classification, origin.category, origin.phase, origin.step) == ("origin", "state", "init", 0)
    assert origin.label == "0.bias" and origin.module == "0"


def test_different_op_sequences_report_where_they_part(tmp_path):
    a = train(tmp_path / "a", TraceConfig(level=3))
    b = train(tmp_path / "b", TraceConfig(level=3),
              extra=lambda step, loss: loss * 1.5 if step == 1 else loss)
    finding = find_origins(a, b).first
    assert finding.classification == "control_flow" and finding.step == 1
    assert "/aten::mul:0" in finding.detail and "part at record" in finding.detail


def _write_traced(directory, rank, records_by_phase):
    with samebits.Recorder(directory, rank=rank, world_size=2) as rec:
        for phase, named in records_by_phase:
            rec.tensors(0, phase, named)


def test_a_collective_is_an_origin_only_if_every_ranks_inputs_matched(tmp_path):
    same, other = torch.ones(3), torch.full((3,), 2.0)
    ar = "world/all_reduce:0"
    for run, rank0_input, rank1_output in (("a", same, same), ("b", other, other), ("c", same, other)):
        _write_traced(tmp_path / run, 0, [("trace:collective:reduce", [(f"{ar}|in:0", rank0_input)]),
                                           ("trace:collective:reduce", [(f"{ar}|out:0", same)])])
        _write_traced(tmp_path / run, 1, [("trace:collective:reduce", [(f"{ar}|in:0", same)]),
                                           ("trace:collective:reduce", [(f"{ar}|out:0", rank1_output)])])
    # b: rank 0's input already differed, so rank 1 only received it
    report = find_origins(tmp_path / "a", tmp_path / "b")
    assert report.findings[0].classification == "receiver"
    assert (report.findings[1].classification, report.findings[1].from_rank) == ("receiver", 0)
    # c: every input matched, rank 1's output differs: the collective is the origin there
    report = find_origins(tmp_path / "a", tmp_path / "c")
    assert [(f.rank, f.op, f.classification) for f in report.origins] == [(1, "all_reduce", "origin")]


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional:FutureWarning")
def test_collectives_are_recorded_around_the_call(tmp_path, world_of_one):
    import torch.distributed.nn.functional as dist_nn

    def extra(step, loss):
        flat = torch.ones(4)
        dist.all_reduce(flat)
        work = dist.all_reduce(flat, async_op=True)
        work.wait()
        gathered = [torch.zeros(4)]
        dist.all_gather(gathered, flat)
        return dist_nn.all_reduce(loss)

    run = train(tmp_path / "a", TraceConfig(level=1), extra=extra, steps=1)
    roles = [(ref.event_id, ref.role) for ref, _ in traced(records(run)) if ref.category == "collective"]
    assert roles[:6] == [("world/all_reduce:0", "in"), ("world/all_reduce:0", "out"),
                         ("world/all_reduce:1", "in"), ("world/all_reduce:1", "out"),
                         ("world/all_gather:0", "in"), ("world/all_gather:0", "out")]
    assert ("world/all_reduce:2", "out") in roles  # torch.distributed.nn.functional's, too
    assert not hasattr(dist.all_reduce, "_samebits_original")  # closing the tracer unpatched it


def test_dump_saves_the_named_op(tmp_path):
    spec = EventSpec(1, 0, "3/aten::addmm:0")
    run = train(tmp_path / "a", TraceConfig(level=3, dump=spec, call_sites=True))
    saved = torch.load(run / "dump-rank-00000-step-1.pt", weights_only=True)
    assert saved["id"] == "3/aten::addmm:0" and saved["outputs"]["0"].shape == (5, 2)
    assert saved["call_site"].endswith("in train")
    assert active() is None


# -- element detail --------------------------------------------------------------------------


def test_elements_count_differences_in_ulps():
    a = torch.tensor([1.0, -2.0, 0.0, 3.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(-10.0))
    b[3] = torch.nextafter(torch.nextafter(b[3], torch.tensor(10.0)), torch.tensor(10.0))
    b[2] = -0.0  # a different bit pattern, but no ulp apart
    detail = compare_elements(a, b)
    assert (detail["differing"], detail["total"], detail["max_ulp"]) == (3, 4, 2)
    assert detail["first_indices"] == [[1], [2], [3]] and [v["ulp"] for v in detail["values"]] == [1, 0, 2]
    half = compare_elements(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0078125], dtype=torch.bfloat16))
    assert half["max_ulp"] == 1
    ints = compare_elements(torch.tensor([[1, 5]]), torch.tensor([[1, 9]]))
    assert (ints["differing"], ints["max_ulp"], ints["first_indices"]) == (1, 4, [[0, 1]])


# -- the state census, same values in another order, nothing compared -------------------------


def test_the_census_is_context_never_an_origin(tmp_path):
    """An unused, differently seeded Python `random` changes the census at every step start:
    that alone is no divergence; a dropout drawing from a reseeded torch generator is an
    origin op, with the generator named as the state that differed."""
    import random

    def dropout(step, loss):
        return torch.nn.functional.dropout(loss.expand(8), 0.5).sum()

    runs = []
    for seed in (1, 2):
        random.seed(seed)
        torch.manual_seed(0)
        model = make_model()
        torch.manual_seed(10)
        runs.append(train(tmp_path / f"py{seed}", TraceConfig(level=1), model=model))
    report = find_origins(*runs)
    assert report.identical and report.verdict == "identical"
    runs = []
    for seed in (3, 4):
        torch.manual_seed(0)
        model = make_model()
        torch.manual_seed(seed)  # the dropout masks come from here
        runs.append(train(tmp_path / f"torch{seed}", TraceConfig(level=3), model=model, extra=dropout))
    finding = find_origins(*runs).first
    assert finding.classification == "origin" and finding.step == 0
    assert finding.category == "op" and finding.op in ("aten::bernoulli_", "aten::native_dropout")
    assert "rng.torch_cpu" in finding.state_differs and "rng.python" not in finding.state_differs


def test_same_values_tells_a_permutation_from_other_values():
    from samebits.trace._elements import same_values

    a = torch.tensor([1.0, -0.0, 2.5, 3.0])
    assert same_values(a, a.flip(0)) and same_values(a, a)
    assert not same_values(a, torch.tensor([1.0, 0.0, 2.5, 3.0]))  # -0 and +0 are other bits
    assert not same_values(a, torch.tensor([1.0, -0.0, 2.5, 3.0000002]))
    assert not same_values(a, a.double())


def test_nothing_compared_is_incomplete_never_identical(tmp_path, capsys):
    from samebits.cli import main

    empty = []
    for name in ("a", "b"):
        rec = samebits.Recorder(tmp_path / name, rank=0, world_size=1)
        rec.close()
        empty.append(tmp_path / name)
    report = find_origins(*empty)
    assert report.verdict == "incomplete" and not report.identical and "nothing was compared" in report.notes[0]
    assert main(["trace", str(empty[0]), str(empty[1])]) == 2
    assert "INCOMPLETE" in capsys.readouterr().out


def test_collectives_issued_in_another_order_are_told_apart(tmp_path):
    """The same tensors reduced in another order (a Python set of buckets) are "permuted";
    other tensors are not."""
    first, second, third = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 3.0)
    for run, order in (("a", (first, second)), ("b", (second, first)), ("c", (third, first))):
        _write_traced(tmp_path / run, 0, [("trace:collective:reduce", [(f"world/all_reduce:{i}|in:tensor", t)])
                                          for i, t in enumerate(order)])
    permuted = find_origins(tmp_path / "a", tmp_path / "b").first
    assert (permuted.classification, permuted.category, permuted.permuted) == ("receiver", "collective", True)
    assert "same tensors in another order" in permuted.detail
    assert not find_origins(tmp_path / "a", tmp_path / "c").first.permuted


def test_an_op_given_the_same_tensors_in_another_order_is_told_apart(tmp_path):
    """`torch.cat` over tensors in an order that changes (a Python set): the op's inputs are
    the same tensors, permuted, so the finding is "permuted", not an unexplained receiver."""
    parts = [torch.full((3,), float(i)) for i in range(3)]  # written before the step: untraced

    def concat(order):
        def extra(step, loss):
            return loss + torch.cat([parts[i] for i in order]).mul(torch.arange(9.0)).sum() * 1e-3
        return extra

    runs = [train(tmp_path / name, TraceConfig(level=3), extra=concat(order), steps=1)
            for name, order in (("a", (0, 1, 2)), ("b", (2, 0, 1)))]
    finding = find_origins(*runs).first
    assert (finding.op, finding.classification, finding.permuted) == ("aten::cat", "receiver", True)
    assert "same tensors in both runs, in another order" in finding.detail


def test_replicas_that_differ_are_found_and_shards_are_not(tmp_path):
    """A parameter whose reduced gradient is the same on every rank is a replica: different
    values across ranks are a fault.  One whose gradient differs per rank is a shard."""
    from samebits.trace._origin import find_replica_mismatch

    same, other = torch.ones(3), torch.full((3,), 2.0)
    for rank, value in ((0, same), (1, other)):
        _write_traced(tmp_path / "run", rank, [
            ("trace:state:init", [("params|out:dense.weight", value), ("params|out:expert.weight", value)]),
            ("trace:phase:reduce", [("reduce:0|out:dense.weight", same), ("reduce:0|out:expert.weight", value)])])
    mismatch = find_replica_mismatch(tmp_path / "run")
    assert (mismatch.step, mismatch.ranks, mismatch.params) == (0, [0, 1], ["dense.weight"])
    for rank in (0, 1):
        _write_traced(tmp_path / "equal", rank, [("trace:state:init", [("params|out:dense.weight", same)]),
                                                 ("trace:phase:reduce", [("reduce:0|out:dense.weight", same)])])
    assert find_replica_mismatch(tmp_path / "equal") is None


def test_keyword_inputs_of_the_model_are_recorded(tmp_path):
    """`model(**batch)` (as HF Trainer calls it): a batch that differs is seen at the model's
    forward input, keyword by keyword."""

    class Keywords(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model()

        def forward(self, *, features):
            return self.inner(features)

    runs = []
    for name, offset in (("a", 0.0), ("b", 1e-3)):
        torch.manual_seed(0)
        model = Keywords()
        rec = samebits.Recorder(tmp_path / name, rank=0, world_size=1)
        tracer = attach(model, rec, TraceConfig(level=1))
        with tracer.step(0):
            model(features=torch.ones(5, 4) + offset).sum().backward()
            rec.end_step(0)
        tracer.close()
        rec.close()
        runs.append(tmp_path / name)
    finding = find_origins(*runs).first
    assert (finding.category, finding.role, finding.label) == ("phase", "in", "features")
    assert finding.event_id.startswith("forward/")


# -- one comparison engine, Recorder hooks, suspended work, shared helpers (issue 10) ---------


def test_a_step_where_only_the_census_differs_gives_way_to_the_next(tmp_path):
    """`divergent_steps` yields a rank's first divergent step; one where only the census
    differs is context, so find_origins goes on to that rank's next divergent step."""
    for run, rng, late in (("a", 1.0, 1.0), ("b", 2.0, 3.0)):
        with samebits.Recorder(tmp_path / run, rank=0, world_size=1) as rec:
            for step in range(3):
                rec.tensors(step, "trace:census:start", [("census|at:rng.python", torch.full((2,), rng))])
                rec.tensors(step, "trace:op:forward", [("/aten::mm:0|in:0", torch.ones(2)),
                                                       ("/aten::mm:0|out:0", torch.full((2,), late if step == 2 else 1.0))])
    finding = find_origins(tmp_path / "a", tmp_path / "b").first
    assert (finding.step, finding.classification, finding.op) == (2, "origin", "aten::mm")
    assert finding.state_differs == ["rng.python"]
    assert find_origins(tmp_path / "a", tmp_path / "b", step=1).verdict == "identical"


def test_a_collective_checks_the_inputs_of_a_rank_that_diverged_earlier(tmp_path):
    """Rank 1 parts at step 0; at step 1 its input to the all_reduce differs, so rank 0 (own
    inputs equal, output different) only received it: that step of rank 1 is read to know."""
    ar = "world/all_reduce:0"
    for run, delta in (("a", 0.0), ("b", 1.0)):
        for rank in (0, 1):
            with samebits.Recorder(tmp_path / run, rank=rank, world_size=2) as rec:
                for step in (0, 1):
                    if rank == 1:
                        rec.tensors(step, "grads", [("w", torch.full((2,), delta))])
                    own = delta if (rank == 1 and step == 1) else 0.0
                    rec.tensors(step, "trace:collective:reduce", [
                        (f"{ar}|in:0", torch.full((3,), 1.0 + own)),
                        (f"{ar}|out:0", torch.full((3,), 2.0 + (delta if step == 1 else 0.0)))])
    report = find_origins(tmp_path / "a", tmp_path / "b")
    assert (report.findings[1].step, report.findings[1].classification) == (0, "untraced")
    assert (report.findings[0].step, report.findings[0].classification, report.findings[0].from_rank) == \
        (1, "receiver", 1)
    assert not report.origins


def test_recorder_hooks_run_around_end_step_and_come_off(tmp_path):
    calls, entered = [], []
    rec = samebits.Recorder(tmp_path / "r", rank=0, world_size=1)

    class Work:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            pass

    work = rec.around_own_work(Work)
    hook = rec.on_end_step(before=lambda step: rec.tensors(0, "late", [("x", torch.ones(1))]),
                           after=lambda step: calls.append(step))
    rec.tensors(0, "early", [("y", torch.ones(1))])
    rec.metrics(0, loss=1.5)
    assert len(entered) == 2  # tensors and metrics ran inside the context
    rec.end_step(0)
    assert calls == [0]
    hook.remove()
    work.remove()
    hook.remove()  # idempotent
    rec.tensors(1, "early", [("y", torch.ones(1))])
    rec.end_step(1)
    rec.close()
    assert calls == [0] and len(entered) == 3  # the before hook's tensors call, still hooked
    assert {r.phase for r in records(tmp_path / "r", step=0)} == {"early", "late", "metrics"}


def test_suspended_work_is_neither_traced_nor_counted(tmp_path):
    """Torch work samebits does inside a traced step (a recorder's copies, zero-code
    recording's census, work run in ``tracer.suspended()``) leaves no op record and shifts no
    id; the same work outside suspended() is traced like the program's."""
    def own_work(suspend):
        def extra(step, loss):
            tracer = active()
            with tracer.suspended() if suspend else contextlib.nullcontext():
                torch.ones(3).mul(2).sum()
            return loss
        return extra

    plain = train(tmp_path / "plain", TraceConfig(level=3), steps=1)
    quiet = train(tmp_path / "quiet", TraceConfig(level=3), steps=1, extra=own_work(True))
    loud = train(tmp_path / "loud", TraceConfig(level=3), steps=1, extra=own_work(False))
    names = [[(r.phase, r.name) for r in records(run)] for run in (plain, quiet, loud)]
    assert names[0] == names[1]
    assert names[2] != names[0] and any("/aten::mul:" in name for _, name in names[2])
    # the loop's own rec.metrics(loss) after the optimizer step copies a tensor: never traced
    assert not [name for phase, name in names[0] if phase == "trace:op:post"]
    # nor the state census a loop records itself (its ops read this process's RNG states)
    from samebits.checkpoint import state_census

    census = train(tmp_path / "census", TraceConfig(level=3), steps=1, extra=lambda step, loss: state_census() and loss)
    assert [(r.phase, r.name) for r in records(census)] == names[0]


def test_old_names_are_gone():
    import samebits.determinism as det
    import samebits.trace as tr

    # no compatibility aliases for a version never released (issue 36)
    assert not hasattr(tr, "probe") and not hasattr(tr, "Finding") and not hasattr(det, "Finding")
    assert "probe" in samebits.__all__ and samebits.probe is det.probe  # the op-twice probe keeps its name


def test_bisect_origin_serialises_to_the_documented_shape():
    from samebits.runners.bisect import ControlFlow, Origin

    origin = Origin(kind="op", conclusion="origin: ...", step=0, rank=1, phase="backward", module="",
                    op="aten::index_put", event_id="/aten::index_put:0", category="op", classification="origin",
                    detail="why", state_differs=["rng.torch_cpu"], state_differs_all=["rng.torch_cpu", "rng.python"])
    assert list(origin.to_dict()) == ["kind", "conclusion", "step", "rank", "phase", "module", "op", "id",
                                      "category", "classification", "call_site", "elements", "catalog",
                                      "detail", "state_differs", "state_differs_all"]
    assert origin.to_dict()["id"] == "/aten::index_put:0"
    assert ControlFlow(2, 0, "parted").to_dict() == {"step": 2, "rank": 0, "detail": "parted"}


def test_shared_torch_helpers(monkeypatch):
    import collections
    import dataclasses

    from samebits import _torchutil as tu

    x = torch.ones(2)

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: tuple

    class ModelOutput(collections.OrderedDict):  # like HF's: a mapping pytree may not key
        pass

    Pair = collections.namedtuple("Pair", "first second")
    labels = lambda value, prefix="": [label for label, _ in tu.tensor_leaves(value, prefix)]  # noqa: E731
    assert labels(x) == [""] and labels(x, "Model") == ["Model"]
    assert labels((x, [x, {"k": x, "n": 3}])) == ["0", "1.0", "1.1.k"]
    assert labels(Out(x, (x, None)), "M") == ["M.logits", "M.extra.0"]
    assert labels(ModelOutput(loss=x, hidden=(x,))) == ["loss", "hidden.0"]
    assert labels(Pair(x, x)) == ["first", "second"]
    assert tu.op_tensor_args((x, [x, 1.0, x], 2), {"out": x}) == [("0", x), ("1.0", x), ("1.2", x), ("out", x)]
    assert tu.op_tensor_outputs((x, None, x)) == [("0", x), ("2", x)]
    assert all(tu.is_uninitialized_op(n) for n in ("aten::empty_like", "aten::new_empty_strided",
                                                   "aten::_empty_affine_quantized", "aten::resize_", "aten::set_"))
    assert not any(tu.is_uninitialized_op(n) for n in ("aten::mm", "aten::zeros_like", "aten::fill_"))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    assert [n for n, _ in tu.optimizer_params(opt, {id(model.weight): "weight"})] == ["weight", "group1.param0"]
    if dist.is_initialized():  # a process group (another test's) decides first
        assert tu.process_rank() == dist.get_rank() and tu.rank_and_world_size()[1] == dist.get_world_size()
    monkeypatch.setattr(tu, "_distributed_rank_world", lambda group=None: None)  # then the launcher's variables
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert tu.process_rank() is None and tu.rank_and_world_size() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert tu.process_rank() == 3 and tu.rank_and_world_size() == (3, 4)
    # Code that runs collectives asks the process group only: without one it is alone.
    assert tu.group_rank_and_world_size() == (0, 1)
    monkeypatch.setattr(tu, "_distributed_rank_world", lambda group=None: (1, 2) if group == "pair" else (5, 8))
    assert tu.group_rank_and_world_size("pair") == (1, 2) and tu.group_rank_and_world_size() == (5, 8)
    site = tu.call_site(1)
    assert site.startswith(__file__) and site.endswith("in test_shared_torch_helpers")
    assert tu.call_site(1, skip=(__file__,)) != site


# -- a step's "pre" work, list provenance, reordered records, views (issue 24) ------------------


def _step_with_pre_work(directory, *, level=3, pre=None, optimizer_site=None, version_bump=False, call_sites=False):
    """One traced step of an explicit loop that does work before its first forward (``pre``)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = samebits.Recorder(directory, rank=0, world_size=1)
    tracer = attach(model, rec, TraceConfig(level=level, call_sites=call_sites))
    if optimizer_site is not None:
        tracer.note_optimizer(opt, optimizer_site)
    x = torch.ones(5, 4)
    if version_bump:
        x.add_(1.0)  # written before the step (as torch.load's set_ does): version 1
    try:
        with tracer.step(0):
            if pre is not None:
                pre()
            bias = torch.full((2,), 0.5).add(0.25)  # made before the first forward, used after it
            out = model(x)
            loss = (out + bias).square().mean() + x.view(-1).sum() * 0
            loss.backward()
            opt.step()
            rec.end_step(0)
    finally:
        tracer.close()
        rec.close()
    return directory


def test_work_before_the_first_forward_is_phase_pre_and_recorded_again_after_it(tmp_path):
    """The ops before a step's first forward (the previous iteration's logging, a resumed
    process's start-up) are phase "pre", counted apart; what they made is recorded again
    where it is first used after it, so the phases after "pre" stand on their own."""
    refs = traced(records(_step_with_pre_work(tmp_path / "a")))
    pre = [(ref.event_id, ref.role) for ref, _ in refs if ref.training_phase == "pre"]
    assert ("/aten::add:0", "out") in pre
    forward_add = [ref.label for ref, _ in refs if ref.category == "op" and ref.training_phase == "forward"
                   and ref.event_id == "/aten::add:0" and ref.role == "in"]
    assert "1" in forward_add  # bias: recorded in "pre", recorded again as the forward add's input


def test_a_view_of_a_tensor_written_before_the_step_counts_as_seen(tmp_path):
    """Inside the dispatch mode a view's version is not yet its base's: a view of a tensor at
    version 1 (loaded from a checkpoint) must not be taken for an unseen tensor."""
    refs = traced(records(_step_with_pre_work(tmp_path / "a", version_bump=True)))
    assert not [ref for ref, _ in refs if ref.category == "op" and ref.role == "in" and ref.label == "0"
                and ref.event_id.startswith("/aten::sum")]  # x.view(-1): seen at the forward's input


def test_a_resume_step_is_compared_without_its_pre_work(tmp_path):
    """b resumed at step 2: a's "pre" holds the tail of step 1 (logging), b's its start-up.
    Aligned on the phases, the optimizer is where they part, and a note says what was dropped."""
    for run, pre, update in (("a", ("/aten::_local_scalar_dense:0|in:0", torch.ones(())), 1.0),
                             ("b", ("/aten::randint:0|out:0", torch.arange(4)), 2.0)):
        with samebits.Recorder(tmp_path / run, rank=0, world_size=1) as rec:
            rec.tensors(2, "trace:op:pre", [pre])
            rec.tensors(2, "trace:phase:forward", [("forward/model:0|in:0", torch.ones(3))])
            rec.tensors(2, "trace:phase:reduce", [("reduce:0|out:w", torch.ones(3))])
            rec.tensors(2, "trace:phase:optimizer", [("optimizer:0|out:w", torch.full((3,), update))])
    assert find_origins(tmp_path / "a", tmp_path / "b").first.classification == "control_flow"
    report = find_origins(tmp_path / "a", tmp_path / "b", resume_step=2)
    finding = report.first
    assert (finding.classification, finding.phase, finding.event_id) == ("origin", "optimizer", "optimizer:0")
    assert any("phase pre" in note and "a's 1" in note and "b's 1" in note for note in report.notes)


def test_a_list_given_in_another_order_is_permuted_never_all_inputs_matched(tmp_path):
    """Tensors recorded before an op are not recorded again as its inputs; a list argument's
    provenance (@set, @order) tells the same tensors in another order (a set-ordered
    parameter list fed to clip_grad_norm_'s _foreach_norm) from other tensors."""
    def run(name, order):
        def extra(step, loss):
            parts = [loss * 1.0, loss * 2.0, loss * 3.0]  # outputs of traced ops: seen
            return loss + torch.stack([parts[i] for i in order]).mul(torch.arange(3.0)).sum() * 1e-3
        return train(tmp_path / name, TraceConfig(level=3), extra=extra, steps=1)

    a, b, c = run("a", (0, 1, 2)), run("b", (2, 0, 1)), run("c", (0, 0, 2))
    finding = find_origins(a, b).first
    assert (finding.op, finding.classification, finding.permuted, finding.label) == \
        ("aten::stack", "receiver", True, "0@order")
    assert "holds the same 3 tensors as in the other run" in finding.detail
    assert "all inputs" not in finding.detail
    other = find_origins(a, c).first
    assert (other.op, other.label, other.permuted) == ("aten::stack", "0@set", False)
    assert "holds other tensors" in other.detail


def test_records_in_another_order_say_what_was_reordered(tmp_path):
    """The optimizer's parameters in another order (param groups from a set): same records,
    same values; the finding names the event that holds them and both orders."""
    for run, names in (("a", ("w1", "w2", "w3")), ("b", ("w3", "w1", "w2"))):
        with samebits.Recorder(tmp_path / run, rank=0, world_size=1) as rec:
            rec.tensors(0, "trace:phase:forward", [("forward/model:0|out:0", torch.ones(2))])
            rec.tensors(0, "trace:phase:reduce", [(f"reduce:0|out:{n}", torch.full((2,), float(n[1])))
                                                  for n in names])
    finding = find_origins(tmp_path / "a", tmp_path / "b").first
    assert (finding.classification, finding.category, finding.event_id, finding.phase) == \
        ("order", "phase", "reduce:0", "reduce")
    assert finding.reordered == {"group": "phase reduce:0 (reduce, out)", "a": ["w1", "w2", "w3"],
                                 "b": ["w3", "w1", "w2"]}


def test_the_optimizer_is_in_the_census_from_its_construction(tmp_path):
    """Zero-code recording tells the tracer of an optimizer when it is built: a resumed process's
    first census (before its first optimizer step) has its step counts and lrs, and the
    optimizer's phase events get the site where it was built."""
    run = _step_with_pre_work(tmp_path / "a", level=1, optimizer_site="train.py:7 in build", call_sites=True)
    census = {ref.label for ref, _ in traced(records(run)) if ref.category == "census"}
    assert {"optim0.step", "optim0.lr"} <= census
    sites = json.loads((run / "trace-rank-00000.json").read_text())["steps"]["0"]
    assert sites["reduce|reduce:0"] == sites["optimizer|optimizer:0"] == "train.py:7 in build"


def test_gradients_detached_into_grad_count_as_seen(tmp_path):
    """Autograd `detach`es a backward op's output into ``.grad`` and drops the output: the
    gradient is still the recorded tensor, so a clip over the gradients records their
    provenance, not their values again."""
    model = make_model()
    rec = samebits.Recorder(tmp_path / "a", rank=0, world_size=1)
    tracer = attach(model, rec, TraceConfig(level=3))
    try:
        with tracer.step(0):
            model(torch.ones(5, 4)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.01)
            rec.end_step(0)
    finally:
        tracer.close()
        rec.close()
    labels = [ref.label for ref, _ in traced(records(tmp_path / "a")) if ref.event_id == "/aten::_foreach_norm:0"]
    assert labels[:2] == ["0@set", "0@order"] and not [label for label in labels if label.startswith("0.")]
