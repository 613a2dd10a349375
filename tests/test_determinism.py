"""Tests for samebits.determinism: rules, deterministic_mode, seeds and the op catalog.

The op-catalog test re-checks every CPU claim of ops.json on this machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import samebits.determinism as det
from samebits.determinism import _builtin_rules, _environment
from samebits.determinism._rules import FEATURES, UNSET, run_checks
from samebits.determinism import _rules as _rules_module
from samebits.errors import DeterminismError

REPO = Path(__file__).resolve().parents[1]
ENV_NAMES = [s.name for s in _environment.ENV_SETTINGS]
GOOD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "FLASH_ATTENTION_DETERMINISTIC": "1",
            "MAMBA_DETERMINISTIC": "1", "CAUSAL_CONV1D_DETERMINISTIC": "1",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "2"}
GOOD_CONFIG = {"seed": 0, "num_threads": 2, "moe_combine": "index_add",
               "moe_grouped_gemm": "triton_deterministic", "embedding_backward": "dense",
               "overlap_grad_reduce": False, "tp_comm_overlap": False,
               "cross_entropy_loss_fusion": False, "deterministic": True}


@pytest.fixture
def clean_env(monkeypatch):
    """No determinism variable set, whatever the developer's shell has."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def torch_state():
    """Put back every process-wide setting a test may touch."""
    import torch._inductor.config as inductor
    import torch.utils.deterministic

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.mkldnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory,
             inductor.deterministic, inductor.max_autotune, torch.get_num_threads())
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.mkldnn.deterministic, torch.utils.deterministic.fill_uninitialized_memory,
     inductor.deterministic, inductor.max_autotune) = saved[2:8]
    torch.set_num_threads(saved[8])


def _good_torch_flags():
    import torch._inductor.config  # noqa: F401  (the inductor rule reads it when imported)

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.mkldnn.deterministic = True
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.set_num_threads(int(GOOD_ENV["OMP_NUM_THREADS"]))


GPU_PLATFORM = {feature: True for feature in FEATURES}  # every rule applies, whatever this machine has


def _violated(rule_id, config=None, environ=None, env=True, torch_flags=False):
    result = run_checks(config, env=env, torch_flags=torch_flags,
                        environ=GOOD_ENV if environ is None else environ, platform=GPU_PLATFORM)
    return [v for v in result.violations if v.rule == rule_id]


# --- every built-in rule: one case that triggers it, one that passes -------------------

def _env_case(name, bad):
    def trigger(mp):
        return _violated(_environment.ENV_BY_NAME[name].rule_id, environ={**GOOD_ENV, name: bad})

    def unset(mp):
        environ = {k: v for k, v in GOOD_ENV.items() if k != name}
        return _violated(_environment.ENV_BY_NAME[name].rule_id, environ=environ)
    return trigger, unset


def _torch_case(rule_id, breaker):
    def trigger(mp):
        _good_torch_flags()
        breaker(mp)
        return _violated(rule_id, env=False, torch_flags=True)

    def passing(mp):
        _good_torch_flags()
        return _violated(rule_id, env=False, torch_flags=True)
    return trigger, passing


def _config_case(rule_id, bad):
    return (lambda mp: _violated(rule_id, config={**GOOD_CONFIG, **bad}, env=False),
            lambda mp: _violated(rule_id, config=GOOD_CONFIG, env=False))


def _set_threads_mismatch(mp):
    torch.set_num_threads(1)


def _cuda_started(mp):
    mp.setattr(torch.cuda, "is_initialized", lambda: True)
    _builtin_rules  # the rule reads CUBLAS_WORKSPACE_CONFIG from the environ passed in
    return None


TRIGGERS = {
    "env-cublas-workspace": _env_case("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
    "env-nccl-algo": _env_case("NCCL_ALGO", "Tree"),
    "env-nccl-proto": _env_case("NCCL_PROTO", "^LL128"),
    "env-nvte-nondeterministic": _env_case("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
    "env-flash-attention": _env_case("FLASH_ATTENTION_DETERMINISTIC", "0"),
    "env-mamba": _env_case("MAMBA_DETERMINISTIC", "0"),
    "env-causal-conv1d": _env_case("CAUSAL_CONV1D_DETERMINISTIC", "false"),
    "env-pythonhashseed": _env_case("PYTHONHASHSEED", "abc"),  # Python refuses to start; "random" is unset
    "env-omp-threads": _env_case("OMP_NUM_THREADS", "auto"),
    "torch-deterministic-algorithms": _torch_case(
        "torch-deterministic-algorithms", lambda mp: torch.use_deterministic_algorithms(True, warn_only=True)),
    "torch-cudnn-deterministic": _torch_case(
        "torch-cudnn-deterministic", lambda mp: setattr(torch.backends.cudnn, "deterministic", False)),
    "torch-cudnn-benchmark": _torch_case(
        "torch-cudnn-benchmark", lambda mp: setattr(torch.backends.cudnn, "benchmark", True)),
    "torch-mkldnn-deterministic": _torch_case(
        "torch-mkldnn-deterministic", lambda mp: setattr(torch.backends.mkldnn, "deterministic", False)),
    "torch-fill-uninitialized-memory": _torch_case(
        "torch-fill-uninitialized-memory",
        lambda mp: setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)),
    "torch-inductor-autotune": _torch_case(
        "torch-inductor-autotune", lambda mp: (torch.use_deterministic_algorithms(False),
                                               setattr(torch._inductor.config, "max_autotune", True))),
    "torch-num-threads": _torch_case("torch-num-threads", _set_threads_mismatch),
    "torch-cublas-before-cuda": (
        lambda mp: (_cuda_started(mp), run_checks(None, env=False, torch_flags=True, environ={}))[1].violations,
        lambda mp: (_cuda_started(mp), run_checks(None, env=False, torch_flags=True,
                                                  environ=GOOD_ENV))[1].violations),
    "config-comm-overlap": _config_case("config-comm-overlap", {"ddp": {"overlap_grad_reduce": True}}),
    "config-atomic-fusion": _config_case("config-atomic-fusion", {"cross_entropy_loss_fusion": True}),
    "config-num-threads": _config_case("config-num-threads", {"num_threads": None}),
    "config-seed": _config_case("config-seed", {"seed": None}),
    "config-deterministic-off": _config_case("config-deterministic-off",
                                             {"debug": {"deterministic": False}}),
    "recipe-moe-combine": _config_case("recipe-moe-combine", {"moe_combine": "index_put_accumulate"}),
    "recipe-moe-grouped-gemm": _config_case("recipe-moe-grouped-gemm",
                                            {"moe_grouped_gemm": "triton_atomic"}),
    "recipe-embedding-backward": _config_case("recipe-embedding-backward",
                                              {"embedding_backward": "index_put_accumulate"}),
}


def test_every_builtin_rule_has_a_trigger_case():
    assert set(TRIGGERS) == {r.id for r in det.rules()}


@pytest.mark.parametrize("rule_id", sorted(TRIGGERS))
def test_rule_triggers_and_passes(rule_id, monkeypatch, torch_state):
    trigger, passing = TRIGGERS[rule_id]
    found = [v for v in trigger(monkeypatch) if v.rule == rule_id]
    assert found, f"{rule_id} did not fire"
    assert all(v.fix and v.setting for v in found)
    if rule_id.startswith("env-"):  # the second env case is "unset": a violation, or advice where unset
        unset = passing(monkeypatch)  # cannot change this machine's bits (issue 35 item 9)
        setting = next(s for s in _environment.ENV_SETTINGS if s.rule_id == rule_id)
        if setting.unset_advice:
            environ = {k: v for k, v in GOOD_ENV.items() if k != setting.name}
            (advice,) = run_checks(None, env=True, torch_flags=False, environ=environ,
                                   platform=GPU_PLATFORM).advice
            assert not unset and advice.rule == rule_id and advice.found == UNSET and advice.when
        else:
            assert unset and unset[0].found == UNSET
        assert not _violated(rule_id)
    else:
        assert not [v for v in passing(monkeypatch) if v.rule == rule_id]


@pytest.mark.parametrize("value,ok", [
    ("Ring", True), ("ring", True), ("CollnetDirect", True), ("allreduce:ring;broadcast:ring", True),
    ("Tree", False), ("NVLS", False), ("NVLSTree", False), ("^NVLS", False), ("Ring,Tree", False),
    ("Ring,CollnetChain", False), ("Bogus", False)])
def test_nccl_algo_values(value, ok):
    assert (_environment.ENV_BY_NAME["NCCL_ALGO"].validate(value) is None) is ok


def test_unknown_recipe_value_fails_closed():
    (v,) = det.check({"moe_combine": "magic"}, env=False)
    assert v.rule == "recipe-moe-combine" and "unknown value" in v.fix


def test_all_violations_reported_together():
    config = {"moe_combine": "triton_atomic", "moe_grouped_gemm": "triton_atomic",
              "embedding_backward": "index_put_accumulate", "num_threads": None, "seed": None,
              "tp_comm_overlap": True, "cross_entropy_loss_fusion": True}
    with pytest.raises(DeterminismError) as err:
        det.validate(config, env=False)
    rules_hit = {v.rule for v in err.value.violations}
    assert rules_hit == {"recipe-moe-combine", "recipe-moe-grouped-gemm", "recipe-embedding-backward",
                         "config-num-threads", "config-seed", "config-comm-overlap",
                         "config-atomic-fusion"}
    for v in err.value.violations:
        assert v.fix in str(err.value)


def test_near_miss_key_warns_and_unread_keys_are_reported():
    with pytest.warns(UserWarning, match="moe_combin.*moe_combine"):
        assert det.check({"moe_combin": "index_put_accumulate"}, env=False) == []
    result = run_checks({"d_model": 64, "seed": 1}, env=False)
    assert result.unread_keys == ["d_model"] and not result.near_misses


def test_user_rule_registration_and_ignore():
    @det.rule("test-no-foo", category="config", setting="foo", checks="foo is off",
              why="foo uses atomics", fix="set foo = false")
    def _no_foo(ctx):
        for path, value in ctx.config.find("foo"):
            if value:
                yield det.RuleFinding(path, value)
    try:
        (v,) = det.check({"sec": {"foo": True}}, env=False)
        assert (v.rule, v.setting, v.found, v.fix) == ("test-no-foo", "sec.foo", True, "set foo = false")
        assert det.check({"sec": {"foo": True}}, env=False, ignore=["test-no-foo"]) == []
        with pytest.raises(ValueError, match="already registered"):
            det.register_rule(det.Rule(id="test-no-foo", category="config", setting="x", checks="",
                                       why="", fix="", func=lambda ctx: None))
        with pytest.raises(ValueError, match="unknown rule"):
            det.check({}, env=False, ignore=["no-such-rule"])
    finally:
        det.unregister_rule("test-no-foo")


def test_violation_json_shape():
    (v,) = det.check({"moe_grouped_gemm": "triton_atomic"}, env=False)
    assert json.loads(json.dumps(v.to_dict())).keys() >= {"rule", "setting", "found", "fix"}


# --- deterministic_mode -------------------------------------------------------------------

def _flags():
    import torch._inductor.config as inductor
    return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, torch.backends.cudnn.conv.fp32_precision,
            torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision(),
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.mkldnn.deterministic, inductor.deterministic, inductor.max_autotune,
            torch.get_num_threads())


def test_mode_sets_records_and_restores(clean_env, torch_state):
    det.deterministic_mode(seed=0).restore()  # warm-up: importing inductor sets its cache dir
    torch.backends.cudnn.benchmark = True
    before_flags, before_env = _flags(), dict(os.environ)
    assert det.active_record() is None
    with det.deterministic_mode(seed=7, num_threads=1, coordinates={"dp": 2}) as mode:
        record = det.active_record()
        assert json.loads(json.dumps(record)) == record == mode.record
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        assert {k: os.environ[k] for k in ENV_NAMES} == {**GOOD_ENV, "OMP_NUM_THREADS": "1"}
        assert record["env_set_by_samebits"] == sorted(ENV_NAMES)
        assert record["threads"] == {"num_threads": 1, "num_interop_threads": torch.get_num_interop_threads(),
                                     "source": "argument"}
        assert record["torch"]["cudnn.conv.fp32_precision"] == "ieee"
        seeds = record["seeds"]
        assert seeds["global"] == det.derive_seed(7, purpose="init")
        assert seeds["derived"]["data"] == det.derive_seed(7, purpose="data", coordinates={"dp": 2})
        assert seeds["coordinates"] == {"dp": 2}
        assert torch.rand(1).item() == (torch.manual_seed(seeds["global"]), torch.rand(1).item())[1]
    assert det.active_record() is None
    assert _flags() == before_flags and dict(os.environ) == before_env


def test_mode_as_plain_call_and_nesting(clean_env, torch_state):
    outer = det.deterministic_mode(seed=1)
    inner = det.deterministic_mode(seed=2)
    assert det.active_record()["seeds"]["base"] == 2
    with pytest.raises(RuntimeError, match="innermost first"):
        outer.restore()
    inner.restore()
    assert det.active_record()["seeds"]["base"] == 1
    outer.restore()
    outer.restore()  # idempotent
    assert det.active_record() is None and "NCCL_ALGO" not in os.environ


def test_mode_keeps_good_user_values_and_refuses_bad_ones(clean_env, torch_state):
    clean_env.setenv("NCCL_ALGO", "CollnetChain")
    clean_env.setenv("OMP_NUM_THREADS", "1")
    with det.deterministic_mode() as mode:
        assert os.environ["NCCL_ALGO"] == "CollnetChain"
        assert "NCCL_ALGO" not in mode.record["env_set_by_samebits"]
        assert mode.record["threads"]["source"] == "OMP_NUM_THREADS" and torch.get_num_threads() == 1
    clean_env.setenv("NCCL_ALGO", "Tree")
    clean_env.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    before = _flags()
    with pytest.raises(DeterminismError) as err:
        det.deterministic_mode(num_threads=2, config={"moe_combine": "triton_atomic"})
    assert {v.rule for v in err.value.violations} == {
        "env-nccl-algo", "env-nvte-nondeterministic", "env-omp-threads", "recipe-moe-combine"}
    assert os.environ["NCCL_ALGO"] == "Tree" and _flags() == before  # nothing applied
    assert det.active_record() is None


def test_mode_fails_when_cuda_started_without_workspace_config(clean_env, torch_state):
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(DeterminismError, match="CUDA already initialized") as err:
        det.deterministic_mode()
    assert [v.rule for v in err.value.violations] == ["torch-cublas-before-cuda"]
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    det.deterministic_mode().restore()


def test_mode_hash_seed(clean_env, torch_state):
    clean_env.setattr(_environment, "startup_environ", lambda: {})
    randomized = _environment.interpreter_hash_randomized()
    with det.deterministic_mode() as mode:
        assert mode.record["python_hash"]["randomized"] is randomized
        assert os.environ["PYTHONHASHSEED"] == "0"  # for child processes
    if randomized:
        with pytest.raises(DeterminismError, match="PYTHONHASHSEED"):
            det.deterministic_mode(expect_child_processes=True)
    clean_env.setattr(_environment, "startup_environ", lambda: {"PYTHONHASHSEED": "5"})
    assert not _environment.interpreter_hash_randomized()


def test_mode_argument_errors(clean_env):
    with pytest.raises(ValueError, match="nccl_algo"):
        det.deterministic_mode(nccl_algo="Tree")
    with pytest.raises(ValueError, match="num_threads"):
        det.deterministic_mode(num_threads=0)
    clean_env.setenv("NCCL_ALGO", "Ring")
    with pytest.raises(DeterminismError, match="was asked for"):
        det.deterministic_mode(nccl_algo="CollnetDirect")


def test_mode_makes_index_put_repeatable(clean_env, torch_state):
    run = _CASES["index-put-accumulate"]()
    with det.deterministic_mode(num_threads=2):
        first = run()
        assert all(_same(first, run()) for _ in range(3))


# --- seeds ------------------------------------------------------------------------------

def test_derive_seed_rule():
    base = 1234

    def seed(purpose, **coordinates):
        return det.derive_seed(base, purpose=purpose, coordinates=coordinates)

    init = {seed("init", dp=d, tp=t, pp=p, ep=e) for d in range(3) for t in range(2) for p in range(2) for e in range(2)}
    assert len(init) == 1  # model init: one seed on every rank
    data = [seed("data", dp=d, tp=t) for d in range(4) for t in range(2)]
    assert len(set(data)) == 4  # varies with dp only
    assert len({seed("dropout_tp", tp=t) for t in range(4)}) == 4
    assert len({seed("expert", ep=e) for e in range(4)}) == 4
    everything = {seed(p, dp=d, pp=q, tp=t, ep=e) for p in det.SEED_PURPOSES for d in range(4) for q in range(2)
                  for t in range(2) for e in range(2)}
    assert all(0 <= s < 2**63 for s in everything)
    assert seed("data", dp=1) != det.derive_seed(base + 1, purpose="data", coordinates={"dp": 1})
    # an axis no purpose names (context parallel, say) changes no seed; a new purpose names its axes
    assert seed("dropout", dp=1, cp=3) == seed("dropout", dp=1)
    assert det.derive_seed(base, purpose="ring", coordinates={"cp": 1}, varies_with=("cp",)) != \
        det.derive_seed(base, purpose="ring", coordinates={"cp": 0}, varies_with=("cp",))
    with pytest.raises(ValueError, match="purpose"):
        det.derive_seed(1, purpose="optimizer")
    with pytest.raises(ValueError, match=r"coordinates\['dp'\]"):
        det.derive_seed(1, purpose="data", coordinates={"dp": -1})
    with pytest.raises(ValueError, match="coordinates must be a mapping"):
        det.deterministic_mode(coordinates=[0, 1])


def test_derived_seeds_keep_their_bits():
    """The seed rule's values are part of every recorded run (samebits-seed/1): the ones the
    rule gave before coordinates were a mapping of axes (keywords dp_rank=, ...)."""
    coordinates = {"dp": 1, "tp": 2, "pp": 3, "ep": 1}
    assert {p: det.derive_seed(1234, purpose=p, coordinates=coordinates) for p in det.SEED_PURPOSES} == {
        "init": 6774195104112289056, "data": 7051313290576415829, "dropout": 9141533270039771901,
        "dropout_tp": 1649456511435402374, "expert": 2745782077633154899}
    assert det.derive_seed(0, purpose="expert", coordinates={"dp": 1, "ep": 1}) == 61272746498868366


def test_seed_all_is_repeatable():
    import random

    import numpy as np

    det.seed_all(2**62 + 5)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    det.seed_all(2**62 + 5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


# --- the op catalog -----------------------------------------------------------------------

def test_lookup_op_spellings():
    (accumulate, overwrite) = det.lookup_op("aten::index_put_")
    assert accumulate.id == "index-put-accumulate" and overwrite.id == "index-put-overwrite"
    for spelling in ("aten.index_put.default", "aten::index_put", "index_put_",
                     torch.ops.aten.index_put_.default):
        assert det.lookup_op(spelling)[0].id == "index-put-accumulate"
    assert det.lookup_op("aten::add") == ()
    assert "alternative" in det.lookup_op("aten::scatter_add")[0].summary()


def _bits(t):
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _grad_of(make_input, fn, shape_seed=0):
    """A builder: fn(x) differentiated w.r.t. x with a fixed random upstream gradient."""
    def build():
        x0 = make_input()
        out = fn(x0.detach().requires_grad_())
        upstream = torch.randn(out.shape, generator=_gen(shape_seed + 1))

        def run():
            x = x0.detach().requires_grad_()
            fn(x).backward(upstream)
            return x.grad
        return run
    return build


N_IDX, ROWS, COLS = 200_000, 1000, 16


def _index_inputs():
    g = _gen()
    idx = torch.randint(0, ROWS, (N_IDX,), generator=g)
    return idx, torch.randn(N_IDX, COLS, generator=g)


def _indexing(op):
    def build():
        idx, v = _index_inputs()
        flat_idx = torch.randint(0, ROWS * COLS, (N_IDX,), generator=_gen(3))
        exp = idx[:, None].expand(N_IDX, COLS)
        calls = {
            "index_put_acc": lambda: torch.zeros(ROWS, COLS).index_put_((idx,), v, accumulate=True),
            "index_put": lambda: torch.zeros(ROWS, COLS).index_put_((idx,), v, accumulate=False),
            "put_acc": lambda: torch.zeros(ROWS * COLS).put_(flat_idx, v[:, 0], accumulate=True),
            "put": lambda: torch.zeros(ROWS * COLS).put_(flat_idx, v[:, 0], accumulate=False),
            "index_copy": lambda: torch.zeros(ROWS, COLS).index_copy_(0, idx, v),
            "scatter_add": lambda: torch.zeros(ROWS, COLS).scatter_add_(0, exp, v),
            "index_add": lambda: torch.zeros(ROWS, COLS).index_add_(0, idx, v),
            "scatter": lambda: torch.zeros(ROWS, COLS).scatter_(0, exp, v),
            "scatter_sum": lambda: torch.zeros(ROWS, COLS).scatter_reduce(0, exp, v, "sum"),
            "scatter_prod": lambda: torch.ones(ROWS, COLS).scatter_reduce(0, exp, 1 + v * 1e-3, "prod"),
        }
        return calls[op]
    return build


def _sdpa():
    g = _gen()
    q, k, v = (torch.randn(4, 8, 256, 64, generator=g) for _ in range(3))
    upstream = torch.randn(4, 8, 256, 64, generator=_gen(1))

    def run():
        qq = q.clone().requires_grad_()
        out = F.scaled_dot_product_attention(qq, k, v, is_causal=True)
        out.backward(upstream)
        return out.detach(), qq.grad
    return run


def _ctc():
    g = _gen()
    logits = torch.randn(50, 16, 20, generator=g)
    targets = torch.randint(1, 20, (16, 30), generator=g)

    def run():
        x = logits.clone().requires_grad_()
        F.ctc_loss(x.log_softmax(2), targets, torch.full((16,), 50), torch.full((16,), 30)).backward()
        return x.grad
    return run


def _embedding_bag_max():
    g = _gen()
    weight = torch.randn(ROWS, 32, generator=g)
    idx = torch.randint(0, ROWS, (50_000,), generator=g)
    offsets = torch.arange(0, 50_000, 50)
    upstream = torch.randn(len(offsets), 32, generator=_gen(1))

    def run():
        w = weight.clone().requires_grad_()
        F.embedding_bag(idx, w, offsets, mode="max").backward(upstream)
        return w.grad
    return run


def _max_unpool():
    g = _gen()
    values = torch.randn(8, 4, 64, 64, generator=g)
    indices = torch.randint(0, 4, (8, 4, 64, 64), generator=g)  # many values per output cell
    return lambda: F.max_unpool2d(values, indices, 2, output_size=(128, 128))


def _conv_weight_grad():
    g = _gen()
    x = torch.randn(16, 32, 32, 32, generator=g)
    weight = torch.randn(64, 32, 3, 3, generator=g)
    upstream = torch.randn(16, 64, 30, 30, generator=_gen(1))

    def run():
        w = weight.clone().requires_grad_()
        F.conv2d(x, w).backward(upstream)
        return w.grad
    return run


def _big_sum():
    x = torch.randn(10_000_000, generator=_gen())
    return lambda: x.sum()


def _rand(*shape, seed=0):
    return lambda: torch.randn(*shape, generator=_gen(seed))


_CASES = {
    "index-put-accumulate": _indexing("index_put_acc"),
    "index-put-overwrite": _indexing("index_put"),
    "put-accumulate": _indexing("put_acc"),
    "put-overwrite": _indexing("put"),
    "index-copy": _indexing("index_copy"),
    "scatter-add": _indexing("scatter_add"),
    "index-add": _indexing("index_add"),
    "scatter-src": _indexing("scatter"),
    "scatter-reduce-sum": _indexing("scatter_sum"),
    "scatter-reduce-prod": _indexing("scatter_prod"),
    "gather-backward": _grad_of(_rand(ROWS, COLS),
                                lambda x: x.gather(0, _index_inputs()[0][:, None].expand(N_IDX, COLS))),
    "index-select-backward": _grad_of(_rand(ROWS, COLS), lambda x: x.index_select(0, _index_inputs()[0])),
    "repeat-interleave-backward": _grad_of(
        _rand(ROWS, COLS), lambda x: x.repeat_interleave(torch.arange(ROWS) % 7 + 1, dim=0)),
    "embedding-backward": _grad_of(_rand(ROWS, COLS), lambda w: F.embedding(_index_inputs()[0], w)),
    "embedding-bag-max-backward": _embedding_bag_max,
    "convolution-backward": _conv_weight_grad,
    "replication-pad-backward": _grad_of(_rand(8, 8, 64, 64), lambda x: F.pad(x, (3, 3, 3, 3), mode="replicate")),
    "reflection-pad-backward": _grad_of(_rand(8, 8, 64, 64), lambda x: F.pad(x, (3, 3, 3, 3), mode="reflect")),
    "max-pool3d-backward": _grad_of(_rand(4, 4, 24, 24, 24), lambda x: F.max_pool3d(x, 3, stride=2)),
    "avg-pool3d-backward": _grad_of(_rand(4, 4, 24, 24, 24), lambda x: F.avg_pool3d(x, 3, stride=2)),
    "adaptive-avg-pool2d-backward": _grad_of(_rand(8, 16, 64, 64), lambda x: F.adaptive_avg_pool2d(x, 7)),
    "adaptive-avg-pool3d-backward": _grad_of(_rand(4, 4, 24, 24, 24), lambda x: F.adaptive_avg_pool3d(x, 5)),
    "adaptive-max-pool2d-backward": _grad_of(_rand(8, 16, 64, 64), lambda x: F.adaptive_max_pool2d(x, 7)),
    "fractional-max-pool-backward": _grad_of(
        _rand(8, 16, 64, 64), lambda x: F.fractional_max_pool2d(
            x, 3, output_size=20, _random_samples=torch.rand(8, 16, 2, generator=_gen(5)))),
    "max-unpool": _max_unpool,
    "upsample-backward": _grad_of(_rand(8, 8, 32, 32), lambda x: F.interpolate(
        x, scale_factor=2.5, mode="bilinear", align_corners=False)),
    "grid-sampler-backward": _grad_of(_rand(8, 8, 32, 32), lambda x: F.grid_sample(
        x, torch.rand(8, 48, 48, 2, generator=_gen(6)) * 2 - 1, align_corners=False)),
    "nll-loss2d": lambda: (lambda logp, target: lambda: F.nll_loss(logp, target))(
        torch.randn(16, 10, 64, 64, generator=_gen()).log_softmax(1),
        torch.randint(0, 10, (16, 64, 64), generator=_gen(1))),
    "ctc-loss-backward": _ctc,
    "histc": lambda: (lambda x: lambda: torch.histc(x, bins=97))(torch.randn(2_000_000, generator=_gen())),
    "bincount-weights": lambda: (lambda i, w: lambda: torch.bincount(i, weights=w))(
        torch.randint(0, 100, (2_000_000,), generator=_gen()), torch.randn(2_000_000, generator=_gen(1))),
    "median-indices": lambda: (lambda x: lambda: x.median(dim=1))(
        torch.randint(0, 5, (2000, 501), generator=_gen()).float()),
    "cumsum": lambda: (lambda x: lambda: x.cumsum(0))(torch.randn(2_000_000, generator=_gen())),
    "sum-thread-count": _big_sum,
    "gemm": lambda: (lambda a, b: lambda: a @ b)(torch.randn(512, 768, generator=_gen()),
                                                 torch.randn(768, 512, generator=_gen(1))),
    "sdpa-cpu": _sdpa,
}


def _threads(n, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def test_every_cpu_claim_has_a_check():
    catalog = {e.id for e in det.op_catalog() if e.cpu != "n/a"}
    assert catalog == set(_CASES)
    assert len({e.id for e in det.op_catalog()}) == len(det.op_catalog())


@pytest.mark.parametrize("entry", [e for e in det.op_catalog() if e.cpu != "n/a"], ids=lambda e: e.id)
def test_op_catalog_cpu_claims(entry, torch_state):
    """Re-measure the entry's CPU claims with 2 threads (our machines have 2 cores)."""
    run = _CASES[entry.id]()
    torch.use_deterministic_algorithms(False)
    first = _threads(2, run)
    if entry.cpu == "varies":
        # Races need both cores at once; other work on the machine can serialise a few runs.
        assert any(not _same(first, _threads(2, run)) for _ in range(20)), \
            f"{entry.id}: claimed to vary on CPU, but 20 more runs gave the same bits"
    elif entry.cpu == "repeatable":
        assert all(_same(first, _threads(2, run)) for _ in range(2)), \
            f"{entry.id}: claimed repeatable on CPU, but runs differed"
    if entry.thread_count_changes_bits is not None:
        assert _same(first, _threads(1, run)) is not entry.thread_count_changes_bits, \
            f"{entry.id}: 1 vs 2 threads claim is wrong"
    torch.use_deterministic_algorithms(True)
    if entry.cpu_flag == "raises":
        with pytest.raises(RuntimeError, match="deterministic"):
            _threads(2, run)
    else:
        flagged = _threads(2, run)
        assert all(_same(flagged, _threads(2, run)) for _ in range(2)), \
            f"{entry.id}: claimed repeatable under the flag, but runs differed"


# --- docs stay in sync ----------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rules_table() -> str:
    """The rule table of docs/determinism.md, generated from the registry."""
    lines = ["| Rule | Category | Checks | Why it breaks bitwise determinism | Fix |",
             "|---|---|---|---|---|"]
    lines += [f"| `{r.id}` | {r.category} | {_cell(r.checks)} | {_cell(r.why)} | {_cell(r.fix)} |"
              for r in det.rules()]
    return "\n".join(lines)


def ops_table() -> str:
    """The op table of docs/determinism.md, generated from ops.json."""
    lines = ["| Id | Op (aliases) | When | CPU | CPU + flag | Threads change bits | CUDA | "
             "CUDA + flag | Deterministic alternative | Cost |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in det.op_catalog():
        names = f"`{e.op}`" + (" (" + ", ".join(f"`{a}`" for a in e.aliases) + ")" if e.aliases else "")
        threads = {True: "yes", False: "no", None: "-"}[e.thread_count_changes_bits]
        lines.append(f"| `{e.id}` | {names} | {_cell(e.when)} | {e.cpu} | {e.cpu_flag} | {threads} | "
                     f"{e.cuda} | {e.cuda_flag} | {_cell(e.alternative)} | {_cell(e.cost)} |")
    return "\n".join(lines)


def test_docs_tables_match_the_code():
    text = (REPO / "docs" / "determinism.md").read_text()
    hint = "regenerate with: python tests/test_determinism.py (prints both tables)"
    assert rules_table() in text, f"docs/determinism.md: rule table is stale; {hint}"
    assert ops_table() in text, f"docs/determinism.md: op table is stale; {hint}"


if __name__ == "__main__":
    print(rules_table(), ops_table(), sep="\n\n")


# --- rules about software this machine lacks: not applicable, never violations ----------

def test_cuda_and_library_rules_do_not_apply_without_that_software(clean_env):
    cpu_only = {feature: False for feature in FEATURES}
    result = run_checks(None, env=True, torch_flags=False, environ={}, platform=cpu_only)
    violated = {v.rule for v in result.violations}
    cuda_rules = {"env-cublas-workspace", "env-nccl-algo", "env-nccl-proto", "env-nvte-nondeterministic",
                  "env-flash-attention", "env-mamba", "env-causal-conv1d"}
    assert cuda_rules == set(result.not_applicable) and not violated & cuda_rules
    # these apply on any machine, but unset they cannot change the bits of runs here: advice
    assert not violated and {a.rule for a in result.advice} == {"env-pythonhashseed", "env-omp-threads"}
    assert "without CUDA" in result.not_applicable["env-cublas-workspace"]
    # CUDA and NCCL present, Transformer Engine absent: its rule alone stays out
    gpu_without_te = {**cpu_only, "cuda": True, "gpu": True, "nccl": True}
    result = run_checks(None, env=True, torch_flags=False, environ={}, platform=gpu_without_te)
    assert {"env-cublas-workspace", "env-nccl-algo"} <= {v.rule for v in result.violations}
    assert result.not_applicable["env-nvte-nondeterministic"] == "Transformer Engine is not installed"
    # a CUDA build of torch on a machine without a GPU (samebits check counts them): not applicable either
    cuda_build_no_gpu = {**gpu_without_te, "gpu": False}
    result = run_checks(None, env=True, torch_flags=False, environ={}, platform=cuda_build_no_gpu)
    assert not result.violations and result.not_applicable["env-nccl-algo"].startswith("no GPU is visible")


def test_this_machines_platform_is_detected():
    import torch

    platform = _rules_module.detect_platform()
    assert platform["cuda"] == (torch.version.cuda is not None or torch.version.hip is not None)
    assert set(platform) == set(FEATURES)
