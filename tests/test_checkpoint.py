"""Exact resume: bitwise equality of save/exit/resume with an uninterrupted run, per-rank
random states, the atomic commit, layout checks and the no-pickle loading.

Run as a script under torchrun, this file is also the 2-rank worker the tests launch:
    torchrun --nproc_per_node 2 tests/test_checkpoint.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import samebits
from samebits import checkpoint
from samebits.checkpoint import CheckpointError, CheckpointLayoutError, StateBundle
from samebits.errors import ConfigError, SamebitsError
from samebits.recipes import RecipeConfig, train

STEPS, SAVE_AT = 5, 2


def _tiny() -> RecipeConfig:
    return RecipeConfig(num_layers=2, seq_len=32, micro_batch_size=2)


def _assert_same_run(a, b):
    """Per-step metrics (except timings) and final parameters bitwise equal."""
    strip = [{k: v for k, v in m.items() if k != "step_time_s"} for m in a]
    assert strip == [{k: v for k, v in m.items() if k != "step_time_s"} for m in b]


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


# --- the state census is samebits' own torch work ----------------------------------------


class _SeenOps(TorchDispatchMode):
    """Every ATen op dispatched while it is in force (what a tracer's mode would see)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_state_census_runs_outside_the_dispatch_modes_in_force():
    """A mode pushed around a training loop (the tracer's rung 3) never sees the census's ops,
    whoever calls it; the mode is back in force right after, for the loop's own ops."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # per-parameter "step" tensors: the census stacks them (ATen ops)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with _SeenOps() as seen:
        records = checkpoint.state_census(optimizers=[optimizer], schedulers=[scheduler],
                                          generators={"g": torch.Generator().manual_seed(1)})
        assert seen.ops == []
        torch.ones(2).add_(1)
    assert "aten::add_" in seen.ops
    assert [name for name, _ in records if name.startswith(("optim", "sched"))] == [
        "optim0.step", "optim0.lr", "optim0.hparams", "sched0.last_epoch", "sched0.step_count", "sched0.lr"]
    assert records[[n for n, _ in records].index("optim0.step")][1].tolist() == [1, 1]


# --- world size 1, in process ----------------------------------------------------------


@pytest.fixture(scope="module")
def straight():
    return train(_tiny(), steps=STEPS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, straight):
    root = tmp_path_factory.mktemp("ckpt")
    result = train(_tiny(), steps=STEPS, save_at=SAVE_AT, ckpt_dir=root)
    assert result.end_step == SAVE_AT and result.checkpoint == root / f"step-{SAVE_AT}"
    _assert_same_run(result.metrics, straight.metrics[:SAVE_AT])
    return root


def test_resume_is_bitwise_equal_to_straight_run(straight, saved):
    resumed = train(_tiny(), steps=STEPS, resume_from=saved)
    assert resumed.start_step == SAVE_AT and resumed.end_step == STEPS
    _assert_same_run(resumed.metrics, straight.metrics[SAVE_AT:])
    assert _same_params(resumed.params, straight.params)
    assert (saved / "latest").read_text().strip() == f"step-{SAVE_AT}"


@pytest.mark.parametrize("dropped", ["torch_cpu", "router_jitter"])
def test_dropping_a_consumed_random_state_breaks_resume_at_the_first_step(
        straight, saved, dropped, monkeypatch):
    monkeypatch.setenv(checkpoint.DROP_RNG_ENV, dropped)
    resumed = train(_tiny(), steps=STEPS, resume_from=saved)
    assert resumed.metrics[0]["step"] == SAVE_AT
    # dropout (torch_cpu) and router jitter both act in the forward of the first step
    assert resumed.metrics[0]["loss"] != straight.metrics[SAVE_AT]["loss"]
    assert not _same_params(resumed.params, straight.params)


@pytest.mark.parametrize("dropped", ["python", "numpy"])
def test_states_the_recipe_does_not_draw_from_do_not_matter(straight, saved, dropped,
                                                           monkeypatch):
    monkeypatch.setenv(checkpoint.DROP_RNG_ENV, dropped)
    resumed = train(_tiny(), steps=STEPS, resume_from=saved)
    assert _same_params(resumed.params, straight.params)


def test_drop_switch_rejects_unknown_names(saved, monkeypatch):
    monkeypatch.setenv(checkpoint.DROP_RNG_ENV, "torch_cuda_typo")
    with pytest.raises(ValueError, match="torch_cuda_typo"):
        train(_tiny(), steps=STEPS, resume_from=saved)


def test_resaving_a_step_replaces_it_and_damage_is_reported(tmp_path, saved, straight):
    root = tmp_path / "copy"
    shutil.copytree(saved, root)
    again = train(_tiny(), steps=STEPS, resume_from=root, save_at=SAVE_AT, ckpt_dir=root)
    assert again.checkpoint == root / f"step-{SAVE_AT}" and again.metrics == []
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step-{SAVE_AT}"]
    resumed = train(_tiny(), steps=STEPS, resume_from=root)
    assert _same_params(resumed.params, straight.params)
    (root / f"step-{SAVE_AT}" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp, which has 0: the shard is truncated"):
        train(_tiny(), steps=STEPS, resume_from=root)


def test_resume_continues_the_stream_and_a_lost_state_is_caught_live(tmp_path, monkeypatch):
    """With samebits' Recorder: save/exit/resume records the same bits as the straight run;
    a resume that loses the router-jitter state stops at the first step after the resume."""
    if not hasattr(samebits, "Recorder"):
        pytest.skip("samebits.Recorder is not in this install")
    from samebits.recipes.cli import main

    tiny = ["--steps", str(STEPS), *_tiny_cli_args()]
    a, b, lost, ckpt = (str(tmp_path / name) for name in ("a", "b", "lost", "ckpt"))
    assert main([*tiny, "--out", a]) == 0
    assert main([*tiny, "--out", b, "--reference", a, "--save-at", str(SAVE_AT),
                 "--ckpt", ckpt]) == 0
    assert main([*tiny, "--out", b, "--reference", a, "--resume-from", ckpt]) == 0
    assert samebits.diff(a, b).identical
    monkeypatch.setenv(checkpoint.DROP_RNG_ENV, "router_jitter")
    assert main([*tiny, "--out", lost, "--reference", a, "--resume-from", ckpt]) == 3


def test_load_under_another_layout_is_refused(saved):
    cfg = dataclasses.replace(_tiny(), num_experts=4)
    from samebits.recipes.model import Transformer

    bundle = StateBundle(model=Transformer(cfg), layout={"dp": 2, "ep": 2})
    with pytest.raises(CheckpointLayoutError, match=r"world_size=1 .*layout \{'dp': 1, 'ep': 1\}"):
        checkpoint.load(saved, bundle)
    assert issubclass(CheckpointLayoutError, SamebitsError)


def test_missing_or_incomplete_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.resolve(tmp_path)
    (tmp_path / "latest").write_text("step-9\n")
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve(tmp_path)


def test_resume_with_another_config_warns(saved):
    with pytest.warns(UserWarning, match="dropout: 0.1 -> 0.2"):
        train(dataclasses.replace(_tiny(), dropout=0.2), steps=SAVE_AT + 1, resume_from=saved)


# --- the generic API a user adopts in their own loop ---------------------------------------


def test_rng_capture_and_restore_round_trip():
    torch_gen = torch.Generator().manual_seed(5)
    numpy_gen = np.random.default_rng(7)
    gens = {"torch_gen": torch_gen, "numpy_gen": numpy_gen}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    state = checkpoint.capture_rng_state(gens)

    def draw():
        return (random.random(), np.random.normal(), torch.rand(3).tolist(),
                torch.rand(2, generator=torch_gen).tolist(), numpy_gen.random())

    first = draw()
    checkpoint.restore_rng_state(state, gens)
    assert draw() == first
    checkpoint.restore_rng_state(state, gens, skip=["torch_cpu"])
    again = draw()
    assert again[2] != first[2] and again[:2] == first[:2] and again[3:] == first[3:]
    with pytest.raises(ValueError, match="same named generators"):
        checkpoint.restore_rng_state(state, {"torch_gen": torch_gen})


def test_user_bundle_round_trip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data_gen = np.random.default_rng(0)

    def step():
        x = torch.from_numpy(data_gen.normal(size=(3, 4)).astype(np.float32))
        loss = nn.functional.dropout(model(x), 0.5).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()

    for _ in range(3):
        step()
    bundle = StateBundle(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                         progress={"step": 3}, generators={"data": data_gen},
                         metadata={"note": "hi", "pair": (1, 2.5)})
    checkpoint.save(tmp_path, bundle)
    expected = [step() for _ in range(3)]
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(123)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data_gen = np.random.default_rng(99)
    model = model2
    bundle = StateBundle(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                         generators={"data": data_gen})
    assert checkpoint.load(tmp_path, bundle) == tmp_path / "step-3"
    assert bundle.progress == {"step": 3} and bundle.metadata == {"note": "hi", "pair": (1, 2.5)}
    assert [step() for _ in range(3)] == expected
    assert _same_params({n: p.detach() for n, p in model.named_parameters()}, expected_params)


def test_metadata_unpickler_refuses_foreign_globals(tmp_path):
    torch.manual_seed(0)
    bundle = StateBundle(model=nn.Linear(2, 2), progress={"step": 1})
    directory = checkpoint.save(tmp_path, bundle)
    metadata = directory / ".metadata"
    evil = tmp_path / "evil-ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {evil}",))

    metadata.write_bytes(pickle.dumps(Evil()))
    _resign_metadata(directory)
    with pytest.raises(CheckpointError, match="not a DCP metadata type"):
        checkpoint.load(tmp_path, StateBundle(model=nn.Linear(2, 2)))
    assert not evil.exists()


# --- hostile and damaged checkpoints ----------------------------------------------------------


def _saved_linear(root: Path, seed: int, step: int = 1) -> tuple[Path, torch.Tensor]:
    """Save an nn.Linear(2, 2) made with `seed` as ROOT/step-<step>; return it and its weight."""
    torch.manual_seed(seed)
    model = nn.Linear(2, 2)
    directory = checkpoint.save(root, StateBundle(model=model, progress={"step": step}))
    return directory, model.weight.detach().clone()


def _loaded_weight(root: Path) -> torch.Tensor:
    model = nn.Linear(2, 2)
    checkpoint.load(root, StateBundle(model=model))
    return model.weight.detach().clone()


def _sha256_of(value: dict) -> str:
    """The checksum a samebits JSON file records: sha256 of its canonical text without it."""
    import hashlib

    text = json.dumps({k: v for k, v in value.items() if k != "sha256"}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _edit_json(path: Path, edit, *, resign: bool = True) -> None:
    """Apply `edit(value)` to a checkpoint's JSON file.  `resign` re-records its checksum (what
    a crafted file would do), so that the check under test is the one that refuses it; a
    checkpoint written without checksums (older samebits) gets none."""
    value = json.loads(path.read_text())
    signed = "sha256" in value
    edit(value)
    if signed and resign:
        value["sha256"] = _sha256_of(value)
    # _TOO_DEEP stands for nesting deeper than `json` itself can write (or read)
    path.write_text(json.dumps(value).replace(json.dumps(_TOO_DEEP), "[" * 100_000 + "]" * 100_000))


_TOO_DEEP = "<100000 nested lists>"


def _resign_metadata(directory: Path) -> None:
    """Re-record the sha256 of .metadata in meta.json (where it records one)."""
    import hashlib

    def record(meta):
        if "metadata_sha256" in meta:
            meta["metadata_sha256"] = hashlib.sha256((directory / ".metadata").read_bytes()).hexdigest()

    _edit_json(directory / "meta.json", record)


def _tamper_metadata(directory: Path, edit, *, resign: bool = True) -> None:
    """Rewrite DCP's .metadata with `edit(metadata)` applied (a hostile or damaged file),
    re-recording its checksum unless `resign` is false."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    edit(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    if resign:
        _resign_metadata(directory)


def test_bytes_entry_in_dcp_metadata_is_refused_and_never_unpickled(tmp_path):
    """Only allow-listed DCP classes, but one entry declared as bytes: DCP's planner would
    `torch.load(weights_only=False)` the file it names, running the payload."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    directory, _ = _saved_linear(tmp_path, seed=0)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    (directory / "__0_1.distcp").write_bytes(buffer.getvalue())

    def declare_bytes(metadata):
        metadata.state_dict_metadata["model/weight"] = BytesStorageMetadata()
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items()
                                 if k.fqn != "model/weight"}
        metadata.storage_data[MetadataIndex("model/weight")] = _StorageInfo(
            "__0_1.distcp", 0, len(buffer.getvalue()))

    _tamper_metadata(directory, declare_bytes)
    with pytest.raises(CheckpointError, match=r"model/weight.*BytesStorageMetadata"):
        _loaded_weight(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["Enum", "Metadata.__class__", "dataclass"])
def test_metadata_unpickler_takes_only_classes_defined_by_dcp_metadata(name):
    """The metadata module imports enum.Enum and dataclasses.dataclass; a global naming
    them (or walking a dotted path) through that module is not one of DCP's classes."""
    from samebits.checkpoint._dcp_metadata import _MetadataUnpickler

    module = b"torch.distributed.checkpoint.metadata"
    payload = (b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module
               + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode()
               + pickle.STACK_GLOBAL + pickle.STOP)
    with pytest.raises(CheckpointError, match="not a DCP metadata type"):
        _MetadataUnpickler(io.BytesIO(payload)).load()


def test_dcp_planner_refuses_bytes_reads_even_past_the_metadata_check():
    """Second line of defence: the planner samebits hands DCP never unpickles bytes."""
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from samebits.checkpoint._dcp_metadata import _tensor_only_planner

    marker_payload = io.BytesIO(pickle.dumps(("not", "read")))
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("x"), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex("x"), storage_offsets=torch.Size([0]),
                    lengths=torch.Size([0]))
    with pytest.raises(CheckpointError, match="bytes"):
        _tensor_only_planner().load_bytes(item, marker_payload)


@pytest.mark.parametrize("relative_path", ["../outside.distcp", "/tmp/outside.distcp",
                                           "sub/__0_0.distcp"])
def test_dcp_shard_path_outside_the_checkpoint_is_refused(tmp_path, relative_path):
    directory, _ = _saved_linear(tmp_path, seed=0)

    def redirect(metadata):
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative_path)

    _tamper_metadata(directory, redirect)
    with pytest.raises(CheckpointError, match="shard file"):
        _loaded_weight(tmp_path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _drop_world_size(path: Path) -> None:
    meta = json.loads(path.read_text())
    del meta["world_size"]
    path.write_text(json.dumps(meta))


def _truncate_resigned(path: Path) -> None:
    _truncate(path)
    _resign_metadata(path.parent)


@pytest.mark.parametrize("name, damage, message", [
    ("rank-0.json", _truncate, r"rank-0\.json is damaged"),
    (".metadata", _truncate, r"\.metadata does not match the sha256 that meta\.json records"),
    (".metadata", _truncate_resigned, r"\.metadata is damaged"),
    ("meta.json", _truncate, r"meta\.json is damaged"),
    ("meta.json", _drop_world_size, r"meta\.json has no 'world_size'"),
    ("rank-0.json", lambda p: p.write_text('{"rank": 0}'), r"rank-0\.json lacks"),
])
def test_damaged_checkpoint_files_are_a_checkpoint_error_naming_the_file(
        tmp_path, name, damage, message):
    directory, _ = _saved_linear(tmp_path, seed=0)
    damage(directory / name)
    with pytest.raises(CheckpointError, match=message) as caught:
        _loaded_weight(tmp_path)
    assert str(directory / name) in str(caught.value)
    assert "older" in str(caught.value) or "save" in str(caught.value)  # what to do


@pytest.mark.parametrize("pointer", ["../elsewhere/step-1", "ABSOLUTE", "..", "step-1/../../elsewhere/step-1"])
def test_latest_pointing_outside_the_root_is_refused(tmp_path, pointer):
    elsewhere, _ = _saved_linear(tmp_path / "elsewhere", seed=0)
    root = tmp_path / "root"
    _saved_linear(root, seed=1)
    (root / "latest").write_text(str(elsewhere) if pointer == "ABSOLUTE" else pointer)
    with pytest.raises(CheckpointError, match="inside"):
        checkpoint.resolve(root)


def test_latest_symlinked_out_of_the_root_is_refused(tmp_path):
    elsewhere, _ = _saved_linear(tmp_path / "elsewhere", seed=0)
    root = tmp_path / "root"
    _saved_linear(root, seed=1)
    (root / "step-7").symlink_to(elsewhere)
    (root / "latest").write_text("step-7\n")
    with pytest.raises(CheckpointError, match="inside"):
        checkpoint.resolve(root)


# --- all or nothing: what a crafted or damaged checkpoint cannot do (issue 25 item 5) ---------


class _Hung(BaseException):
    """Raised into a load that blocked: a BaseException, so no `except Exception` (or OSError)
    in the code under test turns it into an ordinary error."""


@contextlib.contextmanager
def _no_hang(seconds: int = 10):
    """A load that blocks (a FIFO opened for reading) fails the test instead of hanging it,
    whatever the code under test makes of the interruption."""
    fired = []

    def alarm(signum, frame):
        fired.append(1)
        raise _Hung(f"the load hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    except _Hung:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if fired:
            pytest.fail(f"the load hung (interrupted after {seconds} s)")


class _Warmup:
    """A callable LR factor with state (LambdaLR saves its __dict__)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


def _rich_bundle(seed: int, steps: int = 0) -> StateBundle:
    """Model, AdamW, LambdaLR with a stateful factor, a torch and a NumPy generator, metadata;
    `steps` optimizer steps taken (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(3))
    for _ in range(steps):
        model(torch.randn(4, 2)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return StateBundle(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                       progress={"step": steps, "consumed_samples": 4 * steps},
                       generators={"t": torch.Generator().manual_seed(seed),
                                   "n": np.random.default_rng(seed)},
                       metadata={"config": {"seed": seed, "pair": (1, 2.5)}})


def _snapshot(bundle: StateBundle) -> dict:
    """Everything a load may change, as plain values and cloned tensors (for `_same`)."""
    scheduler = bundle.lr_scheduler
    return {
        "model": {k: v.clone() for k, v in bundle.model.state_dict().items()},
        "optimizer": _clone(bundle.optimizer.state_dict()),
        "scheduler": _clone(scheduler.state_dict()),
        "scheduler_attrs": sorted(vars(scheduler)),
        "scheduler_bound": scheduler.optimizer is bundle.optimizer,  # not in its state_dict
        "lambda_attrs": [sorted(vars(f)) for f in scheduler.lr_lambdas],
        "progress": dict(bundle.progress), "metadata": _clone(bundle.metadata),
        "rng": (random.getstate(), _clone(np.random.get_state(legacy=False)),
                torch.get_rng_state().clone()),
        "generators": {"t": bundle.generators["t"].get_state().clone(),
                       "n": _clone(bundle.generators["n"].bit_generator.state)},
    }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _same(a, b) -> bool:
    """Bitwise equality of snapshots (tensors by their bytes, floats by repr: NaN == NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                                       b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.fixture
def rich(tmp_path):
    """A saved rich bundle (2 steps) and its snapshot: (root, step directory, snapshot)."""
    bundle = _rich_bundle(seed=0, steps=2)
    directory = checkpoint.save(tmp_path / "ckpt", bundle)
    return tmp_path / "ckpt", directory, _snapshot(bundle)


def _refused_untouched(root: Path, match: str) -> CheckpointError:
    """Load into a fresh bundle: CheckpointError matching `match`, and the bundle (and the
    global random states) exactly as before the load: all or nothing."""
    bundle = _rich_bundle(seed=1)
    before = _snapshot(bundle)
    with _no_hang():
        with pytest.raises(CheckpointError, match=match) as caught:
            checkpoint.load(root, bundle)
    assert _same(_snapshot(bundle), before), "a refused load changed the bundle"
    return caught.value


def test_rich_bundle_round_trip_is_exact(rich):
    root, _, saved = rich
    bundle = _rich_bundle(seed=1)
    with _no_hang():
        checkpoint.load(root, bundle)
    random.setstate(saved["rng"][0])  # the global states are compared by the snapshot: put the
    np.random.set_state(saved["rng"][1])  # saved ones back where the fresh build drew from them
    torch.set_rng_state(saved["rng"][2])
    checkpoint.load(root, bundle)
    assert _same(_snapshot(bundle), saved)


def _shrink_chunk(metadata):
    chunk = metadata.state_dict_metadata["model/0.weight"].chunks[0]
    chunk.sizes = torch.Size([1, 2])  # rows 1 and 2 of the [3, 2] weight: no chunk


def _overlap_chunks(metadata):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    entry = metadata.state_dict_metadata["model/0.weight"]
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 2])),
                    ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 2]))]


def _chunk_outside(metadata):
    chunk = metadata.state_dict_metadata["model/0.weight"].chunks[0]
    chunk.offsets = torch.Size([1, 0])


@pytest.mark.parametrize("edit, problem", [
    (_shrink_chunk, r"hold 2 element\(s\) of its 6"),
    (_overlap_chunks, r"overlap"),  # 4 + 2 elements: as many as the tensor has, row 2 in none
    (_chunk_outside, r"include one at \[1, 0\] of size \[3, 2\], outside it"),
])
def test_chunks_must_cover_every_element_of_a_tensor_exactly_once(rich, edit, problem):
    """Metadata whose chunks leave elements of a tensor uncovered: DCP reads only the chunks,
    so the old code loaded `torch.empty`'s uninitialised memory into the model (weights like
    -4.3e34), silently.  Refused, naming the tensor and the file."""
    root, directory, _ = rich
    _tamper_metadata(directory, edit)
    err = _refused_untouched(root, r"chunks of tensor 'model/0\.weight' \(\[3, 2\]\) " + problem)
    assert str(directory / ".metadata") in str(err) and "uninitialised" in str(err)


def _outside_copy(path: Path) -> Path:
    outside = path.parent.parent.parent / "outside" / path.name
    outside.parent.mkdir(exist_ok=True)
    shutil.copy(path, outside)
    return outside


@pytest.mark.parametrize("name", ["meta.json", "rank-0.json", ".metadata", "__0_0.distcp", "latest"])
def test_files_symlinked_out_of_the_checkpoint_are_refused(rich, name):
    """A symlink to an identical file outside: the old code followed it (loaded the outside
    file); now only regular files inside the checkpoint directory are opened."""
    root, directory, _ = rich
    path = root / name if name == "latest" else directory / name
    outside = _outside_copy(path)
    path.unlink()
    path.symlink_to(outside)
    _refused_untouched(root, rf"{re.escape(str(path))} is a symbolic link")


@pytest.mark.parametrize("name", ["meta.json", "rank-0.json", ".metadata", "__0_0.distcp", "latest"])
def test_a_fifo_in_place_of_a_file_is_refused_without_hanging(rich, name):
    """Opening a FIFO for reading blocks until a writer comes: the old load hung on
    rank-0.json, .metadata and the shards.  Files are opened non-blocking and must be regular."""
    root, directory, _ = rich
    path = root / name if name == "latest" else directory / name
    path.unlink()
    os.mkfifo(path)
    _refused_untouched(root, rf"{re.escape(str(path))} is not a regular file \(a FIFO\)")


def test_latest_is_read_with_a_size_bound(rich):
    """`latest` holds one name: the old code read it whole (a 3 GiB one: out of memory); now
    at most 4 KiB.  16 MiB of trailing blanks around a valid name show it: the old code read
    them all and loaded."""
    root, _, _ = rich
    with open(root / "latest", "w") as file:
        file.write("step-2\n")
        file.truncate(16 << 20)  # sparse: 16 MiB of NUL bytes after the name
    _refused_untouched(root, r"latest holds more than 4096 bytes")


def _set(path: tuple, value):
    def edit(tree):
        for key in path[:-1]:
            tree = tree[key]
        tree[path[-1]] = value
    return edit


def _nest(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


_MALFORMED = [  # (id, edit of rank-0.json, the field the message must name)
    ("huge-shape", _set(("tensors", "rng@rank0/torch_cpu", "shape"), [2 ** 40, 2 ** 40]),
     r"tensor 'rng@rank0/torch_cpu'"),
    ("numpy-pos", _set(("rng", "numpy", "pos"), 10 ** 6), r"field rng\.numpy\.pos"),
    ("numpy-has-gauss", _set(("rng", "numpy", "has_gauss"), 7), r"field rng\.numpy\.has_gauss"),
    ("numpy-bit-generator", _set(("rng", "numpy", "bit_generator"), "PCG64"),
     r"field rng\.numpy\.bit_generator"),
    ("python-gauss", _set(("rng", "python", "gauss"), "abc"), r"field rng\.python\.gauss"),
    ("python-version", _set(("rng", "python", "version"), "x"), r"field rng\.python\.version"),
    ("generator-state", _set(("rng", "generators", "n", "state", "inc"), "abc"),
     r"field rng\.generators\.n"),
    ("param-groups-empty", _set(("optimizer", "param_groups"), []),
     r"field optimizer\.param_groups holds 0 group"),
    ("param-group-lr", _set(("optimizer", "param_groups", 0, "lr"), "abc"),
     r"field optimizer\.param_groups\[0\]\.lr"),
    ("param-group-extra", _set(("optimizer", "param_groups", 0, "foreach_evil"), 1),
     r"field optimizer\.param_groups\[0\]\.foreach_evil"),
    ("state-points-elsewhere", _set(("optimizer", "state", "0.weight", "exp_avg"),
                                    {"__tensor__": "model/0.weight"}),
     r"field optimizer\.state\.0\.weight\.exp_avg: refers to tensor 'model/0\.weight'"),
    ("progress-abc", _set(("progress",), "abc"), r"field progress"),
    ("progress-step", _set(("progress", "step"), "2"), r"field progress\.step"),
    ("deep-nesting", _set(("metadata", "config", "deep"), _nest(300)), r"field metadata\.config\.deep"),
    ("very-deep-nesting", _set(("metadata",), _TOO_DEEP), r"rank-0\.json is damaged \(RecursionError"),
    ("tuple-tag", _set(("metadata", "config", "pair"), {"__tuple__": 5}),
     r"field metadata\.config\.pair: holds a __tuple__ tag on a number"),
]


@pytest.mark.parametrize("edit, field", [case[1:] for case in _MALFORMED],
                         ids=[case[0] for case in _MALFORMED])
def test_malformed_fields_are_a_checkpoint_error_naming_file_and_field(rich, edit, field):
    """Crafted rank-0.json fields (checksum re-recorded, as a crafted file would): the old code
    raised ValueError, TypeError, RecursionError or RuntimeError tracebacks, or loaded them and
    failed later.  Now: a CheckpointError naming the file and the field and what to do, with
    the bundle untouched."""
    root, directory, _ = rich
    _edit_json(directory / "rank-0.json", edit)
    err = _refused_untouched(root, field)
    assert str(directory / "rank-0.json") in str(err)
    assert "older step-K directory" in str(err) or "build the" in str(err)


def _bad_properties(metadata):
    metadata.state_dict_metadata["model/0.weight"].properties = 5


def _bad_size(metadata):
    metadata.state_dict_metadata["model/0.weight"].size = "abc"


@pytest.mark.parametrize("edit", [_bad_properties, _bad_size])
def test_malformed_dcp_metadata_fields_are_a_checkpoint_error(rich, edit):
    root, directory, _ = rich
    _tamper_metadata(directory, edit)
    err = _refused_untouched(root, r"the entry of tensor 'model/0\.weight' is malformed")
    assert str(directory / ".metadata") in str(err)


_SCHEDULER_EDITS = [  # (id, edit of rank-0.json's lr_scheduler, the field named)
    ("overwrite-optimizer", ("optimizer",), "x", r"lr_scheduler\.optimizer: is not in the live"),
    ("new-attribute", ("evil",), 1, r"lr_scheduler\.evil: is not in the live"),
    ("attribute-type", ("last_epoch",), "abc", r"lr_scheduler\.last_epoch: is a string"),
    ("list-length", ("base_lrs",), [0.1, 0.2, 0.3], r"lr_scheduler\.base_lrs: is a list of 3"),
    ("lambda-new-attribute", ("lr_lambdas", 0, "evil"), 5,
     r"lr_scheduler\.lr_lambdas\[0\]\.evil: is not in the live"),
    ("lambda-attribute-type", ("lr_lambdas", 0, "steps"), "abc",
     r"lr_scheduler\.lr_lambdas\[0\]\.steps: is a string"),
]


@pytest.mark.parametrize("path, value, field", [case[1:] for case in _SCHEDULER_EDITS],
                         ids=[case[0] for case in _SCHEDULER_EDITS])
def test_the_json_cannot_set_scheduler_attributes_outside_its_state_dict(rich, path, value, field):
    """LRScheduler.load_state_dict is `__dict__.update(state)` (and LambdaLR updates its
    factors' __dict__ too): the old code let the JSON set any attribute to anything (the
    scheduler's optimizer to a string, say).  Now only the keys the live scheduler's own
    state_dict has, of the kinds it has."""
    root, directory, _ = rich
    _edit_json(directory / "rank-0.json", _set(("lr_scheduler", *path), value))
    _refused_untouched(root, rf"rank-0\.json: field {field}")


def test_edited_json_that_still_parses_is_refused_by_its_checksum(rich):
    """A hand edit or a flipped digit that leaves valid JSON (lr 0.1 -> 0.7): the old code loaded
    it silently.  Each JSON file records the sha256 of its content."""
    root, directory, _ = rich
    _edit_json(directory / "rank-0.json", _set(("optimizer", "param_groups", 0, "lr"), 0.7),
               resign=False)
    _refused_untouched(root, r"rank-0\.json does not match the sha256 it records")


def test_a_garbled_shard_is_refused_by_the_tensor_digests(rich):
    """One bit of a weight's bytes in the shard flipped: the shard still loads, with another
    value, which the old code took silently.  Every tensor read is checked against the digest
    save recorded."""
    root, directory, saved = rich
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    weight = saved["model"]["1.weight"].numpy().tobytes()
    at = data.find(weight)
    assert at > 0 and data.find(weight, at + 1) < 0
    data[at + len(weight) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    _refused_untouched(root, r"tensor 'model/1\.weight': the bits read from the shards of .* have "
                             r"digest [0-9a-f]{16}, but .*rank-0\.json records")


def test_optimizer_state_follows_parameter_names_within_a_group(tmp_path):
    """The saved group lists its parameters in another order than the live one (the model's
    constructor order changed): torch maps state by position in the group, so the old code
    gave each parameter another one's momentum.  State goes by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(3, 2)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(tmp_path, StateBundle(model=model, optimizer=optimizer, progress={"step": 2}))
    names = {id(p): n for n, p in model.named_parameters()}
    saved = {names[id(p)]: s["momentum_buffer"] for p, s in optimizer.state.items()}

    model2 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer2 = torch.optim.SGD(list(model2.parameters())[::-1], lr=0.1, momentum=0.9)
    checkpoint.load(tmp_path, StateBundle(model=model2, optimizer=optimizer2))
    names2 = {id(p): n for n, p in model2.named_parameters()}
    loaded = {names2[id(p)]: s["momentum_buffer"] for p, s in optimizer2.state.items()}
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_checkpoints_of_the_first_format_still_load(rich):
    """samebits-checkpoint/1 (before the checksums and digests) loads, with every structural
    check."""
    root, directory, saved = rich

    def first_format(meta):
        meta["format"] = "samebits-checkpoint/1"
        for field in ("sha256", "digest_version", "metadata_sha256"):
            meta.pop(field, None)

    def first_format_rank(plain):
        plain.pop("sha256", None)
        for spec in plain["tensors"].values():
            spec.pop("digest", None)

    _edit_json(directory / "meta.json", first_format, resign=False)
    _edit_json(directory / "rank-0.json", first_format_rank, resign=False)
    bundle = _rich_bundle(seed=1)
    checkpoint.load(root, bundle)
    assert _same(_snapshot(bundle)["model"], saved["model"])
    assert _same(_snapshot(bundle)["optimizer"], saved["optimizer"])


_FS_OPS = (("os", "rename"), ("os", "replace"), ("os", "link"), ("shutil", "rmtree"))


def _watch_fs_ops(monkeypatch, before_each):
    """Call `before_each()` before and after every rename/replace/link/rmtree the save does."""
    modules = {"os": os, "shutil": shutil}
    busy = []

    def wrap(original):
        def watched(*args, **kwargs):
            if busy:
                return original(*args, **kwargs)
            busy.append(1)
            try:
                before_each()
                result = original(*args, **kwargs)
                before_each()
                return result
            finally:
                busy.pop()
        return watched

    for module, name in _FS_OPS:
        monkeypatch.setattr(modules[module], name, wrap(getattr(modules[module], name)))


def test_resaving_the_latest_step_keeps_latest_naming_a_complete_checkpoint(tmp_path, monkeypatch):
    """At every instant of a re-save of the step `latest` names, loading gives the old or the
    new checkpoint, whole."""
    root = tmp_path / "ckpt"
    _, old = _saved_linear(root, seed=0)
    torch.manual_seed(1)
    model = nn.Linear(2, 2)
    new = model.weight.detach().clone()
    seen = []

    def check():
        weight = _loaded_weight(root)
        assert torch.equal(weight, old) or torch.equal(weight, new), "a mix of old and new"
        seen.append("new" if torch.equal(weight, new) else "old")

    _watch_fs_ops(monkeypatch, check)
    checkpoint.save(root, StateBundle(model=model, progress={"step": 1}))
    monkeypatch.undo()
    assert seen[0] == "old" and seen[-1] == "new" and len(seen) >= 4
    assert torch.equal(_loaded_weight(root), new)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]


class _Killed(BaseException):
    """Stands for SIGKILL at one file-system operation of a save."""


@pytest.mark.parametrize("step", [1, 2])
def test_save_killed_at_any_operation_leaves_a_loadable_latest_and_the_next_save_recovers(
        tmp_path, monkeypatch, step):
    """Kill a save (re-save of the latest step, or a new step) before each of its file-system
    operations in turn: `latest` loads the old or the new state, and the next save leaves a
    clean root."""
    base = tmp_path / "base"
    _, old = _saved_linear(base, seed=0)
    torch.manual_seed(1)
    model = nn.Linear(2, 2)
    new = model.weight.detach().clone()
    modules = {"os": os, "shutil": shutil}
    kill_at = 0
    while True:
        root = tmp_path / f"kill-{kill_at}"
        shutil.copytree(base, root)
        calls = []

        def maybe_kill(original):
            def op(*args, **kwargs):
                calls.append(1)
                if len(calls) == kill_at + 1:
                    raise _Killed
                return original(*args, **kwargs)
            return op

        for module, name in _FS_OPS:
            monkeypatch.setattr(modules[module], name, maybe_kill(getattr(modules[module], name)))
        try:
            checkpoint.save(root, StateBundle(model=model, progress={"step": step}))
        except BaseException:
            if len(calls) <= kill_at:  # a real failure, not the simulated kill (DCP wraps it)
                raise
        finally:
            monkeypatch.undo()
        finished = len(calls) <= kill_at
        weight = _loaded_weight(root)
        assert torch.equal(weight, old) or torch.equal(weight, new), kill_at
        torch.manual_seed(2)
        third = nn.Linear(2, 2)
        checkpoint.save(root, StateBundle(model=third, progress={"step": step}))
        assert torch.equal(_loaded_weight(root), third.weight.detach())
        expected = ["latest", "step-1"] + (["step-2"] if step == 2 else [])
        assert sorted(p.name for p in root.iterdir()) == expected, kill_at
        if finished:
            break
        kill_at += 1
    assert kill_at >= 3


def _run_cli(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "samebits.recipes", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=120, **kwargs)


def _tiny_cli_args():
    return ["--set", "num_layers=2", "--set", "seq_len=32", "--set", "micro_batch_size=2"]


def test_save_killed_mid_way_leaves_previous_checkpoint_loadable(tmp_path, straight):
    root = tmp_path / "ckpt"
    first = _run_cli("--steps", str(STEPS), "--save-at", "1", "--ckpt", str(root),
                     *_tiny_cli_args())
    assert first.returncode == 0, first.stderr
    # Resume, then save before step 3 with a pause after the shards: kill it there.
    log = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "samebits.recipes", "--steps", str(STEPS),
         "--resume-from", str(root), "--save-at", "3", "--ckpt", str(root), *_tiny_cli_args()],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, checkpoint.SAVE_PAUSE_ENV: "60"})
    try:
        deadline = time.monotonic() + 60
        while "pausing" not in (tmp_path / "stderr.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "stderr.txt").read_text()
            time.sleep(0.05)
        assert (root / ".tmp-step-3" / "__0_0.distcp").is_file()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    assert (root / "latest").read_text().strip() == "step-1"
    assert not (root / "step-3").exists()
    resumed = train(_tiny(), steps=STEPS, resume_from=root)
    assert resumed.start_step == 1
    _assert_same_run(resumed.metrics, straight.metrics[1:])
    assert _same_params(resumed.params, straight.params)
    # The next save of that step replaces the leftover temporary directory.
    again = train(_tiny(), steps=STEPS, resume_from=root, save_at=3, ckpt_dir=root)
    assert again.checkpoint == root / "step-3" and not (root / ".tmp-step-3").exists()
    assert (root / "latest").read_text().strip() == "step-3"


# --- two ranks (gloo) under torchrun ---------------------------------------------------------


def _torchrun(*args, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *args]  # --standalone: a free port (pytest-xdist workers run beside each other)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _step_lines(stdout: str) -> dict[int, str]:
    """step -> rank 0's log line without its timing (it holds the loss's float32 bits)."""
    return {int(line.split()[1]): line.rsplit("|", 1)[0]
            for line in stdout.splitlines() if line.startswith("step ")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank worker's per-rank results (see `_worker`)."""
    out = tmp_path_factory.mktemp("two-ranks")
    _torchrun(__file__, str(out))
    return [torch.load(out / f"rank-{r}.pt", weights_only=True) for r in range(2)]


def test_two_ranks_rng_states_restored_on_their_own_rank(two_ranks):
    for rank, result in enumerate(two_ranks):
        assert result["rank"] == rank
        assert result["rng_restored"], f"rank {rank} did not get its own random states back"
        assert _same_params(result["resumed"], result["straight"]), f"rank {rank} params"
        assert torch.equal(result["resumed_losses"], result["straight_losses"][SAVE_AT:])
    # The ranks' states really differ, so a swap would have been caught.
    assert not torch.equal(two_ranks[0]["torch_cpu"], two_ranks[1]["torch_cpu"])
    assert not torch.equal(two_ranks[0]["jitter"], two_ranks[1]["jitter"])
    # Expert shards are rank-local: different on the two ranks.
    name = "layers.1.ffn.experts.w1"
    assert not torch.equal(two_ranks[0]["straight"][name], two_ranks[1]["straight"][name])


@pytest.mark.slow
def test_two_ranks_save_exit_resume_cli_is_bitwise_equal(tmp_path, two_ranks):
    module = ["-m", "samebits.recipes", "--steps", str(STEPS), *_tiny_cli_args()]
    root = tmp_path / "ckpt"
    saved = _step_lines(_torchrun(*module, "--save-at", str(SAVE_AT), "--ckpt", str(root)))
    resumed = _step_lines(_torchrun(*module, "--resume-from", str(root)))
    assert sorted(saved) == list(range(SAVE_AT)) and sorted(resumed) == list(range(SAVE_AT, STEPS))
    # Rank 0 prints the rank-mean loss's float32 bits; the straight run is the worker's.
    straight = {step: f"[{np.float32(loss).view(np.uint32):08x}]"
                for step, loss in enumerate(two_ranks[0]["straight_mean_losses"].tolist())}
    assert {s: line.split()[5] for s, line in {**saved, **resumed}.items()} == straight
    # Saved by 2 ranks with expert parallelism: world size 1 may not load it.
    from samebits.recipes.model import Transformer

    with pytest.raises(CheckpointLayoutError, match="world_size=2"):
        checkpoint.load(root, StateBundle(model=Transformer(_tiny()), layout={"dp": 1, "ep": 1}))
    files = sorted(p.name for p in (root / f"step-{SAVE_AT}").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rank-0.json",
                     "rank-1.json"]


def _worker(out_dir: Path) -> None:
    """Per rank: RNG save/scramble/load check, then straight vs save+resume via `train`."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # replicas: the same weights on both ranks (save refuses drifted ones)
    bundle = StateBundle(model=nn.Linear(2, 2), progress={"step": 0}, layout={"dp": 2})
    random.seed(10 + rank), np.random.seed(20 + rank), torch.manual_seed(30 + rank)
    jitter = torch.Generator().manual_seed(40 + rank)
    bundle.generators = {"jitter": jitter}
    expected = checkpoint.capture_rng_state({"jitter": jitter})
    checkpoint.save(out_dir / "rng-ckpt", bundle)
    random.seed(0), np.random.seed(0), torch.manual_seed(0), jitter.manual_seed(0)
    checkpoint.load(out_dir / "rng-ckpt", bundle)
    restored = checkpoint.capture_rng_state({"jitter": jitter})
    rng_ok = (torch.equal(restored["torch_cpu"], expected["torch_cpu"])
              and torch.equal(restored["generators"]["jitter"], expected["generators"]["jitter"])
              and torch.equal(restored["numpy"]["key"], expected["numpy"]["key"])
              and torch.equal(restored["python"]["state"], expected["python"]["state"]))

    straight = train(_tiny(), steps=STEPS)
    train(_tiny(), steps=STEPS, save_at=SAVE_AT, ckpt_dir=out_dir / "ckpt")
    resumed = train(_tiny(), steps=STEPS, resume_from=out_dir / "ckpt")
    torch.save({
        "rank": rank, "rng_restored": rng_ok,
        "torch_cpu": expected["torch_cpu"], "jitter": expected["generators"]["jitter"],
        "straight": straight.params, "resumed": resumed.params,
        "straight_losses": torch.tensor([m["loss"] for m in straight.metrics]),
        "straight_mean_losses": torch.tensor([m["mean_loss"] for m in straight.metrics]),
        "resumed_losses": torch.tensor([m["loss"] for m in resumed.metrics]),
    }, out_dir / f"rank-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    # Everything is written. Skip the C++ static destructors: under load a gloo process
    # occasionally aborts there (SIGABRT, "terminate called without an active exception").
    # Inside this block: at module level, pytest's import of this file would end the session.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _drifted_replica_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    found = {}
    try:
        torch.manual_seed(0)  # the same weights on both ranks: replicas
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        bundle = lambda **kw: StateBundle(model=model, progress={"step": 1}, **kw)  # noqa: E731
        checkpoint.save(Path(out) / "equal", bundle())
        found["equal"] = "saved"
        if rank == 1:  # one replica drifts by one bit
            with torch.no_grad():
                model[1].weight.view(-1).view(torch.int32)[0] ^= 1
        try:
            checkpoint.save(Path(out) / "drifted", bundle())
            found["drifted"] = "saved"
        except CheckpointError as err:
            found["drifted"] = str(err)
        checkpoint.save(Path(out) / "declared", bundle(rank_local={"1.weight"}))  # meant to differ
        found["declared"] = "saved"
    finally:
        dist.destroy_process_group()
    Path(f"{out}/found.{rank}.json").write_text(json.dumps(found))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then under load)


def test_saving_replicas_that_differ_between_ranks_is_refused(tmp_path):
    """DCP keeps one copy of a tensor that is not rank-local (rank 0's): when the replicas
    differ, a resume would silently give every rank rank 0's value.  save refuses on every
    rank and names the tensor and the ranks; declared rank-local, it saves."""
    import torch.multiprocessing as mp

    mp.spawn(_drifted_replica_worker, args=(2, f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        found = json.loads((tmp_path / f"found.{rank}.json").read_text())
        assert found["equal"] == "saved" and found["declared"] == "saved"
        assert found["drifted"].startswith(f"rank {rank}: 1 tensor(s) that the checkpoint stores once differ "
                                           "between ranks: model/1.weight (rank 0 vs rank 1)"), found
        assert "StateBundle.rank_local" in found["drifted"]
    assert not (tmp_path / "drifted" / "step-1").exists()


def _one_rank_refuses_worker(rank: int, world: int, init: str, out: str) -> None:
    """Save with 2 ranks; damage rank 1's part (its JSON: refused before the shards are read;
    its numpy state's bytes in its own shard: refused after); load on both."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    found = {}
    try:
        def bundle():
            torch.manual_seed(0)  # replicas: the same weights on both ranks
            return StateBundle(model=nn.Linear(2, 2), progress={"step": 1}, layout={"dp": 2})

        np.random.seed(10 + rank)
        key = checkpoint.capture_rng_state()["numpy"]["key"].numpy().tobytes()
        for case in ("json", "shard"):
            root = Path(out) / case
            directory = checkpoint.save(root, bundle())
            if rank == 1 and case == "json":
                _truncate(directory / "rank-1.json")
            if rank == 1 and case == "shard":
                shard = directory / "__1_0.distcp"
                data = bytearray(shard.read_bytes())
                data[data.find(key) + 100] ^= 1
                shard.write_bytes(bytes(data))
            dist.barrier()
            fresh = bundle()
            with torch.no_grad():
                fresh.model.weight.add_(1)
            before = fresh.model.weight.detach().clone()
            start = time.monotonic()
            try:
                checkpoint.load(root, fresh)
                found[case] = "loaded"
            except CheckpointError as err:
                found[case] = str(err)
            found[f"{case}_seconds"] = time.monotonic() - start
            found[f"{case}_untouched"] = torch.equal(fresh.model.weight, before)
            dist.barrier()
    finally:
        Path(f"{out}/found.{rank}.json").write_text(json.dumps(found))
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then under load)


def test_a_rank_that_refuses_makes_every_rank_refuse_without_waiting(tmp_path):
    """All or nothing across ranks: rank 1's part of the checkpoint is damaged.  The old code
    refused on rank 1 only, while rank 0 went on into DCP's collective read (where it waited
    for rank 1) or loaded its own part.  Now the ranks agree before reading the shards and
    before applying: every rank refuses, at once, naming the rank and its reason, and every
    bundle is left as it was."""
    import torch.multiprocessing as mp

    mp.spawn(_one_rank_refuses_worker, args=(2, f"file://{tmp_path / 'init'}", str(tmp_path)),
             nprocs=2, join=True)
    found = [json.loads((tmp_path / f"found.{rank}.json").read_text()) for rank in range(2)]
    assert "rank-1.json is damaged" in found[1]["json"], found
    assert found[0]["json"].startswith("rank 1 refused the checkpoint before reading the shards "
                                       "(CheckpointError: "), found
    assert "numpy/key" in found[1]["shard"] and "digest" in found[1]["shard"], found
    assert found[0]["shard"].startswith("rank 1 refused the checkpoint after reading the shards"), found
    for rank in range(2):
        for case in ("json", "shard"):
            assert found[rank][f"{case}_untouched"] and found[rank][f"{case}_seconds"] < 30, found


# --- loading under another layout (issue 28) ------------------------------------------------


class _Rows(nn.Module):
    """Rows of a 4x3 weight (all of them, or one rank's half: a tensor-parallel shard) and a
    replicated bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.w, self.b = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())


def _rows_bundle(rank: int, world: int, *, trained: bool, **kwargs) -> StateBundle:
    """One AdamW step on the global weight's rows this rank holds (AdamW is elementwise: each
    element's bits do not depend on the split), saved with its place at world 2."""
    g = torch.Generator().manual_seed(0)
    weight, bias, grad = (torch.randn(4, 3, generator=g), torch.randn(3, generator=g),
                          torch.randn(4, 3, generator=g))
    rows = slice(0, 4) if world == 1 else slice(2 * rank, 2 * rank + 2)
    model = _Rows(weight[rows], bias) if trained else _Rows(torch.zeros(4 // world, 3), torch.zeros(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if trained:
        model.w.grad, model.b.grad = grad[rows].clone(), torch.ones(3)
        optimizer.step()
    shards = {} if world == 1 else {"w": checkpoint.TensorShard((4, 3), (2 * rank, 0))}
    return StateBundle(model=model, optimizer=optimizer, layout={"tp": world},
                       progress={"step": 1, "consumed_samples": 8},
                       generators={"jitter": torch.Generator().manual_seed(5)},
                       **{"shards": shards, **kwargs})


def _columns_bundle(rank: int) -> StateBundle:
    """`_rows_bundle(trained=True)` split by columns at world 2, unevenly (rank 0 the first two
    of three columns, rank 1 the last): the content hash must join pieces by their places."""
    g = torch.Generator().manual_seed(0)
    weight, bias, grad = (torch.randn(4, 3, generator=g), torch.randn(3, generator=g),
                          torch.randn(4, 3, generator=g))
    cols = slice(0, 2) if rank == 0 else slice(2, 3)
    model = _Rows(weight[:, cols], bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.w.grad, model.b.grad = grad[:, cols].clone(), torch.ones(3)
    optimizer.step()
    return StateBundle(model=model, optimizer=optimizer, layout={"tp": 2}, progress={"step": 1, "consumed_samples": 8},
                       shards={"w": checkpoint.TensorShard((4, 3), (0, 2 * rank))})


def _rows_state(bundle: StateBundle) -> dict[str, torch.Tensor]:
    state = bundle.optimizer.state_dict()["state"]
    return {"w": bundle.model.w.detach(), "b": bundle.model.b.detach(),
            **{f"{p}.{k}": v for i, p in enumerate("wb") for k, v in state[i].items()}}


def _layout_worker(rank: int, world: int, init: str, out: str) -> None:
    """Save the sharded bundle at world 2 (and variants that cannot move); load the world-1
    checkpoint the test saved into each rank's shard."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    found = {}
    try:
        torch.manual_seed(1), np.random.seed(1), random.seed(1)  # the same on both ranks
        checkpoint.save(Path(out) / "two", _rows_bundle(rank, world, trained=True))
        torch.manual_seed(10 + rank)  # a per-rank stream (a DP replica's dropout)
        checkpoint.save(Path(out) / "per-rank-rng", _rows_bundle(rank, world, trained=True))
        torch.manual_seed(1)
        bundle = _rows_bundle(rank, world, trained=True)
        bundle.progress["consumed_samples"] = 8 + rank  # a per-rank data position
        checkpoint.save(Path(out) / "per-rank-progress", bundle)
        checkpoint.save(Path(out) / "no-place", _rows_bundle(rank, world, trained=True, shards={},
                                                             rank_local={"w"}))
        checkpoint.save(Path(out) / "columns", _columns_bundle(rank))
        fresh = _rows_bundle(rank, world, trained=False)
        checkpoint.load(Path(out) / "one", fresh, allow_layout_change=True)
        reference = _rows_bundle(rank, world, trained=True)
        found["from_one"] = {k: torch.equal(v, _rows_state(reference)[k]) for k, v in _rows_state(fresh).items()}
        found["layout_change"] = fresh.layout_change
        found["jitter"] = torch.equal(fresh.generators["jitter"].get_state(),
                                      torch.Generator().manual_seed(5).get_state())
    finally:
        Path(f"{out}/found.{rank}.json").write_text(json.dumps(found))
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then under load)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    """A world-1 checkpoint of the whole weight, and world-2 ones of its row shards."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("layouts")
    checkpoint.save(out / "one", _rows_bundle(0, 1, trained=True))
    mp.spawn(_layout_worker, args=(2, f"file://{out / 'init'}", str(out)), nprocs=2, join=True)
    return out


def test_shards_saved_at_two_ranks_load_whole_into_one_with_the_opt_in(layouts):
    """Each rank saved its rows with their place; one process loads the whole weight (and
    its AdamW moments) joined from both, bit for bit equal to training it whole; the
    replicated bias, the step counts, the progress and the random states come back too."""
    reference = _rows_state(_rows_bundle(0, 1, trained=True))
    fresh = _rows_bundle(0, 1, trained=False)
    with pytest.raises(CheckpointLayoutError, match=r"world_size=2 and layout \{'tp': 2\}.*"
                                                    r"allow_layout_change=True"):
        checkpoint.load(layouts / "two", fresh)
    assert not fresh.model.w.detach().any()  # refused: nothing changed
    manifest = json.loads((layouts / "two" / "step-1" / "rank-1.json").read_text())["tensors"]
    assert manifest["model/w@rank1"]["global_shape"] == [4, 3] and manifest["model/w@rank1"]["offsets"] == [2, 0]
    torch.manual_seed(99)
    checkpoint.load(layouts / "two", fresh, allow_layout_change=True)
    loaded = _rows_state(fresh)
    assert loaded.keys() == reference.keys() and len(loaded) == 8
    for name, value in reference.items():
        assert torch.equal(loaded[name], value), name
    assert fresh.progress == {"step": 1, "consumed_samples": 8}
    assert torch.equal(torch.get_rng_state(), (torch.manual_seed(1), torch.get_rng_state())[1])
    assert fresh.layout_change == {"step": 1, "from": {"world_size": 2, "layout": {"tp": 2}},
                                   "to": {"world_size": 1, "layout": {"tp": 1}}}
    assert checkpoint.saved_layout(layouts / "two") == {
        "directory": str(layouts / "two" / "step-1"), "step": 1, "world_size": 2, "layout": {"tp": 2}}


def test_a_whole_tensor_saved_at_one_rank_is_cut_into_each_ranks_shard(layouts):
    for rank in range(2):
        found = json.loads((layouts / f"found.{rank}.json").read_text())
        assert found["from_one"] == {k: True for k in ("w", "b", "w.step", "w.exp_avg", "w.exp_avg_sq",
                                                       "b.step", "b.exp_avg", "b.exp_avg_sq")}, found
        assert found["layout_change"]["from"] == {"world_size": 1, "layout": {"tp": 1}}, found
        assert found["layout_change"]["to"] == {"world_size": 2, "layout": {"tp": 2}} and found["jitter"]


def test_the_content_hash_is_the_same_for_one_state_saved_at_any_layout(layouts, tmp_path):
    """`content_sha256`: the whole weight saved on one rank, its row shards (and the replicated
    bias) saved on two, and the two ranks with their own random streams hash alike: each
    tensor's global value, not the files (which differ); one bit of the weight or of an Adam
    moment, or the progress, changes it."""
    one, two = checkpoint.content_sha256(layouts / "one"), checkpoint.content_sha256(layouts / "two")
    assert one["sha256"] == two["sha256"] and (one["world_size"], two["world_size"]) == (1, 2)
    # w, b and their two moments each; two step counts
    assert (one["step"], one["tensors"], one["elements"]) == (1, 8, 3 * (12 + 3) + 2)
    assert checkpoint.content_sha256(layouts / "per-rank-rng")["sha256"] == one["sha256"]  # random states: out
    assert checkpoint.content_sha256(layouts / "columns")["sha256"] == one["sha256"]  # pieces joined by place
    files = [sorted(p.name for p in (layouts / name / "step-1").iterdir()) for name in ("one", "two")]
    assert files[0] != files[1]  # the files differ by layout

    def saved_with(edit, name):
        bundle = _rows_bundle(0, 1, trained=True)
        edit(bundle)
        checkpoint.save(tmp_path / name, bundle)
        return checkpoint.content_sha256(tmp_path / name)["sha256"]

    assert saved_with(lambda b: None, "same") == one["sha256"]

    def flip(tensor):
        with torch.no_grad():
            bits = tensor.view(torch.int32)
            bits.view(-1)[5] ^= 1  # the lowest mantissa bit of one element

    assert saved_with(lambda b: flip(b.model.w), "weight") != one["sha256"]
    assert saved_with(lambda b: flip(b.optimizer.state[b.model.w]["exp_avg_sq"]), "moment") != one["sha256"]
    assert saved_with(lambda b: b.progress.update(consumed_samples=9), "progress") != one["sha256"]
    with pytest.raises(CheckpointLayoutError, match=r"field progress.consumed_samples is 8 on saved rank 0 but 9"):
        checkpoint.content_sha256(layouts / "per-rank-progress")
    with pytest.raises(CheckpointLayoutError, match=r"model/w is rank-local .* and differs between them"):
        checkpoint.content_sha256(layouts / "no-place")


def test_what_cannot_move_to_another_layout_is_refused_by_name(layouts):
    """Per-rank random streams, per-rank plain values and rank-local tensors without a place:
    refused with the opt-in, naming them, the bundle untouched; a program that reseeds every
    draw keeps its live random states instead."""
    cases = {"per-rank-rng": r"random state\(s\) torch_cpu \(rank 0 vs 1\) differ between the saved ranks.*"
                             r"reseeded_rng=True",
             "per-rank-progress": r"field progress.consumed_samples is 8 on saved rank 0 but 9 on saved rank 1",
             "no-place": r"model/w is rank-local .* differs between them, .* no place in a global tensor for it "
                         r"\(StateBundle.shards\)"}
    for name, message in cases.items():
        fresh = _rows_bundle(0, 1, trained=False)
        with pytest.raises(CheckpointLayoutError, match=message):
            checkpoint.load(layouts / name, fresh, allow_layout_change=True)
        assert not fresh.model.w.detach().any() and fresh.progress["consumed_samples"] == 8, name
    fresh = _rows_bundle(0, 1, trained=False)
    torch.manual_seed(99)
    live = torch.get_rng_state()
    checkpoint.load(layouts / "per-rank-rng", fresh, allow_layout_change=True, reseeded_rng=True)
    assert torch.equal(torch.get_rng_state(), live) and torch.equal(fresh.model.w, _rows_bundle(0, 1, trained=True).model.w)


def test_a_shard_place_that_does_not_hold_the_tensor_is_a_config_error(tmp_path):
    bundle = _rows_bundle(0, 1, trained=True, shards={"w": checkpoint.TensorShard((4, 3), (2, 0))})
    with pytest.raises(samebits.errors.ConfigError, match=r"StateBundle.shards\['w'\] places a tensor of shape "
                                                          r"\[4, 3\] at offsets \[2, 0\]"):
        checkpoint.save(tmp_path, bundle)


def test_the_recipe_saves_at_several_steps_with_keep_going(tmp_path, capsys):
    """--save-at 1,2 --keep-going: a checkpoint before step 1 and one after the last step
    (what verify --across hashes), each a distinct state; several steps without --keep-going,
    or a list that is not steps, are refused."""
    from samebits.recipes.cli import main as recipe_main

    root = tmp_path / "ckpt"
    assert recipe_main(["--steps", "2", *_tiny_cli_args(), "--save-at", "2,1", "--ckpt", str(root),
                        "--keep-going"]) == 0
    said = capsys.readouterr().out
    assert "(before step 1); going on" in said and "(before step 2); going on" in said
    first, last = checkpoint.content_sha256(root / "step-1"), checkpoint.content_sha256(root / "step-2")
    assert (first["step"], last["step"]) == (1, 2) and first["sha256"] != last["sha256"]
    assert checkpoint.saved_layout(root)["step"] == 2  # latest: the last one saved
    assert recipe_main(["--steps", "2", *_tiny_cli_args(), "--save-at", "1,2", "--ckpt", str(root)]) == 2
    assert "--save-at 1,2: saving at several steps needs --keep-going" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe_main(["--steps", "2", "--save-at", "1,x", "--ckpt", str(root)])
    assert "'1,x' is not a step or a comma-separated list of steps" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="saving at several steps needs keep_going"):
        train(_tiny(), steps=2, save_at=(1, 2), ckpt_dir=root)
