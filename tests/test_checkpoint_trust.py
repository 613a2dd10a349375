"""Trust in a checkpoint's files (issue 34 items 2-4): one save per directory, places checked at
every load, and hashes that cover every piece and the whole resumable state.

- A tp2 checkpoint whose rank 1 files (`rank-1.json`, `__1_0.distcp`) were copied from another
  run's save of the same step is refused at load (and by `content_sha256`), naming the file,
  the rank and both save ids; the old code loaded rows from two runs.
- Ranks that declare each other's places at the same layout are refused (the old code gave each
  the other's rows); opted in (`allow_layout_change=True`) each gets the rows of its place.
- A piece without a place beside placed ones is refused, never dropped: two checkpoints whose
  rank-0 pieces differ, with rank 1's places removed, hashed alike in the old code.
- `state_sha256` covers what `sha256` leaves out (optimizer settings, scheduler, every progress
  field, rank 0's random states, metadata less its layout entries), the same at any layout;
  the certificate's `checkpoints_equal` needs both.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from samebits import checkpoint
from samebits.checkpoint import CheckpointError, CheckpointLayoutError, StateBundle


class _Rows(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.w, self.b = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())


def _global(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=g), torch.randn(3, generator=g), torch.randn(4, 3, generator=g)


def rows_bundle(rank: int, world: int, *, seed: int = 0, trained: bool = True, place: int | None = None,
                edit=None) -> StateBundle:
    """One AdamW step (and one StepLR step) on the rows of a 4x3 weight that rank `rank` holds
    at world size `world` (row halves at 2: a tensor-parallel shard with its place; `place`: the
    half this rank declares, default its own), a replicated bias; the config's `tp` is declared
    as layout metadata.  `edit(bundle)` changes it before it is returned."""
    place = rank if place is None else place
    weight, bias, grad = _global(seed)
    rows = slice(0, 4) if world == 1 else slice(2 * place, 2 * place + 2)
    model = _Rows(weight[rows], bias) if trained else _Rows(torch.zeros(4 // world, 3), torch.zeros(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if trained:
        model.w.grad, model.b.grad = grad[rows].clone(), torch.ones(3)
        optimizer.step()
        scheduler.step()
    bundle = StateBundle(model=model, optimizer=optimizer, lr_scheduler=scheduler, layout={"tp": world},
                         progress={"step": 1, "consumed_samples": 8},
                         generators={"jitter": torch.Generator().manual_seed(5)},
                         shards={} if world == 1 else {"w": checkpoint.TensorShard((4, 3), (2 * place, 0))},
                         metadata={"config": {"tp": world, "lr": 0.1}}, layout_metadata=("config.tp",))
    if edit is not None:
        edit(bundle)
    return bundle


def _seed_all(seed: int = 1) -> None:
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)


def _flip_first_bit(bundle: StateBundle) -> None:
    with torch.no_grad():
        bundle.model.w.view(torch.int32).view(-1)[0] ^= 1


def _worker(rank: int, world: int, init: str, out: str) -> None:
    """Save run a, another run b of the same step and a variant of a whose rank-0 piece differs
    (all at tp2); mix a with b's rank 1 files; load the mix, and a with the places swapped."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    found: dict = {}
    root = Path(out)
    try:
        _seed_all()
        checkpoint.save(root / "a", rows_bundle(rank, world))
        _seed_all()
        # another run of the same step: its rank 1 rows differ (by one bit), the replicated
        # bias and everything else are the same, so nothing but the save id can tell the mix
        checkpoint.save(root / "b", rows_bundle(rank, world, edit=_flip_first_bit if rank == 1 else None))
        _seed_all()
        checkpoint.save(root / "a-rank0-differs",
                        rows_bundle(rank, world, edit=_flip_first_bit if rank == 0 else None))
        if rank == 0:  # another run's rank 1 files copied into a's directory
            shutil.copytree(root / "a", root / "mixed")
            for name in ("rank-1.json", "__1_0.distcp"):
                shutil.copy2(root / "b" / "step-1" / name, root / "mixed" / "step-1" / name)
        dist.barrier()

        def attempt(name: str, bundle: StateBundle, **kwargs) -> dict:
            try:
                checkpoint.load(root / name, bundle, **kwargs)
            except CheckpointError as err:
                return {"refused": type(err).__name__, "message": str(err)}
            return {"refused": None, "w": bundle.model.w.detach().tolist()}

        fresh = rows_bundle(rank, world, trained=False)
        found["mixed"] = attempt("mixed", fresh)
        found["mixed_untouched"] = not fresh.model.w.detach().any()
        swapped = rows_bundle(rank, world, trained=False, place=1 - rank)
        found["swapped"] = attempt("a", swapped)
        found["swapped_untouched"] = not swapped.model.w.detach().any()
        found["swapped_opted_in"] = attempt("a", rows_bundle(rank, world, trained=False, place=1 - rank),
                                            allow_layout_change=True)
        found["own"] = attempt("a", rows_bundle(rank, world, trained=False))
    except Exception as err:  # a worker's failure must reach the test, not vanish in mp.spawn
        found["error"] = f"{type(err).__name__}: {err}"
    finally:
        Path(f"{out}/found.{rank}.json").write_text(json.dumps(found))
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then under load)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("trust")
    _seed_all()
    checkpoint.save(out / "one", rows_bundle(0, 1))
    mp.spawn(_worker, args=(2, f"file://{out / 'init'}", str(out)), nprocs=2, join=True)
    return out


def _found(saves: Path) -> list[dict]:
    found = [json.loads((saves / f"found.{rank}.json").read_text()) for rank in range(2)]
    assert all("error" not in f for f in found), found
    return found


def _save_id(directory: Path) -> str:
    return json.loads((directory / "meta.json").read_text())["save_id"]


def _resign(path: Path, edit) -> None:
    """Edit a checkpoint JSON file and re-record its checksum, as a crafted file would."""
    import hashlib

    value = json.loads(path.read_text())
    edit(value)
    value.pop("sha256", None)
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    value["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    path.write_text(json.dumps(value))


# -- item 2: one save per directory --------------------------------------------------------------

def test_a_checkpoint_mixed_from_two_saves_is_refused_naming_file_rank_and_both_saves(saves):
    """rank-1.json and __1_0.distcp copied from another run's save of the same step: every rank
    refuses (rank 0 because rank 1 did) before reading a byte, the bundles untouched; the old
    code loaded rows from two runs."""
    found = _found(saves)
    own = found[1]["mixed"]
    assert own["refused"] == "CheckpointError", found
    a, b = _save_id(saves / "a" / "step-1"), _save_id(saves / "b" / "step-1")
    assert a != b
    message = own["message"]
    assert str(saves / "mixed" / "step-1" / "rank-1.json") in message and "rank 1's file" in message
    assert f"written by save {b} of step 1" in message and f"by save {a} of step 1" in message
    assert "mixes files of two saves" in message and "save again" in message
    assert found[0]["mixed"]["refused"] and "rank 1 refused the checkpoint" in found[0]["mixed"]["message"]
    assert found[0]["mixed_untouched"] and found[1]["mixed_untouched"]
    with pytest.raises(CheckpointError, match=rf"rank-1\.json: rank 1's file was written by save {b}"):
        checkpoint.content_sha256(saves / "mixed")


def test_a_rank_file_that_names_no_save_or_another_step_is_refused(saves, tmp_path):
    shutil.copytree(saves / "a", tmp_path / "a")
    directory = tmp_path / "a" / "step-1"
    _resign(directory / "rank-0.json", lambda v: v["save"].update(step=2))
    with pytest.raises(CheckpointError, match=r"rank-0\.json: rank 0's file was written by save [0-9a-f]{32} "
                                              r"of step 2, but .*meta\.json by save [0-9a-f]{32} of step 1"):
        checkpoint.content_sha256(directory)
    _resign(directory / "rank-0.json", lambda v: v.pop("save"))
    with pytest.raises(CheckpointError, match=r"rank-0\.json lacks fields \['save'\]"):
        checkpoint.content_sha256(directory)


def test_a_checkpoint_of_the_previous_format_loads_with_a_note(tmp_path):
    """Format 2 (no save id): loads as before, with a warning that says what is not checked."""
    _seed_all()
    bundle = rows_bundle(0, 1)
    directory = checkpoint.save(tmp_path / "ckpt", bundle)

    def second_format(meta):
        meta["format"] = "samebits-checkpoint/2"
        meta.pop("save_id"), meta.pop("layout_metadata")

    _resign(directory / "meta.json", second_format)
    _resign(directory / "rank-0.json", lambda v: v.pop("save"))
    fresh = rows_bundle(0, 1, trained=False)
    with pytest.warns(UserWarning, match=r"saved by an earlier samebits \(samebits-checkpoint/2\): its files "
                                         r"carry no save id.*Save it again"):
        checkpoint.load(tmp_path / "ckpt", fresh)
    assert torch.equal(fresh.model.w, bundle.model.w)
    assert checkpoint.content_sha256(directory)["sha256"] == checkpoint.content_sha256(
        checkpoint.save(tmp_path / "again", bundle))["sha256"]


# -- item 3: places at every load ----------------------------------------------------------------

def test_ranks_declaring_swapped_places_at_the_same_layout_are_refused(saves):
    """Each rank declares the other's half: the old code loaded each rank's saved rows into it
    (the rows of the other place); now refused, naming the tensor and both places, bundle
    untouched; with the opt-in each rank gets the rows of the place it declares."""
    found = _found(saves)
    weight = _trained_weight()
    for rank in range(2):
        swapped = found[rank]["swapped"]
        assert swapped["refused"] in ("CheckpointLayoutError", "CheckpointError"), found
        assert found[rank]["swapped_untouched"]
    own = found[0]["swapped"]["message"]
    assert own.startswith(str(saves / "a" / "step-1" / "rank-0.json")), own
    assert ("rank 0 saved model/w@rank0 with offsets [0, 0] of a global tensor of shape [4, 3], but rank 0's "
            "bundle declares offsets [2, 0]") in own and "allow_layout_change=True" in own
    for rank in range(2):
        opted = found[rank]["swapped_opted_in"]
        assert opted["refused"] is None, opted
        other = 1 - rank
        assert torch.equal(torch.tensor(opted["w"]), weight[2 * other:2 * other + 2])
        assert torch.equal(torch.tensor(found[rank]["own"]["w"]), weight[2 * rank:2 * rank + 2])


def _trained_weight() -> torch.Tensor:
    _seed_all()
    return rows_bundle(0, 1).model.w.detach()


def test_a_place_in_the_file_that_differs_from_the_bundles_is_refused(saves, tmp_path):
    """One process, the rank file's place edited (checksum re-recorded): refused at load."""
    _seed_all()
    root = tmp_path / "one"
    directory = checkpoint.save(root, rows_bundle(0, 1, edit=lambda b: b.shards.update(
        w=checkpoint.TensorShard((4, 3), (0, 0)))))

    def move(value):
        value["tensors"]["model/w@rank0"]["global_shape"] = [8, 3]
        value["tensors"]["model/w@rank0"]["offsets"] = [4, 0]

    _resign(directory / "rank-0.json", move)
    fresh = rows_bundle(0, 1, trained=False, edit=lambda b: b.shards.update(w=checkpoint.TensorShard((4, 3), (0, 0))))
    with pytest.raises(CheckpointLayoutError, match=r"saved model/w@rank0 with offsets \[4, 0\] of a global tensor "
                                                    r"of shape \[8, 3\], but rank 0's bundle declares offsets \[0, 0\]"):
        checkpoint.load(root, fresh)
    assert not fresh.model.w.detach().any()


# -- item 4: the content hash drops nothing; the state hash -------------------------------------

def test_a_piece_without_its_place_is_refused_never_dropped(saves, tmp_path):
    """Two tp2 checkpoints whose rank-0 pieces differ, rank 1's places removed (checksum
    re-recorded): the old code let rank 1's piece replace rank 0's and hashed both alike."""
    first, second = (checkpoint.content_sha256(saves / name)["sha256"] for name in ("a", "a-rank0-differs"))
    assert first != second
    for name in ("a", "a-rank0-differs"):
        shutil.copytree(saves / name, tmp_path / name)

        def unplace(value):
            for spec in value["tensors"].values():
                spec.pop("global_shape", None), spec.pop("offsets", None)

        _resign(tmp_path / name / "step-1" / "rank-1.json", unplace)
        with pytest.raises(CheckpointLayoutError, match=r"model/w is saved with a place in a global tensor by "
                                                        r"rank\(s\) \[0\] but without one by rank\(s\) \[1\].*refused, "
                                                        r"not dropped"):
            checkpoint.content_sha256(tmp_path / name)


def test_the_state_hash_is_the_same_at_any_layout_and_names_what_differs(saves, tmp_path):
    """The same state saved on one rank and at tp2 (config's tp declared as layout metadata):
    both hashes equal.  Each change of optimizer settings, scheduler, progress, random states or
    metadata leaves the content hash as it is and changes the state hash in exactly its part."""
    one, two = checkpoint.content_sha256(saves / "one"), checkpoint.content_sha256(saves / "a")
    assert one["sha256"] == two["sha256"] and one["state_sha256"] == two["state_sha256"], (one, two)
    assert list(one["state_parts"]) == ["progress", "optimizer", "lr_scheduler", "metadata", "rng"]

    def hashed(name: str, edit, *, seed: int = 1) -> dict:
        _seed_all(seed)
        checkpoint.save(tmp_path / name, rows_bundle(0, 1, edit=edit))
        return checkpoint.content_sha256(tmp_path / name)

    def set_group(key, value):
        return lambda b: b.optimizer.param_groups[0].__setitem__(key, value)

    cases = {  # name -> (edit, seed, the part that must differ)
        "lr": (set_group("lr", 0.2), 1, "optimizer"),
        "betas": (set_group("betas", (0.8, 0.999)), 1, "optimizer"),
        "scheduler": (lambda b: setattr(b.lr_scheduler, "gamma", 0.9), 1, "lr_scheduler"),
        "epoch": (lambda b: b.progress.update(epoch=3), 1, "progress"),
        "rng": (None, 2, "rng"),
        "generator": (lambda b: b.generators["jitter"].manual_seed(6), 1, "rng"),
        "metadata": (lambda b: b.metadata["config"].update(lr=0.3), 1, "metadata"),
    }
    for name, (edit, seed, part) in cases.items():
        other = hashed(name, edit, seed=seed)
        assert other["sha256"] == one["sha256"], name
        assert other["state_sha256"] != one["state_sha256"], name
        assert [p for p in one["state_parts"] if one["state_parts"][p] != other["state_parts"][p]] == [part], name
    layout_only = hashed("layout-entry", lambda b: b.metadata["config"].update(tp=8))
    assert layout_only["state_sha256"] == one["state_sha256"]  # a declared layout entry is left out


def test_the_certificate_fails_checkpoints_whose_resumable_states_differ(saves, tmp_path):
    """`final_checkpoints` (verify --across's certificate): equal contents but another learning
    rate is not equal (the old code said checkpoints_equal: true)."""
    from samebits.runners.across import final_checkpoints

    _seed_all()
    checkpoint.save(tmp_path / "lr", rows_bundle(0, 1, edit=lambda b: b.optimizer.param_groups[0].update(lr=0.2)))
    hashes, equal, note = final_checkpoints({"one": {"path": saves / "one", "final": 1},
                                             "tp2": {"path": saves / "a", "final": 1}})
    assert equal is True and note == "" and hashes["tp2"]["state_sha256"] == hashes["one"]["state_sha256"]
    hashes, equal, note = final_checkpoints({"one": {"path": saves / "one", "final": 1},
                                             "lr": {"path": tmp_path / "lr", "final": 1}})
    assert hashes["lr"]["content_sha256"] == hashes["one"]["content_sha256"]
    assert equal is False and "resumable states differ although their contents are equal: lr in optimizer" in note
