"""The reference recipe: config, data, the recorder hooks, the CLI, the (non)deterministic
paths and expert parallelism.

Run as a script under torchrun, this file is also the 2-rank worker the EP test launches:
    torchrun --nproc_per_node 2 tests/test_recipe.py OUT_DIR
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import samebits
from samebits.errors import ConfigError
from samebits.recipes import RecipeConfig, nondeterministic_config, train
from samebits.recipes.data import Batches, SyntheticTokens, TokenFile, build_token_source
from samebits.recipes.cli import main

needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2,
                                     reason="thread-order nondeterminism needs >= 2 cores")


def _tiny(**changes) -> RecipeConfig:
    return dataclasses.replace(RecipeConfig(num_layers=2, seq_len=32, micro_batch_size=2),
                               **changes)


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))]


# --- config ------------------------------------------------------------------------------


def test_config_round_trips_and_overrides():
    cfg = RecipeConfig()
    assert RecipeConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.moe_layer_ids == [1, 3]
    changed = cfg.with_overrides(["deterministic=false", "seed=7", "lr=1e-3",
                                  "data_path=/x.bin", "moe_combine=index_put_accumulate"])
    assert (changed.deterministic, changed.seed, changed.lr, changed.data_path,
            changed.moe_combine) == (False, 7, 1e-3, "/x.bin", "index_put_accumulate")
    assert changed.with_overrides(["data_path=none"]).data_path is None
    with pytest.raises(ValueError, match="expected key=value with key one of seed"):
        cfg.with_overrides(["nope=1"])
    with pytest.raises(ValueError, match="--set seed=x: not a valid int"):
        cfg.with_overrides(["seed=x"])
    with pytest.raises(ValueError, match="unknown config key"):
        RecipeConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("changes, message", [
    ({"moe_combine": "scatter"}, "moe_combine='scatter' is not one of index_add"),
    ({"moe_grouped_gemm": "cutlass"}, "moe_grouped_gemm"),
    ({"embedding_backward": "sparse"}, "embedding_backward"),
    ({"num_heads": 3}, "even head size"),
    ({"moe_top_k": 5}, "moe_top_k=5 must be <= num_experts=4"),
    ({"dropout": 1.0}, "dropout"),
    ({"num_threads": 0}, "num_threads must be >= 1"),
    ({"vocab_size": 70000}, "use 'uint32'"),
    ({"device": "tpu"}, "device"),
])
def test_config_validation_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        RecipeConfig(**changes)


def test_nondeterministic_preset():
    cfg = nondeterministic_config()
    assert (cfg.deterministic, cfg.num_threads, cfg.moe_combine, cfg.embedding_backward) == (
        False, 2, "index_put_accumulate", "index_put_accumulate")


# --- data ------------------------------------------------------------------------------------


def _global_batches(source, micro_batch_size, world_size, steps=3):
    ranks = [Batches(source, micro_batch_size, r, world_size) for r in range(world_size)]
    return [torch.cat([b.next() for b in ranks]) for _ in range(steps)]


@pytest.fixture(params=["synthetic", "uint16", "uint32"])
def token_source(request, tmp_path):
    if request.param == "synthetic":
        return SyntheticTokens(vocab_size=512, seq_len=16, seed=3)
    path = tmp_path / f"tokens.{request.param}"
    np.random.default_rng(0).integers(0, 512, 5000).astype(request.param).tofile(path)
    return TokenFile(path, request.param, vocab_size=512, seq_len=16, seed=3)


def test_global_batch_is_the_same_for_every_world_size(token_source):
    one = _global_batches(token_source, 8, 1)
    two = _global_batches(token_source, 4, 2)
    four = _global_batches(token_source, 2, 4)
    for a, b, c in zip(one, two, four):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.shape == (8, 17) and a.dtype == torch.int64 and int(a.max()) < 512
    assert not torch.equal(one[0], one[1])


def test_data_position_is_the_only_state(token_source):
    straight = Batches(token_source, 4, 1, 2)
    expected = [straight.next() for _ in range(3)]
    resumed = Batches(token_source, 4, 1, 2)
    resumed.load_state_dict({"consumed_samples": 8})
    assert torch.equal(resumed.next(), expected[1])


def test_token_file_reads_the_file(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 500
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    source = TokenFile(path, "uint16", vocab_size=500, seq_len=10, seed=0)
    sample = source.tokens(np.array([0, 1, 99 + 7]))  # 99 samples per epoch: wraps
    for row in sample:
        start = int(np.flatnonzero(tokens == row[0])[0])
        assert np.array_equal(row, tokens[start:start + 11])
    with pytest.raises(ValueError, match="token .* >= vocab_size=100"):
        TokenFile(path, "uint16", vocab_size=100, seq_len=10, seed=0).tokens(np.arange(99))
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenFile(path, "uint16", vocab_size=500, seq_len=2000, seed=0)
    with pytest.raises(ValueError, match="is not a file"):
        build_token_source(_tiny(data_path=str(tmp_path / "missing.bin")))


def test_training_reads_a_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    SyntheticTokens(512, 32, 0).tokens(np.arange(64)).astype(np.uint16).tofile(path)
    result = train(_tiny(data_path=str(path)), steps=2)
    assert len(result.metrics) == 2 and np.isfinite(result.metrics[-1]["loss"])


# --- training and the recorder hooks --------------------------------------------------------


class FakeRecorder:
    """The duck-typed recorder API; end_step returns False at `diverge_at`."""

    def __init__(self, *args, diverge_at=None, **kwargs):
        self.calls, self.diverge_at = [], diverge_at

    def tensors(self, step, phase, named_tensors):
        named = list(named_tensors)
        assert all(isinstance(t, torch.Tensor) for _, t in named)
        self.calls.append((step, phase, [name for name, _ in named]))

    def metrics(self, step, **values):
        assert all(isinstance(v, (float, torch.Tensor)) for v in values.values())
        self.calls.append((step, "metrics", sorted(values)))

    def end_step(self, step):
        self.calls.append((step, "end_step", None))
        return step != self.diverge_at


def test_loss_goes_down():
    result = train(RecipeConfig(), steps=30)
    losses = [m["loss"] for m in result.metrics]
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert [m["lr"] for m in result.metrics[:2]] == pytest.approx([3e-4, 6e-4])


def test_recorder_sees_each_phase_in_order():
    recorder, census = FakeRecorder(), FakeRecorder()
    result = train(_tiny(), steps=2, recorder=recorder, census=census)
    assert result.stopped_at is None and result.end_step == 2
    phases = [(step, phase) for step, phase, _ in recorder.calls]
    order = ["data", "forward", "metrics", "grads", "params", "end_step"]
    assert phases == [(s, p) for s in range(2) for p in order]
    names = {phase: names for step, phase, names in recorder.calls if step == 0}
    # the state census, in its own stream, at each step start: every RNG (the router jitter
    # generator too), optimizer and LR state
    assert [(step, phase) for step, phase, _ in census.calls] == [(s, p) for s in range(2) for p in ("state", "end_step")]
    assert {"rng.python", "rng.numpy", "rng.torch_cpu", "rng.user.router_jitter", "optim0.step",
            "optim0.lr", "sched0.last_epoch"} <= set(census.calls[0][2])
    assert names["data"] == ["tokens"]
    assert names["forward"] == ["layers.0", "layers.1", "logits"]
    assert names["metrics"] == sorted(["loss", "lm_loss", "load_balancing_loss", "mtp_loss",
                                       "grad_norm", "lr"])
    assert names["grads"] == names["params"] and "layers.1.ffn.experts.w1" in names["params"]


class FilteringRecorder(FakeRecorder):
    """Keeps only some phases at some steps, as `Recorder.wants` says; counts forward hooks."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.asked = keep, []

    def wants(self, step, phase):
        self.asked.append((step, phase))
        return (step, phase) in self.keep

    def tensors(self, step, phase, named_tensors):
        assert (step, phase) in self.keep, f"built records the recorder drops: {step} {phase}"
        super().tensors(step, phase, named_tensors)

    def metrics(self, step, **values):
        assert (step, "metrics") in self.keep, f"built metrics the recorder drops at step {step}"
        super().metrics(step, **values)


def test_records_the_recorder_drops_are_never_built(monkeypatch):
    import samebits.recipes.loop as loop_module
    census_calls, hooked = [], []
    real_census, real_hooks = loop_module.checkpoint.state_census, loop_module._block_outputs
    monkeypatch.setattr(loop_module.checkpoint, "state_census",
                        lambda **kw: census_calls.append(1) or real_census(**kw))
    monkeypatch.setattr(loop_module, "_block_outputs",
                        lambda model, enabled: hooked.append(enabled) or real_hooks(model, enabled))
    keep = {(0, "params"), (1, "forward"), (1, "metrics")}
    recorder, census = FilteringRecorder(keep), FilteringRecorder({(1, "state")})
    result = train(_tiny(), steps=2, recorder=recorder, census=census)
    assert result.end_step == 2
    assert [(s, p) for s, p, _ in recorder.calls] == [
        (0, "params"), (0, "end_step"), (1, "forward"), (1, "metrics"), (1, "end_step")]
    assert [(s, p) for s, p, _ in census.calls] == [(1, "state"), (1, "end_step")]
    assert len(census_calls) == 1 and hooked == [False, True]  # no census, no hooks at step 0
    assert {p for _, p in recorder.asked} == {"data", "forward", "metrics", "grads", "params"}
    assert census.asked == [(0, "state"), (1, "state")]


class _TwoCalls:
    """A samebits.Recorder seen as a duck-typed recorder without `tensors_and_global`: the loop
    then records the params with `tensors` and `global_tensors`."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __getattr__(self, name):
        if name in ("tensors_and_global", "optimizer_step"):
            raise AttributeError(name)
        return getattr(self.recorder, name)


def _stream_after_header(directory) -> bytes:
    data = (Path(directory) / "rank-00000.sbs").read_bytes()
    length, pos = samebits.stream._format.decode_varint(data, 1)
    return data[pos + length + 4:]


def test_params_in_one_call_are_recorded_as_in_two(tmp_path):
    """The loop gives a Recorder's params to `tensors_and_global` (each parameter digested once
    for its local and global record): the stream is the one the two calls write."""
    from samebits.recipes import session

    cfg = _tiny()
    for name, wrap in (("one", lambda rec: rec), ("two", _TwoCalls)):
        with session(cfg):
            rec = samebits.Recorder(tmp_path / name, rank=0, world_size=1, run_id="same")
            train(cfg, steps=3, recorder=wrap(rec))
            rec.close()
    one, two = _stream_after_header(tmp_path / "one"), _stream_after_header(tmp_path / "two")
    assert len(one) > 1000 and one == two
    steps = list(samebits.open_run(tmp_path / "one").stream(0).steps())
    records = list(steps[2].records())
    local = {r.name: r.digest for r in records if r.phase == "params"}
    global_ = {r.name: r.digest for r in records if r.phase == "global:params"}
    assert len(local) > 20 and local == global_  # one rank: every global digest is the local one


def _grads_before_the_update_and_recorded(directory, rescale_in_place: bool):
    """Digests of the gradients just before each `optimizer.step()` (a step pre-hook), and the
    grads records the loop writes (it records them after the update)."""
    from samebits.fingerprint import digest_many
    from samebits.recipes import session
    from samebits.recipes.loop import _Run

    cfg, before = _tiny(), []
    with session(cfg):
        run = _Run(cfg, 0, 1)

        def pre_hook(optimizer, args, kwargs):
            grads = [p.grad for _, p in run.named_params if p.grad is not None]
            before.append(digest_many(grads))
            if rescale_in_place:  # an optimizer that writes its gradients (as GradScaler unscales them)
                for g in grads:
                    g.mul_(0.5)

        run.optimizer.register_step_pre_hook(pre_hook)
        with samebits.Recorder(directory, rank=0, world_size=1, phases="grads") as rec:
            for _ in range(2):
                run.train_step(rec)
                run.step += 1
    recorded = [[r.digest for r in block.records()] for block in samebits.open_run(directory).stream(0).steps()]
    return before, recorded


def test_the_grads_recorded_after_the_update_are_the_updates_gradients(tmp_path):
    """The loop records gradients next to the parameters, after `optimizer.step()` (one stretch of
    recording per step): true only while the optimizer leaves them as they are. AdamW does; an
    optimizer that rescales them in place would be caught here."""
    before, recorded = _grads_before_the_update_and_recorded(tmp_path / "adamw", rescale_in_place=False)
    assert len(recorded) == 2 and len(recorded[0]) > 20 and recorded == before
    before, recorded = _grads_before_the_update_and_recorded(tmp_path / "rescaled", rescale_in_place=True)
    assert recorded != before


def test_the_parameter_list_is_the_one_the_optimizer_updates(tmp_path):
    """The loop lists the parameters once; a resume loads into those same tensors."""
    from samebits.recipes import session
    from samebits.recipes.loop import _Run

    cfg = _tiny()
    saved = train(cfg, steps=2, save_at=1, ckpt_dir=tmp_path / "ckpt")
    with session(cfg):
        run = _Run(cfg, 0, 1)
        run.resume(saved.checkpoint)
        run.train_step(None)
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        assert [(n, id(p)) for n, p in run.named_params] == [(n, id(p)) for n, p in run.model.named_parameters()]
        assert {id(p) for _, p in run.named_params} == {id(p) for p in params}


def test_recorder_divergence_stops_the_run():
    result = train(_tiny(), steps=5, recorder=FakeRecorder(diverge_at=1))
    assert result.stopped_at == 1 and result.end_step == 2 and len(result.metrics) == 2


@needs_two_cores
def test_deterministic_path_is_bitwise_repeatable_with_two_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # deterministic mode pins it
    cfg = dataclasses.replace(RecipeConfig(), num_threads=2, micro_batch_size=8)
    a, b = train(cfg, steps=3), train(cfg, steps=3)
    assert _differing(a.params, b.params) == []
    assert [m["loss"] for m in a.metrics] == [m["loss"] for m in b.metrics]


@needs_two_cores
def test_nondeterministic_path_differs_from_run_to_run():
    # The race needs both threads running at once; on a loaded machine one pair of runs can
    # come out equal by chance, so a few more runs are allowed before calling it repeatable.
    cfg = nondeterministic_config()
    first = train(cfg, steps=3)
    assert any(_differing(first.params, train(cfg, steps=3).params) for _ in range(4)), \
        "five nondeterministic runs gave the same bits"


@needs_two_cores
def test_the_cpu_facts_behind_the_options():
    """F.embedding's and index_add_'s backward are repeatable with 2 threads; the backward of
    advanced indexing (index_put_ accumulate) is not, above ATen's 32768-element grain."""
    torch.manual_seed(0)
    index, grad = torch.randint(0, 512, (2048,)), torch.randn(2048, 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def weight_grad(lookup):
            weight = torch.zeros(512, 64, requires_grad=True)
            lookup(weight).backward(grad)
            return weight.grad.view(torch.int32)

        def distinct(lookup, runs=10):
            return len({weight_grad(lookup).numpy().tobytes() for _ in range(runs)})

        assert distinct(lambda w: F.embedding(index, w)) == 1
        assert distinct(lambda w: w.index_select(0, index)) == 1
        # the race needs both threads at once: on a loaded machine allow more tries to show it
        assert distinct(lambda w: w[index], runs=50) > 1
    finally:
        torch.set_num_threads(previous)


def test_kernel_options_are_wired():
    try:
        import samebits.kernels  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="moe_combine='triton_deterministic' needs"):
            train(_tiny(moe_combine="triton_deterministic"), steps=1)
        return
    import contextlib
    import warnings

    # With Triton runnable (a GPU, or TRITON_INTERPRET=1 as in this suite) the kernels run;
    # otherwise the torch reference runs and says so.
    expectation = contextlib.nullcontext() if samebits.kernels.available() else pytest.warns(UserWarning)
    with expectation, warnings.catch_warnings():
        result = train(_tiny(moe_combine="triton_deterministic",
                             moe_grouped_gemm="triton_deterministic"), steps=2)
    reference = train(_tiny(), steps=2)
    assert [m["loss"] for m in result.metrics] == pytest.approx(
        [m["loss"] for m in reference.metrics], rel=1e-5)


def test_deterministic_mode_refuses_a_nondeterministic_option():
    with pytest.raises(samebits.DeterminismError, match="moe_combine"):
        train(_tiny(moe_combine="index_put_accumulate"), steps=1)


# --- command line ---------------------------------------------------------------------------

TINY_ARGS = ["--set", "num_layers=2", "--set", "seq_len=32", "--set", "micro_batch_size=2"]


def test_cli_prints_one_line_per_step(capsys):
    assert main(["--steps", "2", *TINY_ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split() for line in lines] == [["step", "0"], ["step", "1"]]
    assert "grad_norm" in lines[0] and "lr 3.00e-04" in lines[0] and lines[0].endswith("ms")


def test_cli_keep_going_saves_and_trains_on_like_an_uninterrupted_run(tmp_path, capsys):
    """--save-at K --keep-going: the checkpoint of step K, and the run goes on to --steps with
    the same bits as a run that never saved (verify's run A saves this way; B never saves)."""
    assert main(["--steps", "3", *TINY_ARGS]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(["--steps", "3", *TINY_ARGS, "--save-at", "1", "--ckpt", str(tmp_path / "ckpt"), "--keep-going"]) == 0
    saving = capsys.readouterr().out.splitlines()
    assert saving[1].startswith("saved ") and saving[1].endswith("(before step 1); going on"), saving
    assert (tmp_path / "ckpt" / "step-1").is_dir()
    steps = [line for line in saving if line.startswith("step")]
    # the loss's float bits (in brackets) and every other field but the time are the same
    assert [line.rsplit("|", 1)[0] for line in steps] == [line.rsplit("|", 1)[0] for line in plain]


@pytest.mark.parametrize("argv, message", [
    (["--set", "nope=1"], "expected key=value"),
    (["--save-at", "1"], "--save-at and --ckpt go together"),
    (["--reference", "x"], "--reference needs --out"),
    (["--keep-going"], "--keep-going needs --save-at"),
    (["--set", "moe_combine=index_put_accumulate"], "moe_combine"),
])
def test_cli_errors_exit_2(argv, message, capsys):
    assert main(["--steps", "1", *TINY_ARGS, *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_stops_with_exit_3_when_the_recorder_reports_divergence(monkeypatch, tmp_path,
                                                                    capsys):
    made = {}

    def recorder(out, **kwargs):
        made.update(kwargs, out=out)
        return FakeRecorder(diverge_at=1)

    monkeypatch.setattr(samebits, "Recorder", recorder, raising=False)
    argv = ["--steps", "4", *TINY_ARGS, "--out", str(tmp_path / "b"),
            "--reference", str(tmp_path / "a")]
    assert main(argv) == 3
    assert "stopped at step 1: diverged from reference" in capsys.readouterr().out
    assert made["rank"] == 0 and made["world_size"] == 1 and made["coords"] == {"dp": 0, "ep": 0, "tp": 0, "pp": 0}
    assert made["reference"] == tmp_path / "a" and made["config"]["num_layers"] == 2


def test_cli_runs_as_a_module(tmp_path):
    result = subprocess.run([sys.executable, "-m", "samebits.recipes", "--steps", "1",
                             *TINY_ARGS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("step     0 | loss ")
    assert "RuntimeWarning" not in result.stderr


def test_train_is_the_function_and_the_old_module_is_gone():
    import importlib

    import samebits.recipes
    from samebits.recipes import train

    assert train is samebits.recipes.loop.train and callable(samebits.recipes.train)
    with pytest.raises(ModuleNotFoundError):  # `python -m samebits.recipes.train` is gone
        importlib.import_module("samebits.recipes.train")


# --- expert parallelism over 2 ranks ----------------------------------------------------------


def _ep_config(world_size: int) -> RecipeConfig:
    """No per-rank randomness and no per-rank load-balancing term, so 2 ranks compute the
    same mathematics as 1 rank with the same global batch (up to summation order)."""
    return _tiny(dropout=0.0, moe_jitter_eps=0.0, moe_aux_loss_coeff=0.0,
                 micro_batch_size=4 // world_size)


def test_expert_parallel_matches_one_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(30500 + os.getpid() % 1000), __file__, str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(2)]
    single = train(_ep_config(1), steps=3)
    assert [m["mean_loss"] for m in single.metrics] == pytest.approx(
        ranks[0]["mean_losses"].tolist(), rel=1e-5)
    for name, value in single.params.items():
        if ".experts." in name:  # rank r holds experts [2r, 2r+2)
            parallel = torch.cat([ranks[0]["params"][name], ranks[1]["params"][name]])
        else:
            parallel = ranks[0]["params"][name]
            assert torch.equal(parallel, ranks[1]["params"][name]), f"{name} replicas differ"
        torch.testing.assert_close(parallel, value, rtol=1e-4, atol=1e-5, msg=name)
    assert ranks[0]["uneven"], "the test should exercise uneven all_to_all splits"


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from samebits.recipes import communication

    uneven = []
    original = communication._AllToAll.forward

    def spy(ctx, rows, output_splits, input_splits, group):
        uneven.append(len(set(input_splits)) > 1)
        return original(ctx, rows, output_splits, input_splits, group)

    communication._AllToAll.forward = staticmethod(spy)
    dist.init_process_group("gloo")
    result = train(_ep_config(2), steps=3)
    torch.save({"params": result.params, "uneven": any(uneven),
                "mean_losses": torch.tensor([m["mean_loss"] for m in result.metrics],
                                            dtype=torch.float64)},
               out_dir / f"rank-{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    # Everything is written. Skip the C++ static destructors: under load a gloo process
    # occasionally aborts there (SIGABRT, "terminate called without an active exception").
    # (Inside this block: at module level it would end pytest itself when it imports this file.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_default_thread_count_honours_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert RecipeConfig().num_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # exported by most cluster launchers
    assert RecipeConfig().num_threads == 3 and RecipeConfig().to_dict()["num_threads"] == 3
    assert RecipeConfig(num_threads=1).num_threads == 1  # an explicit choice wins (and is checked)
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='many' is not a positive integer"):
        RecipeConfig()


def test_recipe_rules_cover_every_literal_choice():
    """The recipe's determinism rules (registered by importing samebits.recipes) judge every
    value its Literal option types allow: each is deterministic or known nondeterministic."""
    from samebits.determinism import check, rules
    from samebits.recipes.config import literal_choices
    from samebits.recipes.rules import RECIPE_CHOICES

    choices = literal_choices(RecipeConfig)
    for key, (good, bad, _why) in RECIPE_CHOICES.items():
        assert set(good) | set(bad) == set(choices[key]), key
        assert f"recipe-{key.replace('_', '-')}" in {r.id for r in rules()}
        for value in bad:
            (violation,) = check({key: value}, env=False)
            assert violation.setting == key and "unknown" not in violation.fix
    with pytest.raises(ConfigError, match="moe_combine='magic' is not one of index_add"):
        RecipeConfig(moe_combine="magic")
