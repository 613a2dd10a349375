"""Global (layout-independent) digests of sharded tensors, without gathering their data.

Each shard adds the body-sum terms of the words it holds at their positions in the full
tensor, and one SUM per shard group gives `digest(full_tensor)` bit for bit.  The math
(straddling words, replicas counted once, 32-bit halves so the SUM never overflows), the
layouts supported and those refused: docs/digest.md, "Global (layout-independent) digests".
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from samebits.errors import ConfigError
from samebits.fingerprint import _digest, _reference
from samebits.fingerprint._spec import GOLDEN, dtype_code, finalize, fmix64, header


def _dtensor_module():
    """``torch.distributed.tensor`` if anything has imported it, else None: no DTensor exists
    before that, and importing it costs ~1.3 s of every process's start-up."""
    return sys.modules.get("torch.distributed.tensor")


def _is_plain(t) -> bool:
    """A plain tensor or parameter no layout shards: its global digest is its local one."""
    cls = t.__class__
    return (cls is torch.Tensor or cls is torch.nn.Parameter) and not getattr(t, "tensor_model_parallel", False)


def _is_dtensor(t) -> bool:
    dtensor = _dtensor_module()
    return dtensor is not None and isinstance(t, dtensor.DTensor)


_GOLDEN = _reference._as_int64(GOLDEN)
_LOW_32_BITS = (1 << 32) - 1
# Words per shifted copy handed to the body-sum backend (bounds the extra memory: 32 MiB).
_WORDS_PER_BATCH = 1 << 22


@dataclass(frozen=True)
class GlobalSums:
    """`global_body_sums`' answer: body sums S (int64 ``[n]``, still on the device), global
    dtypes and shapes, and a 0-dim bool, False when a group's ranks passed different lists."""

    sums: torch.Tensor
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    consistent: torch.Tensor
    # Per tensor: True where the caller's own body sum of the local part stands for the global
    # one (``known`` and not sharded); that entry of ``sums`` is 0, not computed.
    reused: list[bool] = field(default_factory=list)

    def headers(self) -> list[int]:
        return [header(d, s) for d, s in zip(self.dtypes, self.shapes)]


# -- the layout of one tensor ------------------------------------------------------------


@dataclass(frozen=True)
class _Mesh:
    """A sharding layout: mesh dim sizes, one placement per mesh dim (None = Replicate),
    this rank's coordinate."""

    sizes: tuple[int, ...]
    placements: tuple  # Shard-like placement objects or None
    coord: tuple[int, ...]


@dataclass
class _Plan:
    """How this rank's shard of one tensor maps onto the global tensor's words (cached)."""

    contributor: bool
    run_starts: torch.Tensor  # int64 [R]: global byte offset of each local run (row-major order)
    run_bytes: int  # bytes per run (all runs have the same length)
    straddle_words: torch.Tensor  # int64 [k]: global word indices assembled across ranks
    classes: list  # per byte alignment c of run starts: (c, rows, head bytes, full words, tail bytes)
    local_partial: torch.Tensor  # int64 [p]: this rank's partial words that no other rank touches


def _dim_indices(global_shape: tuple[int, ...], mesh: _Mesh, coord: tuple[int, ...]) -> list[torch.Tensor]:
    """Per tensor dim, the global indices (in local order) of the rows a rank holds: each
    placement's own split rule applied left to right, as DTensor does, to an index vector."""
    ndim = len(global_shape)
    indices = [torch.arange(n, dtype=torch.int64) for n in global_shape]
    for mesh_dim, placement in enumerate(mesh.placements):
        if placement is None:
            continue
        dim = placement.dim % ndim if ndim else 0
        view = indices[dim].reshape([1] * dim + [-1] + [1] * (ndim - dim - 1))
        shards, _ = placement._split_tensor(view, mesh.sizes[mesh_dim], with_padding=False, contiguous=True)
        indices[dim] = shards[coord[mesh_dim]].reshape(-1)
    return indices


def _runs(global_shape: tuple[int, ...], indices: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(global element offset of each run, elements per run): the local tensor in row-major
    order is a sequence of equal-length runs, each contiguous in the global tensor."""
    ndim = len(global_shape)
    strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    if any(len(i) == 0 for i in indices):
        return torch.zeros(0, dtype=torch.int64), 0
    k = ndim - 1  # the innermost dim that is not held whole
    while k >= 0 and len(indices[k]) == global_shape[k] and bool((indices[k] == torch.arange(global_shape[k])).all()):
        k -= 1
    if k < 0:  # the whole tensor (a 0-d tensor too)
        return torch.zeros(1, dtype=torch.int64), math.prod(global_shape)
    first = int(indices[k][0])
    contiguous = bool((indices[k] == torch.arange(first, first + len(indices[k]))).all())
    outer = k if contiguous else k + 1  # dims before `outer` index the runs
    run_length = math.prod(global_shape[k + 1 :]) * (len(indices[k]) if contiguous else 1)
    starts = torch.zeros([1] * outer, dtype=torch.int64)
    for d in range(outer):
        shape = [1] * outer
        shape[d] = -1
        starts = starts + indices[d].reshape(shape) * strides[d]
    starts = starts.reshape(-1)
    if contiguous:
        starts = starts + first * strides[k]
    return starts, run_length


def _partial_words(run_starts: torch.Tensor, run_bytes: int, num_bytes: int) -> torch.Tensor:
    """Sorted global indices of the words that runs at byte offsets ``run_starts`` (``run_bytes``
    long) cover only in part (the last word too: its zero padding is nobody's)."""
    if run_bytes == 0 or len(run_starts) == 0:
        return torch.zeros(0, dtype=torch.int64)
    ends = run_starts + run_bytes
    heads = run_starts[run_starts % 8 != 0] // 8
    tails = (ends - 1)[ends % 8 != 0] // 8
    return torch.unique(torch.cat([heads, tails]))


def _contributors(mesh: _Mesh):
    """Coordinates of the members that contribute: coordinate 0 on every Replicate dim."""
    return list(itertools.product(*(range(size if p is not None else 1)
                                     for size, p in zip(mesh.sizes, mesh.placements))))


@functools.lru_cache(maxsize=4096)
def _plan(global_shape: tuple[int, ...], itemsize: int, mesh: _Mesh) -> _Plan:
    num_bytes = math.prod(global_shape) * itemsize
    contributor = all(c == 0 for c, p in zip(mesh.coord, mesh.placements) if p is None)
    # Every contributor's partial words, from the layout alone: a word touched in part by two
    # or more contributors straddles; one touched by one contributor only (several of its
    # runs) is complete on that rank.
    touched = []
    for coord in _contributors(mesh):
        starts, length = _runs(global_shape, _dim_indices(global_shape, mesh, coord))
        touched.append(_partial_words(starts * itemsize, length * itemsize, num_bytes))
    # This rank's own runs (a replica too: they check that its shard matches the layout).
    starts, length = _runs(global_shape, _dim_indices(global_shape, mesh, mesh.coord))
    run_starts, run_bytes = starts * itemsize, length * itemsize
    own_partial = _partial_words(run_starts, run_bytes, num_bytes)
    words, counts = torch.unique(torch.cat(touched), return_counts=True) if touched else (
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    straddle = words[counts > 1]
    local_partial = own_partial[~torch.isin(own_partial, straddle)]
    classes = []
    if run_bytes:
        offsets = run_starts % 8
        for c in torch.unique(offsets).tolist():
            rows = (offsets == c).nonzero().flatten()
            head = min((8 - c) % 8, run_bytes)
            num_words = (run_bytes - head) // 8
            tail = run_bytes - head - 8 * num_words
            classes.append((c, rows, head, num_words, tail))
    return _Plan(contributor, run_starts, run_bytes, straddle, classes, local_partial)


# -- what a tensor is ------------------------------------------------------------------


def _layout(name: str, t: torch.Tensor, group) -> tuple[torch.Tensor, tuple[int, ...], _Mesh | None, object]:
    """(local tensor, global shape, sharding or None for "digest as it is", reduction key)."""
    if _is_plain(t):
        return t, tuple(t.shape), None, None  # the usual case, first: no detach (the digest reads bytes)
    if _is_dtensor(t):
        dtensor = _dtensor_module()
        Partial, Replicate, Shard = dtensor.Partial, dtensor.Replicate, dtensor.Shard
        # FSDP2 + TP on one dim: right-to-left sharding expressed left to right (private in torch)
        _StridedShard = getattr(sys.modules.get("torch.distributed.tensor.placement_types"), "_StridedShard", None)
        spec_mesh = t.device_mesh
        placements = []
        for mesh_dim, p in enumerate(t.placements):
            if isinstance(p, Partial):
                raise ConfigError(
                    f"global digest of {name!r}: its placement on mesh dim {mesh_dim} is {p} (a pending "
                    "reduction): its full value is not defined until it is reduced. Record it after "
                    "t.redistribute(placements=[Replicate() or Shard(d) ...]) or after the reduction.")
            if isinstance(p, Replicate):
                placements.append(None)
            elif isinstance(p, Shard) or (_StridedShard is not None and isinstance(p, _StridedShard)):
                placements.append(p)
            else:
                raise ConfigError(f"global digest of {name!r}: placement {p!r} on mesh dim {mesh_dim} is not "
                                  "supported (Shard, _StridedShard and Replicate are); redistribute it first.")
        local = t.to_local().detach()
        global_shape = tuple(t.shape)
        if all(p is None for p in placements):
            return local, global_shape, None, None
        coord = spec_mesh.get_coordinate()
        if coord is None:  # this rank is outside the mesh: it holds nothing of this tensor
            raise ConfigError(f"global digest of {name!r}: this rank is not in its device mesh; pass only "
                              "the tensors whose mesh includes this rank.")
        mesh = _Mesh(tuple(spec_mesh.shape), tuple(placements), tuple(coord))
        return local, global_shape, mesh, ("mesh", spec_mesh)
    if getattr(t, "tensor_model_parallel", False):
        stride = getattr(t, "partition_stride", 1)
        dim = getattr(t, "partition_dim", None)
        if stride != 1:
            raise ConfigError(
                f"global digest of {name!r}: Megatron partition_stride = {stride} (an interleaved split) is not "
                "supported; only partition_stride = 1. Record its local digest instead, or gather it.")
        if not isinstance(dim, int) or not -t.dim() <= dim < max(t.dim(), 1):
            raise ConfigError(f"global digest of {name!r}: tensor_model_parallel is set but partition_dim = "
                              f"{dim!r} is not a dim of its {t.dim()}-d shape.")
        size = _group_size(group, name)
        if size == 1:
            return t.detach(), tuple(t.shape), None, None
        dim %= t.dim()
        global_shape = tuple(n * size if d == dim else n for d, n in enumerate(t.shape))
        from torch.distributed.tensor import Shard  # loaded on first use (see _dtensor_module)

        mesh = _Mesh((size,), (Shard(dim),), (dist.get_rank(group),))
        return t.detach(), global_shape, mesh, ("group", group)
    if type(t) is not torch.Tensor and isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__"):
        raise ConfigError(f"global digest of {name!r}: a {type(t).__name__} is neither a DTensor nor a plain "
                          "tensor; pass its DTensor or local tensors.")
    return t.detach(), tuple(t.shape), None, None


def _group_size(group, name: str) -> int:
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"global digest of {name!r}: it is a Megatron tensor-parallel shard (tensor_model_parallel=True); "
                "pass group=<its tensor-parallel process group> (e.g. "
                "parallel_state.get_tensor_model_parallel_group()).")
        return 1
    return dist.get_world_size(group)


def _reduction(key) -> tuple[tuple[int, ...], list]:
    """(the ranks reduced over, the process groups to all-reduce over in turn)."""
    kind, obj = key
    world = dist.get_world_size()
    if kind == "group":
        ranks = tuple(dist.get_process_group_ranks(obj))
        return (ranks, [None]) if len(ranks) == world else (ranks, [obj])
    ranks = tuple(obj.mesh.flatten().tolist())
    if len(ranks) == world:
        return ranks, [None]  # the default group spans the mesh: one all-reduce
    return ranks, [obj.get_group(d) for d in range(obj.ndim)]  # one per mesh dim, in turn


# -- the data part -------------------------------------------------------------------------


def _word_values(rows: torch.Tensor, first_shift: int) -> torch.Tensor:
    """Bytes ``rows`` (uint8 [R, b], b <= 8) placed at byte ``first_shift`` on: int64 [R]."""
    places = torch.tensor([1 << (8 * (first_shift + i)) for i in range(rows.shape[1])],  # <= 2**56
                          dtype=torch.int64, device=rows.device)
    return (rows.to(torch.int64) * places).sum(dim=1)  # disjoint bytes: the sum is their OR (wrapping)


def _shifted_body_sum(words: torch.Tensor, first_words: torch.Tensor) -> torch.Tensor:
    """sum_{r,k} mix2(words[r, k] + (first_words[r] + k + 1)*G) for int64 ``words`` [R, q], by
    the digest's own backend, which numbers its input's words 0 .. R*q-1: word (r, k) is first
    offset by (first_words[r] - r*q)*G (docs/digest.md).  ``words`` is not changed."""
    num_rows, num_words = words.shape
    offsets = (first_words - torch.arange(num_rows, device=words.device) * num_words) * _GOLDEN
    return _digest.body_sums_of_checked([words + offsets[:, None]], words.device)[0]


def _mix_words(words: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """mix2(w_j + (j+1)*G) elementwise (int64)."""
    x = (indices + 1) * _GOLDEN + words
    return _reference._mix2_(x, torch.empty_like(x))


def _local_sum(data: torch.Tensor, plan: _Plan, straddle_slots: torch.Tensor) -> torch.Tensor:
    """This rank's part of S (complete words, including partial words only it touches), and
    its bytes of the straddling words scattered into ``straddle_slots`` (in place)."""
    device = data.device
    total = torch.zeros((), dtype=torch.int64, device=device)
    if plan.run_bytes == 0:
        return total
    rows_all = data.view(-1, plan.run_bytes)
    starts_all = plan.run_starts.to(device)
    partial_words, partial_values = [], []
    for c, rows_cpu, head, num_words, tail in plan.classes:
        rows = rows_cpu.to(device)
        starts = starts_all[rows]
        if num_words and len(rows_cpu) == 1:  # one run (Shard(0), FSDP2): chunks of its words
            first_word = (int(plan.run_starts[int(rows_cpu[0])]) + head) // 8
            run = rows_all[int(rows_cpu[0]), head : head + 8 * num_words]
            for first in range(0, num_words, _WORDS_PER_BATCH):
                chunk = run[8 * first : 8 * min(first + _WORDS_PER_BATCH, num_words)]
                if chunk.storage_offset() % 8:  # view(int64) needs an 8-byte aligned offset
                    chunk = chunk.clone()
                total += _shifted_body_sum(chunk.view(torch.int64).unsqueeze(0),
                                           torch.tensor([first_word + first], device=device))
        elif num_words:  # runs of rows with this byte alignment: a block of rows at a time
            step = max(1, _WORDS_PER_BATCH // num_words)
            for first in range(0, len(rows), step):
                chunk = rows_all[rows[first : first + step], head : head + 8 * num_words].contiguous()
                total += _shifted_body_sum(chunk.view(torch.int64), (starts[first : first + step] + head) // 8)
        if head:
            partial_words.append(starts // 8)
            partial_values.append(_word_values(rows_all[rows, :head], c))
        if tail:
            partial_words.append((starts + plan.run_bytes - 1) // 8)
            partial_values.append(_word_values(rows_all[rows, plan.run_bytes - tail :], 0))
    if not partial_words:
        return total
    words, values = torch.cat(partial_words), torch.cat(partial_values)
    straddle = plan.straddle_words.to(device)
    if len(straddle):
        slot = torch.searchsorted(straddle, words)
        shared = torch.isin(words, straddle)
        straddle_slots.index_add_(0, slot[shared], values[shared])
        words, values = words[~shared], values[~shared]
    if len(words):  # partial words that only this rank touches: assemble and mix here
        local = plan.local_partial.to(device)
        assembled = torch.zeros(len(local), dtype=torch.int64, device=device)
        assembled.index_add_(0, torch.searchsorted(local, words), values)
        total += _mix_words(assembled, local).sum()
    return total


def _names_check(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    """A 64-bit number from the names, dtypes and global shapes of a group's tensors."""
    h = 0x5AB17
    for name, dtype, shape in entries:
        for part in (name.encode(), str(dtype).encode(), repr(shape).encode()):
            for i in range(0, len(part), 8):
                h = fmix64(h ^ int.from_bytes(part[i : i + 8], "little") ^ (len(part) << 56))
    return h


def all_unsharded(tensors) -> bool:
    """Whether no tensor of ``tensors`` (None allowed) is sharded (`_is_plain`)."""
    return all(t is None or _is_plain(t) for t in tensors)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, sharing its storage: a DTensor's local shard, else ``t``."""
    return t.to_local() if _is_dtensor(t) else t


def global_body_sums(named_tensors, *, group=None, known=None) -> tuple[list[str], GlobalSums]:
    """The full tensors' body sums S, computed shard by shard: (names, `GlobalSums`); collective
    like `global_digests`, with no host synchronisation.  ``known`` (a bool per tensor): the
    caller holds the body sum of its `local_part` as it is now, so an unsharded one is not read
    again (``sums`` entry 0, ``reused`` True); ranks may differ in it."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    names, locals_, shapes, plans, keys, dtypes = [], [], [], [], [], []
    seen = set()
    for name, t in named_tensors:
        name = str(name)
        if name in seen:
            raise ConfigError(f"global digests: the name {name!r} is given twice; names identify tensors.")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"global digests: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        local, global_shape, mesh, key = _layout(name, t, group)
        dtype_code(local.dtype)  # refuses dtypes without a digest, naming them
        if mesh is not None:
            plan = _plan(global_shape, local.dtype.itemsize, mesh)
            expected = plan.run_bytes * len(plan.run_starts)
            if local.numel() * local.dtype.itemsize != expected:
                raise ConfigError(
                    f"global digest of {name!r}: its local shard has shape {tuple(local.shape)}, which does not "
                    f"match its layout ({mesh.placements} on a mesh of {mesh.sizes}, global shape {global_shape}); "
                    "the placements do not describe the data it holds.")
        else:
            plan = None
        for column, value in zip((names, locals_, shapes, plans, keys, dtypes),
                                 (name, local, global_shape, plan, key, local.dtype)):
            column.append(value)
    devices = {t.device for t in locals_}
    if len(devices) > 1:
        raise ConfigError(f"global digests take tensors on one device, got {', '.join(sorted(map(str, devices)))}; "
                          "call once per device.")
    device = devices.pop() if devices else torch.device("cpu")
    consistent = torch.ones((), dtype=torch.bool, device=device)
    # Unsharded tensors: the ordinary digest path (one native call on CPU), less those whose
    # local body sum the caller holds (``known``): for them the local sum is the global one.
    if known is not None and len(known) != len(plans):
        raise ConfigError(f"global digests: known has {len(known)} entries for {len(plans)} tensors; "
                          "pass one bool per tensor, in order.")
    reused = [plan is None and bool(known[i]) for i, plan in enumerate(plans)] if known is not None \
        else [False] * len(plans)
    whole = [i for i, plan in enumerate(plans) if plan is None and not reused[i]]
    if len(whole) == len(plans):  # nothing sharded (e.g. one rank): no scatter into a zeroed vector
        sums = _digest.body_sums(locals_).to(device)
    else:
        sums = torch.zeros(len(names), dtype=torch.int64, device=device)
        if whole:
            sums[whole] = _digest.body_sums([locals_[i] for i in whole]).to(device)
    # Sharded tensors: one reduction per group of ranks, in order of first appearance.
    by_group: dict = {}
    for i, key in enumerate(keys):
        if key is not None:
            ranks, groups = _reduction(key)
            by_group.setdefault(ranks, (groups, []))[1].append(i)
    for ranks, (groups, members) in by_group.items():
        check = _names_check([(names[i], dtypes[i], shapes[i]) for i in members])
        vector = _contribution([locals_[i] for i in members], [plans[i] for i in members], check, device)
        for process_group in groups:
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=process_group)
        body, ok = _assemble(vector, [plans[i] for i in members], check, len(ranks))
        consistent &= ok
        sums[members] = body
    return names, GlobalSums(sums, dtypes, shapes, consistent, reused)


def _contribution(local_tensors: list[torch.Tensor], plans: list[_Plan], check: int, device) -> torch.Tensor:
    """This rank's int64 vector for the group's SUM: the low and high 32-bit halves of each
    tensor's partial body sum (zeros from a replica), the two halves of ``check``, then its
    bytes of every straddling word."""
    num = len(plans)
    widths = [len(plan.straddle_words) for plan in plans]
    vector = torch.zeros(2 * num + 2 + sum(widths), dtype=torch.int64, device=device)
    slots = vector[2 * num + 2 :]
    offset = 0
    for position, (local, plan) in enumerate(zip(local_tensors, plans)):
        width = widths[position]
        if plan.contributor:
            part = _local_sum(_digest._as_bytes(local), plan, slots[offset : offset + width])
            vector[position] = part & _LOW_32_BITS
            vector[num + position] = (part >> 32) & _LOW_32_BITS
        offset += width
    vector[2 * num] = check & _LOW_32_BITS
    vector[2 * num + 1] = check >> 32
    return vector


def _assemble(vector: torch.Tensor, plans: list[_Plan], check: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From the summed vector: each full tensor's body sum S (int64 [n]), and whether every
    one of ``num_ranks`` ranks sent the same ``check``."""
    num, device = len(plans), vector.device
    body = vector[num : 2 * num] * (1 << 32) + vector[:num]  # wraps mod 2^64 like the spec
    expected = torch.tensor([(check & _LOW_32_BITS) * num_ranks, (check >> 32) * num_ranks],
                            dtype=torch.int64, device=device)
    ok = (vector[2 * num : 2 * num + 2] == expected).all()
    offset = 2 * num + 2
    for position, plan in enumerate(plans):
        width = len(plan.straddle_words)
        if width:  # every rank mixes the assembled straddling words alike
            words = vector[offset : offset + width]
            body[position] += _mix_words(words, plan.straddle_words.to(device)).sum()
        offset += width
    return body, ok


def global_digests(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                   group=None) -> dict[str, int]:
    """``{name: digest of the full tensor}`` for ``(name, tensor)`` pairs or a mapping of DTensors,
    FSDP2 parameters, Megatron shards over ``group`` or plain tensors (docs/digest.md), equal to
    `digest(full)`, with no gather.  Collective: every rank of each group passes the same names
    in the same order (else a `ConfigError`); one int64 all-reduce per group.
    """
    names, result = global_body_sums(named_tensors, group=group)
    if not bool(result.consistent):
        raise ConfigError(
            "global digests: the ranks of a process group passed different tensors (names, dtypes or global "
            f"shapes; this rank passed {len(names)}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}). "
            "Every rank must pass the same names in the same order, each with its own shard.")
    return dict(zip(names, finalize(result.sums, result.headers())))
