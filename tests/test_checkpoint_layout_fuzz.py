"""Layout-changing checkpoint fuzz (slow, issue 34): crafted tp2 checkpoints loaded on one rank.

Three tp2 saves of the same step are made once ("a"; "b": another run whose rank 1 rows differ
by one bit, everything else the same; "c": one whose rank 0 rows differ by one bit).  Each
example copies "a" or "c", damages it one way,
loads it into a fresh one-rank bundle with `allow_layout_change=True` (the ranks' pieces
joined by their places) and hashes it with `content_sha256`:

- mixed: rank r's `rank-<r>.json`, its `__<r>_0.distcp` or both copied from "b";
- place: a tensor's place in rank r's file removed, shifted, resized, set to the other rank's
  place, or added where none was saved;
- field: a field of `meta.json` or a rank's file removed or renamed;
- truncated: any file of the checkpoint cut short;

each with the checksum re-recorded ("crafted", where it applies: what a crafted file does) or
not.  Required, for every example:

- 0 tracebacks: the load and the hash end in a result or a `CheckpointError` with a message;
  a refused load leaves the bundle untouched;
- 0 silent mixed loads: a checkpoint mixed from two saves, or damaged without its checksum
  re-recorded, is refused by the load and by the hash;
- 0 hash collisions: a checkpoint made from "a" never hashes like one made from "c" (their
  pieces differ), and one that loads and whose `sha256` (or `state_sha256`) equals another's
  loaded the same tensors and progress (or the same whole state).

As a script it measures instead of asserting (the numbers in benchmarks/RESULTS.md):

    python tests/test_checkpoint_layout_fuzz.py --examples 300 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samebits import checkpoint
from samebits.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_trust import _flip_first_bit, _resign, _seed_all, rows_bundle  # noqa: E402

FILES = ("meta.json", "rank-0.json", "rank-1.json", ".metadata", "__0_0.distcp", "__1_0.distcp")


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        _seed_all()
        checkpoint.save(Path(out) / "a", rows_bundle(rank, world))
        _seed_all()
        checkpoint.save(Path(out) / "b", rows_bundle(rank, world, edit=_flip_first_bit if rank == 1 else None))
        _seed_all()
        checkpoint.save(Path(out) / "c", rows_bundle(rank, world, edit=_flip_first_bit if rank == 0 else None))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then under load)


def make_saves(out: Path) -> Path:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, f"file://{out / 'init'}", str(out)), nprocs=2, join=True)
    return out


@dataclass(frozen=True)
class Case:
    kind: str  # mixed, place, field, truncated
    rank: int = 0
    files: tuple[str, ...] = ()
    edit: str = ""
    pick: int = 0  # which key / field
    amount: int = 1
    fraction: float = 0.5
    crafted: bool = False
    base: str = "a"  # the save damaged: "a" or "c" (rank 0's rows differ)


@st.composite
def cases(draw) -> Case:
    case = draw(_damages())
    return Case(**{**case.__dict__, "base": draw(st.sampled_from(["a", "c"]))})


@st.composite
def _damages(draw) -> Case:
    kind = draw(st.sampled_from(["mixed", "place", "field", "truncated"]))
    if kind == "mixed":
        return Case(kind, rank=draw(st.integers(0, 1)),
                    files=draw(st.sampled_from([("json",), ("distcp",), ("json", "distcp")])))
    if kind == "place":
        return Case(kind, rank=draw(st.integers(0, 1)),
                    edit=draw(st.sampled_from(["remove", "shift", "resize", "other-rank", "add"])),
                    pick=draw(st.integers(0, 50)), amount=draw(st.integers(1, 4)), crafted=draw(st.booleans()))
    if kind == "field":
        return Case(kind, files=(draw(st.sampled_from(FILES[:3])),), edit=draw(st.sampled_from(["remove", "rename"])),
                    pick=draw(st.integers(0, 10_000)), crafted=draw(st.booleans()))
    return Case(kind, files=(draw(st.sampled_from(FILES)),), fraction=draw(st.floats(0, 0.999)),
                crafted=draw(st.booleans()))


def _paths(value, prefix=()):
    """Every (path) of a JSON tree, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield (*prefix, i)
            yield from _paths(item, (*prefix, i))


def damage(case: Case, directory: Path, other: Path) -> bool:
    """Apply `case` to the step directory; False when it changes nothing (the example is
    skipped)."""
    def edit_json(name: str, edit) -> None:
        if case.crafted:
            _resign(directory / name, edit)
        else:
            value = json.loads((directory / name).read_text())
            edit(value)
            (directory / name).write_text(json.dumps(value))

    if case.kind == "mixed":
        changed = False
        for what in case.files:
            name = f"rank-{case.rank}.json" if what == "json" else f"__{case.rank}_0.distcp"
            # a byte-identical file (b's rank 0 shard: the same tensors) changes nothing
            changed |= (other / name).read_bytes() != (directory / name).read_bytes()
            shutil.copy2(other / name, directory / name)
        return changed
    if case.kind == "place":
        name = f"rank-{case.rank}.json"
        tensors = json.loads((directory / name).read_text())["tensors"]
        placed = sorted(k for k, spec in tensors.items() if "offsets" in spec)
        unplaced = sorted(k for k, spec in tensors.items() if "offsets" not in spec and not k.startswith("rng@"))
        keys = unplaced if case.edit == "add" else placed
        key = keys[case.pick % len(keys)]
        theirs = json.loads((directory / f"rank-{1 - case.rank}.json").read_text())["tensors"]

        def edit(value):
            spec = value["tensors"][key]
            if case.edit == "remove":
                spec.pop("offsets"), spec.pop("global_shape")
            elif case.edit == "shift":
                spec["offsets"][0] += case.amount
                spec["global_shape"][0] = max(spec["global_shape"][0], spec["offsets"][0] + spec["shape"][0])
            elif case.edit == "resize":
                spec["global_shape"][0] += case.amount
            elif case.edit == "other-rank":
                mine = key.replace(f"@rank{case.rank}", f"@rank{1 - case.rank}")
                spec["offsets"], spec["global_shape"] = list(theirs[mine]["offsets"]), list(theirs[mine]["global_shape"])
            else:
                spec["global_shape"], spec["offsets"] = list(spec["shape"]), [0] * len(spec["shape"])

        edit_json(name, edit)
        return True
    if case.kind == "field":
        name = case.files[0]
        paths = list(_paths(json.loads((directory / name).read_text())))
        path = paths[case.pick % len(paths)]

        def edit(value):
            parent = value
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            item = parent.pop(last)
            if case.edit == "rename" and isinstance(parent, dict):
                parent[f"{last}_renamed"] = item

        edit_json(name, edit)
        return True
    name = case.files[0]
    data = (directory / name).read_bytes()
    cut = int(len(data) * case.fraction)
    if cut >= len(data):
        return False
    (directory / name).write_bytes(data[:cut])
    if case.crafted and name == ".metadata":  # re-record its sha256 in meta.json
        digest = hashlib.sha256(data[:cut]).hexdigest()
        _resign(directory / "meta.json", lambda meta: meta.update(metadata_sha256=digest))
    return True


def _state(bundle) -> dict:
    """What a load sets, as comparable plain values."""
    tensors = {"w": bundle.model.w.detach(), "b": bundle.model.b.detach()}
    for i, name in enumerate("wb"):
        for k, v in bundle.optimizer.state_dict()["state"].get(i, {}).items():
            tensors[f"{name}.{k}"] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in bundle.optimizer.state_dict()["param_groups"]]
    return {"tensors": {k: v.clone().view(-1).view(torch.uint8).tolist() for k, v in tensors.items()},
            "progress": dict(bundle.progress),
            "plain": json.dumps([groups, bundle.lr_scheduler.state_dict(), bundle.metadata,
                                 torch.get_rng_state().tolist(), bundle.generators["jitter"].get_state().tolist()],
                                sort_keys=True, default=str)}


def _content_part(state: dict) -> str:
    progress = {k: state["progress"].get(k) for k in ("step", "consumed_samples")}
    return json.dumps([state["tensors"], progress], sort_keys=True)


def _whole(state: dict) -> str:
    metadata_free = json.loads(state["plain"])
    metadata_free[2] = {"config": {k: v for k, v in metadata_free[2].get("config", {}).items() if k != "tp"}} \
        if isinstance(metadata_free[2], dict) else metadata_free[2]
    return json.dumps([state["tensors"], state["progress"], metadata_free], sort_keys=True, default=str)


class Fuzz:
    """Runs cases against one pair of saves; counts outcomes and the violations."""

    def __init__(self, saves: Path):
        self.saves = saves
        self.outcomes = collections.Counter()
        self.violations: list[str] = []
        self.content_seen: dict[str, str] = {}
        self.state_seen: dict[str, str] = {}
        self.hash_base: dict[str, str] = {}  # every hash seen -> the save it was made from
        for base in ("a", "c"):
            reference = self._fresh()
            checkpoint.load(saves / base, reference, allow_layout_change=True)
            hashed = checkpoint.content_sha256(saves / base)
            self._remember(hashed, _state(reference), f"reference {base}")
            self._from_base(hashed, base, f"reference {base}")

    @staticmethod
    def _fresh():
        _seed_all(99)
        return rows_bundle(0, 1, trained=False)

    def _remember(self, hashed: dict, state: dict, label: str) -> None:
        for seen, key, value in ((self.content_seen, hashed["sha256"], _content_part(state)),
                                 (self.state_seen, hashed.get("state_sha256"), _whole(state))):
            if key is not None and seen.setdefault(key, value) != value:  # (no state hash: older code)
                self.violations.append(f"{label}: hash collision: {key[:16]} already named another loaded state")

    def _from_base(self, hashed: dict, base: str, label: str) -> None:
        for key in (hashed["sha256"], hashed.get("state_sha256")):
            if key is not None and self.hash_base.setdefault(key, base) != base:
                self.violations.append(f"{label}: hash collision between differing contents: {key[:16]} also "
                                       f"hashes a checkpoint made from {self.hash_base[key]!r}")

    def run(self, case: Case) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "a"
            shutil.copytree(self.saves / case.base, root)
            if not damage(case, root / "step-1", self.saves / "b" / "step-1"):
                return
            must_refuse = case.kind == "mixed" or not case.crafted
            label = repr(case)
            bundle = self._fresh()
            before = _state(bundle)
            loaded = hashed = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    checkpoint.load(root, bundle, allow_layout_change=True)
                    loaded = _state(bundle)
                except CheckpointError as err:
                    if not str(err):
                        self.violations.append(f"{label}: refused without a message")
                    if _state(bundle)["tensors"] != before["tensors"] or bundle.progress != before["progress"]:
                        self.violations.append(f"{label}: a refused load changed the bundle")
                except Exception:
                    self.violations.append(f"{label}: load traceback\n{traceback.format_exc()}")
                try:
                    hashed = checkpoint.content_sha256(root)
                except CheckpointError as err:
                    if not str(err):
                        self.violations.append(f"{label}: hash refused without a message")
                except Exception:
                    self.violations.append(f"{label}: hash traceback\n{traceback.format_exc()}")
            self.outcomes[(case.kind, "crafted" if case.crafted else "as is",
                           "loaded" if loaded is not None else "refused")] += 1
            if must_refuse and loaded is not None:
                self.violations.append(f"{label}: silent {'mixed' if case.kind == 'mixed' else 'damaged'} load")
            if must_refuse and hashed is not None:
                self.violations.append(f"{label}: hashed although {'mixed' if case.kind == 'mixed' else 'damaged'}")
            if hashed is not None and case.kind != "mixed":  # a mix's pieces come from two saves
                self._from_base(hashed, case.base, label)
            if loaded is not None and hashed is not None:
                self._remember(hashed, loaded, label)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory) -> Fuzz:
    return Fuzz(make_saves(tmp_path_factory.mktemp("layout-fuzz")))


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("SAMEBITS_LAYOUT_FUZZ_EXAMPLES", "80")), deadline=None,
          database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_crafted_layout_changing_checkpoints_load_exactly_or_are_refused(fuzz, case):
    fuzz.violations.clear()
    fuzz.run(case)
    assert not fuzz.violations, "\n".join(fuzz.violations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from hypothesis import seed

    with tempfile.TemporaryDirectory() as tmp:
        fuzz = Fuzz(make_saves(Path(tmp)))

        @seed(args.seed)
        @settings(max_examples=args.examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases())
        def measure(case):
            fuzz.run(case)

        measure()
    print(f"{sum(fuzz.outcomes.values())} crafted layout-changing checkpoints (tp2 -> one rank):")
    for (kind, how, outcome), count in sorted(fuzz.outcomes.items()):
        print(f"  {kind:9} {how:7} {outcome:7} {count}")
    kinds = collections.Counter(v.split(": ", 2)[1].split("\n")[0] if ": " in v else v for v in fuzz.violations)
    print(f"violations: {len(fuzz.violations)} {dict(kinds)}")
    for violation in fuzz.violations[:5]:
        print("  " + violation.replace("\n", "\n    ")[:2000])
    sys.exit(1 if fuzz.violations else 0)


if __name__ == "__main__":
    main()
