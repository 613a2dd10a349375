"""The state census: every record named, stable when nothing changes, changed by exactly
its own state, equal again once that state is restored; and the sentence for each name."""

from __future__ import annotations

import copy
import importlib.util
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

import samebits
from samebits import checkpoint
from samebits.checkpoint import STATE_PHASE, describe_state_record, state_census
from samebits.checkpoint import _census
from samebits.errors import ConfigError

BASE_NAMES = ["rng.python", "rng.numpy", "rng.torch_cpu"]
TRAINING_NAMES = ["rng.user.a_dropout", "rng.user.b_data", "optim0.step", "optim0.lr", "optim0.hparams",
                  "sched0.last_epoch", "sched0.step_count", "sched0.lr", "scaler0"]


class Training:
    """AdamW over 10 parameters, a StepLR, and two named generators."""

    def __init__(self):
        torch.manual_seed(0)
        self.params = [nn.Parameter(torch.randn(3)) for _ in range(10)]
        self.optimizer = torch.optim.AdamW(
            [{"params": self.params[:6]}, {"params": self.params[6:], "lr": 0.01}], lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.generators = {"b_data": torch.Generator().manual_seed(1),
                           "a_dropout": torch.Generator().manual_seed(2)}
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def census(self):
        return state_census(optimizers=[self.optimizer], schedulers=[self.scheduler],
                            generators=self.generators, scalers=[self.scaler], include_cuda=False)

    def scaler_step(self):
        self.scaler.scale(torch.ones(()))  # the scale exists from the first use
        self.params[0].grad = torch.full_like(self.params[0], float("inf"))
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)  # an inf gradient: the step is skipped, the scale backs off
        self.scaler.update()

    def optimizer_step(self, params=None):
        for param in params or self.params:
            param.grad = torch.ones_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _digests(records) -> dict[str, int]:
    assert len({name for name, _ in records}) == len(records), "duplicate record names"
    for name, tensor in records:
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu", name
    return {name: samebits.digest(tensor) for name, tensor in records}


def _changed(before: dict[str, int], after: dict[str, int]) -> set[str]:
    assert before.keys() == after.keys()
    return {name for name in before if before[name] != after[name]}


def test_every_record_is_named_in_a_fixed_order():
    training = Training()
    names = [name for name, _ in training.census()]
    assert names == BASE_NAMES + TRAINING_NAMES
    assert [name for name, _ in state_census(include_cuda=False)] == BASE_NAMES
    assert STATE_PHASE == "state" and checkpoint.STATE_PHASE == "state"


def test_two_identical_calls_give_equal_digests():
    training = Training()
    training.optimizer_step()
    assert _digests(training.census()) == _digests(training.census())


@pytest.mark.parametrize("change, expected", [
    (lambda t: random.random(), {"rng.python"}),
    (lambda t: np.random.rand(), {"rng.numpy"}),
    (lambda t: torch.rand(1), {"rng.torch_cpu"}),
    (lambda t: torch.rand(1, generator=t.generators["b_data"]), {"rng.user.b_data"}),
    (lambda t: torch.rand(1, generator=t.generators["a_dropout"]), {"rng.user.a_dropout"}),
    (lambda t: t.optimizer_step(), {"optim0.step"}),
    (lambda t: t.scheduler.step(), {"sched0.last_epoch", "sched0.step_count", "sched0.lr", "optim0.lr"}),
    (lambda t: t.optimizer.param_groups[1].update(weight_decay=0.5), {"optim0.hparams"}),
    (lambda t: t.optimizer.param_groups[0].update(betas=(0.8, 0.99)), {"optim0.hparams"}),
    (lambda t: t.scaler_step(), {"scaler0"}),
])
def test_each_change_alters_exactly_its_own_records(change, expected):
    training = Training()
    training.optimizer_step()  # state exists: the next step changes counts, not presence
    before = _digests(training.census())
    change(training)
    assert _changed(before, _digests(training.census())) == expected


def test_a_skipped_parameter_shows_in_the_step_counts():
    training = Training()
    before = dict(training.census())["optim0.step"]
    assert before.tolist() == [-1.0] * 10 and before.dtype == torch.float64
    training.optimizer_step(training.params[:3])  # only 3 params have grads: the rest skip
    assert dict(training.census())["optim0.step"].tolist() == [1.0] * 3 + [-1.0] * 7
    training.optimizer_step()
    assert dict(training.census())["optim0.step"].tolist() == [2.0] * 3 + [1.0] * 7


def test_restoring_every_state_makes_the_census_equal_again():
    training = Training()
    training.optimizer_step()
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             {name: gen.get_state() for name, gen in training.generators.items()},
             copy.deepcopy(training.optimizer.state_dict()), training.scheduler.state_dict(),
             training.scaler.state_dict())
    before = _digests(training.census())

    random.random(), np.random.rand(), torch.rand(1)
    for generator in training.generators.values():
        torch.rand(1, generator=generator)
    training.optimizer_step()
    training.scheduler.step()
    training.optimizer.param_groups[0]["weight_decay"] = 0.3
    training.scaler_step()
    assert _changed(before, _digests(training.census())) == set(before)

    python, numpy_state, torch_cpu, generators, optimizer, scheduler, scaler = saved
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_cpu)
    for name, state in generators.items():
        training.generators[name].set_state(state)
    training.optimizer.load_state_dict(optimizer)
    training.scheduler.load_state_dict(scheduler)  # the optimizer's state dict held its lrs
    training.scaler.load_state_dict(scaler)
    assert _digests(training.census()) == before


def test_rng_records_hold_the_cached_gaussians_and_positions():
    """Lossless: parts of the states that getstate() keeps beside the twister words."""
    random.seed(3)
    version, words, _ = random.getstate()
    random.setstate((version, words, None))
    plain = _digests(state_census(include_cuda=False))["rng.python"]
    random.setstate((version, words, 0.25))
    cached = _digests(state_census(include_cuda=False))["rng.python"]
    random.setstate((version, words, 0.5))
    assert len({plain, cached, _digests(state_census(include_cuda=False))["rng.python"]}) == 3

    np.random.seed(4)
    name, key, pos, _, _ = np.random.get_state()
    seen = set()
    for state in [(name, key, pos, 0, 0.0), (name, key, pos, 1, 0.0), (name, key, pos, 1, 0.5),
                  (name, key, (pos + 1) % 624, 0, 0.0)]:
        np.random.set_state(state)
        seen.add(_digests(state_census(include_cuda=False))["rng.numpy"])
    assert len(seen) == 4


def test_numpy_generators_are_accepted_and_tracked():
    generator = np.random.default_rng(5)
    before = _digests(state_census(generators={"np": generator}, include_cuda=False))
    generator.random()
    after = _digests(state_census(generators={"np": generator}, include_cuda=False))
    assert _changed(before, after) == {"rng.user.np"}


def test_cuda_states_are_listed_per_device_once_cuda_is_initialised(monkeypatch):
    states = {0: torch.tensor([1], dtype=torch.uint8), 1: torch.tensor([2], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[device])
    records = dict(state_census())
    assert [n for n in records if n.startswith("rng.cuda")] == ["rng.cuda:0", "rng.cuda:1"]
    assert records["rng.cuda:1"] is states[1]
    assert [n for n, _ in state_census(include_cuda=False)] == BASE_NAMES
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # never initialise it
    assert [n for n, _ in state_census()] == BASE_NAMES


def test_census_without_numpy_omits_its_record(monkeypatch):
    """numpy is optional at import: load the module with numpy blocked."""
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    spec = importlib.util.spec_from_file_location("census_without_numpy", _census.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._np is None
    assert [n for n, _ in module.state_census(include_cuda=False)] == \
        ["rng.python", "rng.torch_cpu"]


@pytest.mark.parametrize("kwargs, message", [
    ({"generators": {"jitter": 42}}, "'jitter' is a int"),
    ({"generators": {"": torch.Generator()}}, "non-empty"),
    ({"generators": [torch.Generator()]}, "dict of name"),
    ({"optimizers": [object()]}, r"optimizers\[0\]"),
    ({"schedulers": [object()]}, r"schedulers\[0\]"),
    ({"optimizers": {"adam": None}}, "must be a list or tuple"),
])
def test_bad_arguments_are_config_errors_naming_them(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        state_census(**kwargs)


def test_one_optimizer_not_in_a_list_is_a_config_error():
    optimizer = Training().optimizer
    with pytest.raises(ConfigError, match=r"optimizers=\[x\]"):
        state_census(optimizers=optimizer)


@pytest.mark.parametrize("name, sentence", [
    ("rng.torch_cpu", "torch CPU RNG state differs at step start: seeded from something that "
                      "changes, or not restored on resume"),
    ("rng.python", "Python `random` state differs at step start: "),
    ("rng.numpy", "NumPy global random state"),
    ("rng.cuda:3", "torch CUDA RNG state of device 3 differs at step start"),
    ("rng.user.router_jitter", "generator 'router_jitter' state differs at step start"),
    ("optim1.step", "optimizer 1 step counts differ at step start: optimizer state not restored "
                    "on resume, or a step skipped"),
    ("optim0.lr", "optimizer 0's learning rate (its param groups' lr) differs at step start: the LR's position"),
    ("sched0.last_epoch", "LR scheduler 0's position (last_epoch: the steps it has counted) differs at step "
                          "start: the scheduler was not restored"),
    ("sched2.lr", "LR scheduler 2's last computed LR (get_last_lr()) differs"),
    ("optim0.hparams", "optimizer 0's group settings (betas, weight decay, eps, ...) differ"),
    ("sched0.step_count", "LR scheduler 0's step count (_step_count) differs at step start"),
    ("scaler1", "GradScaler 1's scale or growth tracker differs at step start"),
    ("data.train.py:40", "data loader train.py:40 is at another position in its epoch at step start"),
    ("params/w1", "training state 'params/w1' differs at step start"),
])
def test_each_record_name_has_its_sentence(name, sentence):
    assert describe_state_record(name).startswith(sentence)


def test_every_census_name_has_a_specific_sentence():
    generic = describe_state_record("something.else")
    for name, _ in Training().census():
        assert describe_state_record(name) != generic, name


@pytest.mark.parametrize("name, kind, key, field, title", [
    ("rng.python", "rng", "python", "", "Python random generator"),
    ("rng.cuda:1", "cuda_rng", "1", "", "CUDA generator 1"),
    ("rng.user.train.py:12#2", "user_rng", "train.py:12#2", "", "generator train.py:12#2"),
    ("optim2.lr", "optimizer", "2", "lr", "optimizer 2 learning rates"),
    ("sched0.last_epoch", "scheduler", "0", "last_epoch", "LR scheduler 0 position (last_epoch)"),
    ("scaler1", "scaler", "1", "", "GradScaler 1 scale"),
    ("data.state.train.py:40", "data_state", "train.py:40", "", "data loader train.py:40 state"),
    ("data.train.py:40#2", "data_position", "train.py:40#2", "", "data loader train.py:40#2 position"),
    ("fp8.blocks.0.attn.amax_history_input", "other", "fp8.blocks.0.attn.amax_history_input", "",
     "fp8.blocks.0.attn.amax_history_input"),
    ("optimizer.step", "other", "optimizer.step", "", "optimizer.step"),  # not optim<i>: no optimizer's record
])
def test_a_census_name_parses_and_formats_back(name, kind, key, field, title):
    """`CensusName` is the one reader of the names the census writes (issue 36: verify's findings,
    the state pictures and the sentences parsed them by string prefix, each its own way)."""
    parsed = checkpoint.CensusName.parse(name)
    assert (parsed.kind, parsed.key, parsed.field, parsed.title()) == (kind, key, field, title)
    assert str(parsed) == name
    assert parsed.is_torch_generator == name.startswith(("rng.torch_cpu", "rng.cuda", "rng.user."))


def test_every_name_the_census_writes_is_one_it_parses():
    for name, _ in Training().census():
        parsed = checkpoint.CensusName.parse(name)
        assert parsed.kind != checkpoint.CensusName.OTHER and str(parsed) == name, name


# --- the census's one home: the census stream RUN/state, beside the main stream ---------------


def _record_run(directory, jitter: int, *, old_layout: bool, steps=range(3)):
    """A run whose census holds a generator ("rng.user.jitter", ``jitter`` from step 2 on)
    and an optimizer's step counts: in the census stream (today's layout), or in the main
    stream's state phase (how the recipe recorded it before 2026-12)."""
    main = samebits.Recorder(directory, rank=0, world_size=1)
    census = main if old_layout else checkpoint.census_recorder(main)
    for step in steps:
        records = [("rng.user.jitter", torch.tensor([0 if step < 2 else jitter])),
                   ("optim0.step", torch.tensor([float(step)], dtype=torch.float64))]
        census.tensors(step, STATE_PHASE, records)
        if census is not main:
            census.end_step(step)
        main.tensors(step, "params", [("w", torch.full((2,), float(step + (jitter if step >= 2 else 0))))])
        main.end_step(step)
    for recorder in {id(main): main, id(census): census}.values():
        recorder.close()
    return directory


@pytest.mark.parametrize("old_layout", [False, True], ids=["census stream", "main stream (before 2026-12)"])
def test_verify_reads_the_census_from_its_home_and_from_old_runs(tmp_path, old_layout):
    from samebits.runners._explain import explain_resume

    a = _record_run(tmp_path / "a", 0, old_layout=old_layout)
    c = _record_run(tmp_path / "c", 7, old_layout=old_layout)
    assert checkpoint.census_run(a) == (a if old_layout else a / checkpoint.CENSUS_DIR)
    main_phases = {r.phase for block in samebits.open_run(a).stream(0).steps() for r in block.records()}
    assert (STATE_PHASE in main_phases) == old_layout  # today's census never enters the verdict's stream
    findings = explain_resume(a, None, c, 2, 2)
    assert [(f.kind, f.step, f.record) for f in findings] == [("generator", 2, "rng.user.jitter")], findings
    assert "generator 'jitter' state differs" in findings[0].says


def test_census_home_lookup_and_recorder(tmp_path):
    assert checkpoint.census_run(tmp_path / "missing") is None
    assert checkpoint.census_recorder(None) is None
    assert checkpoint.census_recorder(object()) is None  # a recorder of one's own: give the census its own
    main = samebits.Recorder(tmp_path / "run", rank=1, world_size=2)
    census = checkpoint.census_recorder(main)
    assert (census.settings.directory, census.rank, census.world_size) == (tmp_path / "run" / "state", 1, 2)
    off = samebits.Recorder(tmp_path / "off", rank=1, world_size=2, ranks="0")  # this rank is not recorded
    assert checkpoint.census_recorder(off) is None
    for recorder in (census, main, off):
        recorder.close()


def test_bisect_suspects_every_census_record_that_differs(tmp_path):
    """What bisect adds to a trace's census: every record of the runs' census that differs at
    the step start (here a generator the trace does not see), in either layout."""
    from samebits.runners._explain import census_suspects

    for old_layout in (False, True):
        a = _record_run(tmp_path / f"a{old_layout}", 0, old_layout=old_layout)
        b = _record_run(tmp_path / f"b{old_layout}", 7, old_layout=old_layout)
        assert census_suspects(["rng.torch_cpu"], a, b, 0, 2) == (["rng.torch_cpu", "rng.user.jitter"], [])
        assert census_suspects([], a, b, 0, 1) == ([], [])


def test_the_recipe_records_its_census_in_the_census_stream(tmp_path):
    from samebits.recipes import RecipeConfig, train

    cfg = RecipeConfig(num_layers=2, seq_len=32, micro_batch_size=2)
    recorder = samebits.Recorder(tmp_path / "run", rank=0, world_size=1, config=cfg.to_dict())
    train(cfg, steps=2, recorder=recorder)
    recorder.close()
    main = samebits.open_run(tmp_path / "run").stream(0)
    assert STATE_PHASE not in {r.phase for block in main.steps() for r in block.records()}
    census = samebits.open_run(tmp_path / "run" / checkpoint.CENSUS_DIR).stream(0)
    blocks = list(census.steps())
    assert [block.step for block in blocks] == [0, 1]
    names = {r.name for r in blocks[0].records() if r.phase == STATE_PHASE}
    assert {"rng.torch_cpu", "rng.user.router_jitter", "optim0.step", "sched0.last_epoch"} <= names


def _recorded(run: Path, jitter: float, steps=range(4)) -> None:
    import torch

    from samebits import Recorder
    from samebits.checkpoint import CENSUS_DIR, STATE_PHASE

    main_stream, census = Recorder(run, rank=0, world_size=1), Recorder(run / CENSUS_DIR, rank=0, world_size=1)
    for step in steps:
        main_stream.metrics(step, loss=1.0 / (step + 1))
        census.tensors(step, STATE_PHASE, [("rng.user.router_jitter", torch.tensor([jitter + (step >= 2)]))])
    main_stream.close(), census.close()


@pytest.mark.parametrize("differs", [False, True])
def test_a_census_that_differs_fails_a_self_recording_run_whose_outputs_agree(tmp_path, differs):
    """A program that records its whole state (the recipe) and resumed without a state that
    no output has shown yet: the outputs agree, the census does not, and verify's check says
    DIVERGED at the census record (with a note), never IDENTICAL; equal censuses change nothing."""
    from samebits.compare import diff
    from samebits.runners.verify import _with_census

    _recorded(tmp_path / "a", 0.0)
    _recorded(tmp_path / "c", 0.5 if differs else 0.0, steps=range(2, 4))
    notes: list[str] = []
    check = _with_census(diff(tmp_path / "a", tmp_path / "c", start_step=2), tmp_path / "a", tmp_path / "c", 2,
                         "resume", notes)
    if not differs:
        assert check.identical and notes == []
        return
    assert check.verdict == "diverged"
    d = check.first_divergence
    assert (d.step, d.name) == (2, "rng.user.router_jitter"), d
    assert notes and "every recorded output is identical, but the state census differs at step 2" in notes[0]


def test_the_census_takes_what_real_trainers_make():
    """nanoGPT's disabled scaler (`torch.cuda.amp.GradScaler(enabled=False)`: no _growth_tracker),
    torch.amp's disabled one, a group without "lr" (torchtitan's OptimizersContainer) and a
    tensor LR: recorded, never a ConfigError inside the user's step."""
    import warnings

    param = torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.SGD([param], lr=0.5)
    no_lr = torch.optim.SGD([param], lr=0.5)
    del no_lr.param_groups[0]["lr"]
    tensor_lr = torch.optim.Adam([param], lr=torch.tensor(0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old_style = torch.cuda.amp.GradScaler(enabled=False)
    records = dict(state_census(optimizers=[plain, no_lr, tensor_lr],
                                scalers=[old_style, torch.amp.GradScaler("cpu", enabled=False)], include_cuda=False))
    assert records["optim0.lr"].tolist() == [0.5]
    assert torch.isnan(records["optim1.lr"]).all()
    assert records["optim2.lr"].tolist() == [0.25]
    for name in ("scaler0", "scaler1"):
        assert torch.isnan(records[name][0]) and records[name][1].item() == -1.0
