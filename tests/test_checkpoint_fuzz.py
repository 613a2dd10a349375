"""Checkpoint fuzz (slow): a damaged or crafted checkpoint loads exactly or not at all.

Each example copies one saved checkpoint (a model, AdamW with state, a LambdaLR with a stateful
factor, a torch and a NumPy generator, progress and metadata), damages it one way, and loads it
into a freshly built bundle.  The load must end, within 10 s, in one of:

- exact: every value of the bundle (and the global random states) bitwise as saved;
- refused: a `CheckpointError`, with the bundle and the global random states untouched;
- allowed: only for a JSON edit whose checksum was re-recorded (what a crafted file does, which
  no checksum can tell from a save): the bundle took the edited values of that section only,
  and the section kept its schema (the same keys, kinds and lengths of the optimizer's groups,
  the scheduler's state and attributes, the random states; progress and metadata are free).

Anything else fails: a traceback of another type, a hang, a partial load (refused after
changing part of the bundle), a value that differs where it may not (uninitialised memory,
another tensor's values, an attribute the JSON set), or a load through a symlink out of the
checkpoint ("followed-link"), even of the same bytes.

The damage: JSON fields of meta.json and rank-0.json replaced, perturbed, deleted or added (with
or without the checksum re-recorded); DCP metadata chunks, sizes, dtypes, storage offsets,
lengths and paths edited or the pickle garbled; the shard truncated, overwritten, shifted or
extended; any file (or the step directory, or `latest`) replaced by a symlink out of the
checkpoint, a FIFO, a directory, an empty file, or removed; `latest` rewritten.

As a script it measures instead of asserting (the numbers in the report of issue 25 item 5):

    python tests/test_checkpoint_fuzz.py --examples 200 --seed 0
    PYTHONPATH=/tmp/oldc/src python tests/test_checkpoint_fuzz.py --timeout 3 ...  # old code

It prints, per family, how many damaged checkpoints were tried and how each load ended, plus
the crafted cases of tests/test_checkpoint.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samebits import checkpoint
from samebits.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from test_checkpoint import (  # noqa: E402  (the shared bundle and snapshot helpers)
    _MALFORMED, _SCHEDULER_EDITS, _chunk_outside, _edit_json, _overlap_chunks, _resign_metadata,
    _rich_bundle, _same, _set, _shrink_chunk, _snapshot, _tamper_metadata)

pytestmark = pytest.mark.slow

STEP = 2  # the saved checkpoint is ROOT/step-2
FILES = ("meta.json", "rank-0.json", ".metadata", "__0_0.distcp")
TIMEOUT_S = 10


# --- where the choices come from --------------------------------------------------------------


class Source:
    """A mutation's choices: Hypothesis's `data.draw` in the tests (it shrinks a failure to a
    small example), a seeded `random.Random` in the census."""

    def __init__(self, data=None, rng: random.Random | None = None):
        self.data, self.rng = data, rng

    def integer(self, low: int, high: int) -> int:
        if self.data is not None:
            return self.data.draw(st.integers(low, high))
        return self.rng.randint(low, high)

    def choice(self, options):
        options = list(options)
        return options[self.integer(0, len(options) - 1)]

    def boolean(self) -> bool:
        return self.integer(0, 1) == 1

    def blob(self, low: int, high: int) -> bytes:
        return bytes(self.integer(0, 255) for _ in range(self.integer(low, high)))


@dataclass
class Mutation:
    family: str
    what: str
    section: str | None = None  # a rank-0.json section whose values may change (re-signed edit)
    links_out: bool = False  # a file was replaced by a symlink out of the checkpoint


# --- the damage --------------------------------------------------------------------------------


def _nest(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


_INTERESTING = [None, True, False, 0, 1, -1, 7, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64 + 1, -2 ** 63,
                10 ** 40, 0.5, -0.0, 1e308, float("inf"), float("-inf"), float("nan"), "", "abc",
                "step-2", "0", [], [0], [[]], [1, 2, 3], {}, {"a": 1},
                {"__tensor__": "model/0.weight"}, {"__tensor__": "rng@rank0/torch_cpu"},
                {"__tensor__": "nope"}, {"__tuple__": [1, 2]}, {"__tuple__": 5},
                {"__ndarray__": [1, 2], "dtype": "uint32"}, {"__ndarray__": ["x"], "dtype": "object"},
                _nest(150)]


def _perturb(src: Source, value):
    """A value of the same kind, a little off (what a flipped digit or a hand edit gives)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return src.choice([value + 1, value - 1, -value, value + 2 ** 32, value * 1000, 0])
    if isinstance(value, float):
        return src.choice([value * 2, value + 1e-9, -value, value / 3, float("nan"), 0.0])
    if isinstance(value, str):
        return src.choice([value + "x", value[:-1], "", value.upper(), value + "/../x"])
    if isinstance(value, list):
        if not value:
            return [0]
        i = src.integer(0, len(value) - 1)
        return src.choice([value[:i] + value[i + 1:], value + [copy.deepcopy(value[i])],
                           value[::-1], []])
    if isinstance(value, dict):
        if not value:
            return {"evil": 1}
        key = src.choice(sorted(value))
        return src.choice([{k: v for k, v in value.items() if k != key},
                           {**value, key + "_evil": copy.deepcopy(value[key])}, {}])
    return 0


def _paths(tree, prefix=()):
    """Every path into a JSON tree (not the root)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield (*prefix, index)
            yield from _paths(value, (*prefix, index))


def mutate_json(src: Source, directory: Path, root: Path, outside: Path) -> Mutation:
    name = src.choice(["meta.json", "rank-0.json"])
    tree = json.loads((directory / name).read_text())
    path = src.choice(sorted(_paths(tree), key=repr))
    signed = src.boolean()
    op = src.choice(["replace", "perturb", "delete", "add"])
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "replace":
        parent[last] = copy.deepcopy(src.choice(_INTERESTING))
    elif op == "perturb":
        parent[last] = _perturb(src, parent[last])
    elif op == "delete":
        del parent[last]
    else:
        target = parent[last] if isinstance(parent[last], dict) else parent
        if isinstance(target, dict):
            key = src.choice(["evil", "__tensor__", "__tuple__", "optimizer", "step", "sha256"])
            target[key] = copy.deepcopy(src.choice(_INTERESTING))
        else:
            target.append(copy.deepcopy(src.choice(_INTERESTING)))
    edited = tree

    def write(value):
        value.clear()
        value.update(edited)

    _edit_json(directory / name, write, resign=signed)
    section = (path[0] if name == "rank-0.json" else "meta") if signed else None
    return Mutation("json", f"{name} {op} {list(path)} ({'re-signed' if signed else 'unsigned'})",
                    section)


def mutate_metadata(src: Source, directory: Path, root: Path, outside: Path) -> Mutation:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       MetadataIndex)

    signed = src.boolean()
    op = src.choice(["chunk-sizes", "chunk-offsets", "drop-chunks", "dup-chunk", "split-chunk",
                     "size", "dtype", "properties", "storage-offset", "storage-length",
                     "storage-path", "storage-drop", "storage-swap", "entry-drop", "bytes-entry",
                     "garble"])
    if op == "garble":
        path = directory / ".metadata"
        data = bytearray(path.read_bytes())
        at = src.integer(0, len(data) - 1)
        data[at:at + 4] = src.blob(1, 4)
        path.write_bytes(bytes(data))
        if signed:
            _resign_metadata(directory)
        return Mutation("metadata", f".metadata garbled at byte {at}"
                                    f" ({'re-signed' if signed else 'unsigned'})")
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    key = src.choice(sorted(metadata.state_dict_metadata))
    entry = metadata.state_dict_metadata[key]
    chunk = entry.chunks[0]
    ndim = len(entry.size)
    dim = src.integer(0, ndim - 1) if ndim else None
    indices = sorted((i for i in metadata.storage_data if i.fqn == key), key=repr)
    index = indices[0]
    info = metadata.storage_data[index]

    def bump(size: torch.Size, by: int) -> torch.Size:
        values = list(size)
        if dim is not None:
            values[dim] = max(0, values[dim] + by)
        return torch.Size(values)

    if op == "chunk-sizes":
        chunk.sizes = bump(chunk.sizes, src.choice([-1, 1, -10 ** 6, 10 ** 6]))
    elif op == "chunk-offsets":
        chunk.offsets = bump(chunk.offsets, src.choice([1, 2, 10 ** 6]))
    elif op == "drop-chunks":
        entry.chunks = []
    elif op == "dup-chunk":
        entry.chunks.append(copy.deepcopy(chunk))
    elif op == "split-chunk" and dim is not None and entry.size[dim] > 1:
        cut = src.integer(1, entry.size[dim] - 1)
        first = list(chunk.sizes)
        first[dim] = cut
        second_offsets, second_sizes = list(chunk.offsets), list(chunk.sizes)
        second_offsets[dim], second_sizes[dim] = cut, entry.size[dim] - cut
        entry.chunks = [ChunkStorageMetadata(chunk.offsets, torch.Size(first)),
                        ChunkStorageMetadata(torch.Size(second_offsets), torch.Size(second_sizes))]
        metadata.storage_data[MetadataIndex(key, second_offsets)] = info  # the whole tensor's blob
    elif op == "size":
        entry.size = bump(entry.size, src.choice([-1, 1, 10 ** 9]))
    elif op == "dtype":
        entry.properties.dtype = src.choice([torch.float64, torch.int64, torch.uint8, torch.bfloat16])
    elif op == "properties":
        entry.properties = src.choice([5, None, "x"])
    elif op == "storage-offset":
        metadata.storage_data[index] = _StorageInfo(
            info.relative_path, max(0, info.offset + src.choice([-8, -1, 1, 8, 10 ** 9])), info.length)
    elif op == "storage-length":
        metadata.storage_data[index] = _StorageInfo(
            info.relative_path, info.offset, max(0, info.length + src.choice([-1, 1, -100, 10 ** 9])))
    elif op == "storage-path":
        metadata.storage_data[index] = _StorageInfo(
            src.choice(["__0_1.distcp", "__1_0.distcp", "../__0_0.distcp", "meta.json",
                        "/etc/passwd"]), info.offset, info.length)
    elif op == "storage-drop":
        del metadata.storage_data[index]
    elif op == "storage-swap":
        other = src.choice(sorted(metadata.storage_data, key=repr))
        metadata.storage_data[index], metadata.storage_data[other] = \
            metadata.storage_data[other], info
    elif op == "entry-drop":
        del metadata.state_dict_metadata[key]
    elif op == "bytes-entry":
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    if signed:
        _resign_metadata(directory)
    return Mutation("metadata", f"{op} of {key} ({'re-signed' if signed else 'unsigned'})")


def mutate_shard(src: Source, directory: Path, root: Path, outside: Path) -> Mutation:
    path = directory / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    at = src.integer(0, len(data) - 1)
    op = src.choice(["truncate", "overwrite", "flip", "insert", "append", "zero"])
    if op == "truncate":
        del data[at:]
    elif op == "overwrite":
        data[at:at + 8] = src.blob(1, 8)
    elif op == "flip":
        data[at] ^= 1 << src.integer(0, 7)
    elif op == "insert":
        data[at:at] = src.blob(1, 8)
    elif op == "append":
        data += src.blob(1, 64)
    else:
        length = src.integer(1, 512)
        data[at:at + length] = bytes(len(data[at:at + length]))
    path.write_bytes(bytes(data))
    return Mutation("shard", f"{op} at byte {at} of {len(data)}")


def mutate_file(src: Source, directory: Path, root: Path, outside: Path) -> Mutation:
    target = src.choice([*FILES, "latest", "step-dir"])
    path = root / "latest" if target == "latest" else directory if target == "step-dir" \
        else directory / target
    ops = ["symlink-out", "fifo", "directory", "remove", "empty"]
    if target == "latest":
        ops.append("rewrite")
    op = src.choice(ops)
    if op == "symlink-out":
        copy_at = outside / f"copy-of-{path.name}"
        (shutil.copytree if path.is_dir() else shutil.copy)(path, copy_at)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.symlink_to(copy_at)
    elif op == "rewrite":
        text = src.choice(["step-2", "step-2\n", " step-2 ", "step-1", "../ckpt/step-2",
                           str(directory), "", "\0", "step-2\n" + " " * 70_000, "é", "step-2/."])
        path.write_text(text)
    else:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        if op == "fifo":
            os.mkfifo(path)
        elif op == "directory":
            path.mkdir()
        elif op == "empty":
            path.write_bytes(b"")
    return Mutation("file", f"{target}: {op}", links_out=op == "symlink-out")


FAMILIES = {"json": mutate_json, "metadata": mutate_metadata, "shard": mutate_shard,
            "file": mutate_file}


# --- the oracle ------------------------------------------------------------------------------


class _Hung(BaseException):
    """Raised into a blocked load; a BaseException, so the code under test cannot swallow it."""


def _structure(value, nullable: bool = False):
    """Keys, kinds, lengths, dtypes and shapes: what a re-signed edit may not change.
    `nullable`: null counts as a number (Python's cached gaussian is either)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape)
    if isinstance(value, dict):
        return {k: _structure(v, nullable) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_structure(v, nullable) for v in value])
    if value is None and nullable:
        return "number"
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _same_tensors(saved, loaded) -> bool:
    """Every tensor of `saved` is in `loaded` at the same place, bitwise (other values free)."""
    if isinstance(saved, torch.Tensor):
        return _same(saved, loaded)
    if isinstance(saved, dict):
        return isinstance(loaded, dict) and all(
            k in loaded and _same_tensors(v, loaded[k]) for k, v in saved.items()
            if _has_tensor(v))
    if isinstance(saved, (list, tuple)):
        return isinstance(loaded, (list, tuple)) and len(saved) == len(loaded) and all(
            _same_tensors(a, b) for a, b in zip(saved, loaded))
    return True


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _wrongly_changed(saved: dict, loaded: dict, section: str | None) -> list[str]:
    """The snapshot components that differ from the saved ones beyond what a re-signed edit
    of `section` may change."""
    wrong = []
    for component, value in saved.items():
        new = loaded[component]
        if _same(value, new):
            continue
        if section == "progress" and component == "progress":
            step = new.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                continue
        if section == "metadata" and component == "metadata":
            continue
        if section == "optimizer" and component == "optimizer" and _same_tensors(value, new) \
                and _structure(value["param_groups"]) == _structure(new["param_groups"]):
            continue  # per-parameter state is free-form plain data next to its tensors
        if section == "lr_scheduler" and component == "scheduler" \
                and _structure(value) == _structure(new):
            continue
        if section == "rng" and component in ("rng", "generators") \
                and _structure(value, nullable=True) == _structure(new, nullable=True):
            continue
        wrong.append(component)
    return wrong


def load_outcome(root: Path, mutation: Mutation, saved: dict) -> tuple[str, str]:
    """(outcome, detail): exact, refused, allowed; or partial, traceback:<type>, hang, wrong."""
    bundle = _rich_bundle(seed=1)
    before = _snapshot(bundle)
    fired = []

    def alarm(signum, frame):
        fired.append(1)
        raise _Hung

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(TIMEOUT_S)  # a load of this checkpoint takes ~20 ms
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint.load(root, bundle)
    except _Hung:
        pass
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001  (classified below; DCP's CheckpointException
        error = err               # is a BaseException)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if fired:
        return "hang", f"interrupted after {TIMEOUT_S} s"
    after = _snapshot(bundle)
    if error is not None:
        if not isinstance(error, CheckpointError):
            tb = traceback.extract_tb(error.__traceback__)[-1]
            return (f"traceback:{type(error).__name__}",
                    f"{type(error).__name__}: {str(error)[:200]} at {tb.filename}:{tb.lineno}")
        if not _same(after, before):
            changed = [c for c in before if not _same(before[c], after[c])]
            return "partial", f"refused ({str(error)[:200]}) after changing {changed}"
        return "refused", str(error)[:300]
    if mutation.links_out:
        return "followed-link", "loaded through a symlink out of the checkpoint"
    wrong = _wrongly_changed(saved, after, mutation.section)
    if wrong:
        return "wrong", f"loaded with {wrong} not as saved"
    return ("exact", "") if _same(after, saved) else ("allowed", f"edited {mutation.section}")


GOOD = ("exact", "refused", "allowed")


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One saved checkpoint and its snapshot; each example damages a copy."""
    root = tmp_path_factory.mktemp("fuzz-base") / "ckpt"
    bundle = _rich_bundle(seed=0, steps=STEP)
    checkpoint.save(root, bundle)
    return root, _snapshot(bundle)


@contextlib.contextmanager
def damaged_copy(base_root: Path):
    """(root, step directory, a folder outside the checkpoint), removed afterwards."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "ckpt"
        shutil.copytree(base_root, root)
        outside = Path(scratch) / "outside"
        outside.mkdir()
        yield root, root / f"step-{STEP}", outside


def _check_family(family: str, base, data) -> None:
    base_root, saved = base
    with damaged_copy(base_root) as (root, directory, outside):
        mutation = FAMILIES[family](Source(data=data), directory, root, outside)
        outcome, detail = load_outcome(root, mutation, saved)
    assert outcome in GOOD, f"{mutation.family}: {mutation.what} -> {outcome}: {detail}"


_FUZZ = settings(max_examples=300, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(data=st.data())
def test_damaged_json_fields_load_exactly_or_are_refused(base, data):
    _check_family("json", base, data)


@_FUZZ
@given(data=st.data())
def test_damaged_dcp_metadata_loads_exactly_or_is_refused(base, data):
    _check_family("metadata", base, data)


@_FUZZ
@given(data=st.data())
def test_damaged_shards_load_exactly_or_are_refused(base, data):
    _check_family("shard", base, data)


@_FUZZ
@given(data=st.data())
def test_symlinks_fifos_and_missing_files_are_refused_without_hanging(base, data):
    _check_family("file", base, data)


# --- the census (script mode): the numbers, for this code or the old one -------------------


def _crafted() -> list[tuple[str, callable, str | None]]:
    """The crafted cases of tests/test_checkpoint.py, as (name, damage(root, directory), section)."""
    cases = []
    for name, edit, _ in _MALFORMED:
        cases.append((f"rank-0.json {name}", lambda r, d, e=edit: _edit_json(d / "rank-0.json", e),
                      None))
    for name, path, value, _ in _SCHEDULER_EDITS:
        cases.append((f"scheduler {name}", lambda r, d, p=path, v=value: _edit_json(
            d / "rank-0.json", _set(("lr_scheduler", *p), v)), None))
    for edit in (_shrink_chunk, _overlap_chunks, _chunk_outside):
        cases.append((f".metadata {edit.__name__}", lambda r, d, e=edit: _tamper_metadata(d, e), None))
    for name in (*FILES, "latest"):
        def symlink(r, d, name=name):
            path = r / name if name == "latest" else d / name
            copy_at = r.parent / "outside" / name
            shutil.copy(path, copy_at)
            path.unlink()
            path.symlink_to(copy_at)

        def fifo(r, d, name=name):
            path = r / name if name == "latest" else d / name
            path.unlink()
            os.mkfifo(path)
        cases += [(f"{name} symlinked out", symlink, "links-out"), (f"{name} a FIFO", fifo, None)]

    def big_latest(r, d):
        with open(r / "latest", "w") as file:
            file.write(f"step-{STEP}\n")
            file.truncate(16 << 20)

    def garble(r, d):
        shard = d / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        weight = _rich_bundle(seed=0, steps=STEP).model.state_dict()["1.weight"].numpy().tobytes()
        at = data.find(weight)
        data[at + len(weight) // 2] ^= 0x10
        shard.write_bytes(bytes(data))

    def unsigned_lr(r, d):
        _edit_json(d / "rank-0.json", _set(("optimizer", "param_groups", 0, "lr"), 0.7),
                   resign=False)

    cases += [("latest 16 MiB", big_latest, None), ("shard one bit flipped in a weight", garble, None),
              ("rank-0.json lr edited, checksum not re-recorded", unsigned_lr, None)]
    return cases


def census(examples: int, seed: int) -> dict:
    base_dir = Path(tempfile.mkdtemp())
    base_root = base_dir / "ckpt"
    bundle = _rich_bundle(seed=0, steps=STEP)
    checkpoint.save(base_root, bundle)
    saved = _snapshot(bundle)
    rows, bad = {}, []

    def run(family, damage):
        with damaged_copy(base_root) as (root, directory, outside):
            mutation = damage(root, directory, outside)
            outcome, detail = load_outcome(root, mutation, saved)
        rows.setdefault(family, collections.Counter())[outcome.split(":")[0]] += 1
        if outcome not in GOOD:
            bad.append((family, mutation.what, outcome, detail))

    for name, damage, section in _crafted():
        def crafted(root, directory, outside, damage=damage, name=name, section=section):
            damage(root, directory)
            if section == "links-out":
                return Mutation("crafted", name, links_out=True)
            return Mutation("crafted", name, section)
        run("crafted", crafted)
    rng = random.Random(seed)
    for family, mutate in FAMILIES.items():
        for _ in range(examples):
            run(family, lambda root, directory, outside, m=mutate: m(Source(rng=rng), directory, root,
                                                                     outside))
    shutil.rmtree(base_dir)
    return {"rows": rows, "bad": bad}


def main(argv: list[str] | None = None) -> int:
    global TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="random damages per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=40, help="bad outcomes to list")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S,
                        help="seconds after which a load counts as hung")
    args = parser.parse_args(argv)
    TIMEOUT_S = args.timeout
    result = census(args.examples, args.seed)
    outcomes = ["exact", "refused", "allowed", "partial", "traceback", "hang", "wrong",
                "followed-link"]
    print(f"samebits.checkpoint from {Path(checkpoint.__file__).parent}")
    print(f"{'family':10} {'tried':>6} " + " ".join(f"{o:>9}" for o in outcomes))
    total = collections.Counter()
    for family, counts in result["rows"].items():
        total.update(counts)
        print(f"{family:10} {sum(counts.values()):6} " + " ".join(f"{counts[o]:9}" for o in outcomes))
    print(f"{'all':10} {sum(total.values()):6} " + " ".join(f"{total[o]:9}" for o in outcomes))
    kinds = collections.Counter(outcome for _, _, outcome, _ in result["bad"])
    print("bad outcomes by kind:", dict(kinds))
    for family, what, outcome, detail in result["bad"][:args.show]:
        print(f"  [{family}] {what} -> {outcome}: {detail}")
    return 1 if result["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
