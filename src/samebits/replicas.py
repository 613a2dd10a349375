"""Data-parallel replica consistency, checked on the device: do the ranks that should hold
the same parameters hold the same bits?  (docs/replicas.md)

Each rank digests its replicated tensors where they live, all-gathers one 8-byte root, and
only when roots differ gathers the per-tensor digests to name what differs: no copy of the
weights leaves the device.  A DTensor is a replica only along its ``Replicate`` mesh
dimensions; one sharded everywhere is listed in ``report.not_replicated``.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from samebits._torchutil import optimizer_params
from samebits.errors import ConfigError, SamebitsError
from samebits.fingerprint import digest_many
from samebits.verdicts import ToDict, Verdict

try:  # DTensor: public since torch 2.5
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - older torch
    DTensor, Replicate = (), ()


class ReplicaMismatchError(SamebitsError):
    """Data-parallel replicas hold different bits; ``report`` says which tensors, which ranks."""

    def __init__(self, message: str, report: "ReplicaReport | None" = None):
        super().__init__(message)
        self.report = report


@dataclass
class ReplicaMismatch(ToDict):
    """One tensor whose replicas differ: ``ranks`` hold a value other than the majority's
    (on a tie, the value of the lowest rank is taken as the reference)."""

    name: str
    ranks: list[int]  # global ranks holding a minority value
    digests: dict[int, str]  # global rank -> digest (hex) of its copy
    group: list[int]  # the replica group's global ranks
    tie: bool = False  # no majority (e.g. 2 replicas): which copy is right cannot be told


@dataclass
class ReplicaReport(ToDict):
    """What `check_replicas` found: PASS, FAIL (see ``mismatches``) or INCOMPLETE (nothing was
    replicated, so nothing was compared)."""

    dict_keys = ("verdict", "exit_code", "step", "num_tensors", "num_groups", "mismatches", "not_replicated")

    verdict: Verdict
    num_tensors: int  # replicated tensors compared on this rank
    num_groups: int  # replica groups they were compared over
    mismatches: list[ReplicaMismatch] = field(default_factory=list)
    not_replicated: list[str] = field(default_factory=list)  # sharded/partial on every mesh dim
    step: int | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.PASS

    def summary(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        if self.verdict is Verdict.PASS:
            return f"replicas consistent{where}: {self.num_tensors} tensors equal over {self.num_groups} group(s)"
        if self.verdict is Verdict.INCOMPLETE:
            return f"replicas not checked{where}: no replicated tensor (all {len(self.not_replicated)} sharded)"
        shown = "; ".join(f"{m.name} differs on rank(s) {m.ranks} of {m.group}"
                          + (" (no majority: either copy may be the wrong one)" if m.tie else "")
                          for m in self.mismatches[:5])
        more = f"; ... {len(self.mismatches) - 5} more" if len(self.mismatches) > 5 else ""
        return f"replicas differ{where}: {len(self.mismatches)} of {self.num_tensors} tensors: {shown}{more}"

    def dict_extras(self) -> dict:
        return {"exit_code": self.verdict.exit_code}


def check_replicas(model_or_named_tensors, group=None, *, optimizer: torch.optim.Optimizer | None = None,
                   buffers: bool = False, step: int | None = None) -> ReplicaReport:
    """Compare every replicated tensor across its replicas; collective: every rank of the
    group (and of each DTensor mesh group) calls it with the same names.  ``optimizer``: its
    state too (``optimizer/<param name>/<key>``); ``group``: plain tensors' group (the world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("check_replicas compares ranks: initialise torch.distributed first "
                          "(e.g. torchrun + init_process_group).")
    named = _named_tensors(model_or_named_tensors, optimizer, buffers)
    by_group: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    not_replicated = []
    for name, tensor in named:
        if isinstance(tensor, DTensor):
            dims = [i for i, placement in enumerate(tensor.placements) if isinstance(placement, Replicate)]
            if not dims:
                not_replicated.append(name)
                continue
            local = tensor.to_local()
            for dim in dims:
                by_group.setdefault(tensor.device_mesh.get_group(dim), []).append((name, local))
        else:
            by_group.setdefault(group if group is not None else dist.group.WORLD, []).append((name, tensor))
    mismatches = [found for pg, members in _ordered(by_group) for found in _check_group(pg, members)]
    verdict = Verdict.INCOMPLETE if not by_group else Verdict.FAIL if mismatches else Verdict.PASS
    num_tensors = sum(len(members) for members in by_group.values())
    return ReplicaReport(verdict, num_tensors, len(by_group), mismatches, not_replicated, step)


class ReplicaCheck:
    """`check_replicas` every ``every`` steps of a training loop: call ``step(step)`` after
    the optimizer step.  On a mismatch it calls ``on_mismatch(report)`` when given, else
    raises `ReplicaMismatchError` (the same on every rank, so no rank is left waiting in a
    collective).  ``reports`` keeps the last report."""

    def __init__(self, model_or_named_tensors, every: int, *, group=None, optimizer=None, buffers: bool = False,
                 on_mismatch: Callable[[ReplicaReport], None] | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"ReplicaCheck(every={every!r}): give a positive number of steps.")
        self.source, self.every, self.group = model_or_named_tensors, every, group
        self.optimizer, self.buffers, self.on_mismatch = optimizer, buffers, on_mismatch
        self.last: ReplicaReport | None = None

    def step(self, step: int) -> ReplicaReport | None:
        """Check at steps that are multiples of ``every`` (None at other steps)."""
        if step % self.every:
            return None
        report = check_replicas(self.source, self.group, optimizer=self.optimizer, buffers=self.buffers, step=step)
        self.last = report
        if report.verdict is Verdict.FAIL:
            if self.on_mismatch is not None:
                self.on_mismatch(report)
            else:
                raise ReplicaMismatchError(report.summary() + ". The data-parallel replicas have drifted apart: "
                                           "find where with `samebits bisect` on two recorded runs.", report)
        return report


def _named_tensors(source, optimizer, buffers) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.nn.Module):
        named = list(source.named_parameters())
        if buffers:
            named += list(source.named_buffers())
    elif isinstance(source, dict):
        named = list(source.items())
    else:
        named = list(source)
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"check_replicas: expected (name, tensor) pairs, got ({name!r}, {type(tensor).__name__})")
    if optimizer is not None:
        for pname, param in optimizer_params(optimizer, {id(p): n for n, p in named}):
            named += [(f"optimizer/{pname}/{key}", value) for key, value in
                      sorted(optimizer.state.get(param, {}).items(), key=lambda kv: str(kv[0]))
                      if isinstance(value, torch.Tensor)]
    return [(n, t.detach()) for n, t in named]


def _ordered(by_group: dict) -> Iterable[tuple[Any, list]]:
    """Groups in an order every rank agrees on (their global ranks), so collectives match."""
    return sorted(by_group.items(), key=lambda kv: dist.get_process_group_ranks(kv[0]))


def _exchange_device(pg) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")


def _check_group(pg, members: list[tuple[str, torch.Tensor]]) -> list[ReplicaMismatch]:
    """One replica group: roots first (8 bytes per rank), digests only when roots differ."""
    ranks = dist.get_process_group_ranks(pg)
    if len(ranks) < 2:
        return []
    names = [name for name, _ in members]
    digests = digest_many(t for _, t in members)  # on the device; 8 bytes per tensor to the host
    packed = struct.pack(f"<{len(digests)}Q", *digests)
    root = _u63(hashlib.sha256(packed).digest())
    names_key = _u63(hashlib.sha256("\0".join(names).encode()).digest())
    device = _exchange_device(pg)
    mine = torch.tensor([root, names_key, len(members)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=pg)
    rows = [g.tolist() for g in gathered]
    if len({(r[1], r[2]) for r in rows}) > 1:
        raise ReplicaMismatchError(
            f"check_replicas: the ranks {ranks} of a replica group pass different tensor names or counts "
            f"({[r[2] for r in rows]} tensors): every replica must check the same tensors, in the same order.")
    if len({r[0] for r in rows}) == 1:
        return []
    # Roots differ: exchange every digest (as int64 bits) to say which tensors, which ranks.
    values = torch.tensor([d - (1 << 64) if d >= 1 << 63 else d for d in digests], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(values) for _ in ranks]
    dist.all_gather(everyone, values, group=pg)
    table = [[v & ((1 << 64) - 1) for v in row.tolist()] for row in everyone]
    mismatches = []
    for index, name in enumerate(names):
        column = [row[index] for row in table]
        if len(set(column)) == 1:
            continue
        counts = Counter(column)
        top = max(counts.values())
        reference = next(v for v in column if counts[v] == top)  # the majority; on a tie the lowest rank's
        mismatches.append(ReplicaMismatch(
            name=name, ranks=[r for r, v in zip(ranks, column) if v != reference],
            digests={r: f"{v:016x}" for r, v in zip(ranks, column)}, group=list(ranks),
            tie=sum(1 for count in counts.values() if count == top) > 1))
    return mismatches


def _u63(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


__all__ = ["check_replicas", "ReplicaCheck", "ReplicaReport", "ReplicaMismatch", "ReplicaMismatchError"]
