"""Invariant gradient reduction: a gradient accumulator for hand-written loops, a DDP
communication hook, the global count for loss normalisation, and clipping in canonical order.

One step, on every rank (W ranks, M micro-batches, k = M / W of them here):

1. after each local micro-batch's backward, keep its fp32 gradient (canonical blocks);
2. block exponents: the MAX over the k local micro-batches, then an exact int8 MAX all-reduce;
3. encode each micro-batch in int64 fixed point and add them up locally (exact);
4. reduce-scatter the int64 sums (exact, any order), decode this rank's shard to fp32 once
   (correctly rounded), all-gather the fp32 shards.  Bytes per element on the wire: int64
   reduce-scatter + fp32 all-gather = 1.5x an fp32 ring all-reduce (plus 1/block_size int8
   exponents, all-reduced).

Memory: the k local micro-batch gradients are kept until step 2 can run (k fp32 copies); with
one micro-batch per rank that is one copy.

Sharded parameters (tensor-parallel shards, FSDP2): with ``block_size=1`` every element is its
own block, so however a parameter is cut, every rank holds whole blocks and the bits do not
depend on the cut (the recipe's choice; `InvariantReduceScatter` is FSDP2's reduce-scatter
made this way).  Larger blocks are a canonical layout of whole (unsharded) parameters only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from samebits._torchutil import group_rank_and_world_size
from samebits.errors import ConfigError, SamebitsError
from samebits.invariant._fixed import (DEFAULT_BLOCK_SIZE, EXPONENT_NONFINITE, decode_into, encode_sum, fraction_bits,
                                       max_block_exponents, reduce_here)
from samebits.invariant._preconditions import Preconditions, manual_seed, micro_batch_seed
from samebits.verdicts import ToDict


@dataclass
class ReduceStats(ToDict):
    """What one step's reduction did (the counts are global: equal on every rank at any DP size)."""

    num_elements: int = 0
    num_blocks: int = 0
    fraction_bits: int = 0
    inexact_elements: int = 0  # encoded with lost low bits (values far below their block maximum)
    nonfinite_blocks: int = 0  # blocks holding inf/nan on some rank: reduced to nan
    bytes_sent: int = 0  # payload bytes this rank handed to collectives (ring-equivalent, see bytes_on_wire)
    fp32_allreduce_bytes: int = 0  # what a plain fp32 ring all-reduce of the same gradient would send


def ring_bytes(kind: str, num_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring collective over a ``num_bytes`` buffer (the usual cost
    model: all-reduce 2(W-1)/W, reduce-scatter and all-gather (W-1)/W of the buffer)."""
    if world_size == 1:
        return 0
    share = num_bytes * (world_size - 1) // world_size
    return 2 * share if kind == "all_reduce" else share


class _Blocks:
    """The canonical block layout of a list of parameters: each parameter's flattened gradient
    cut into blocks of ``block_size`` (its last block zero-padded), parameters in the given
    order, then zero blocks up to a multiple of the world size (for the reduce-scatter)."""

    def __init__(self, numels: list[int], block_size: int, world_size: int):
        self.numels, self.block_size = numels, block_size
        self.param_blocks = [-(-n // block_size) for n in numels]
        self.num_real_blocks = sum(self.param_blocks)
        self.num_blocks = -(-max(self.num_real_blocks, 1) // world_size) * world_size

    def gather(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """(num_blocks, block_size) fp32 copy of the gradients (None counts as zeros): each
        element written once, the padding zeroed, no pass over the whole buffer first."""
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        out = torch.empty(self.num_blocks, self.block_size, dtype=torch.float32, device=device)
        row = 0
        for grad, numel, nblocks in zip(grads, self.numels, self.param_blocks):
            flat = out[row:row + nblocks].view(-1)
            if grad is None:
                flat.zero_()
            else:
                if grad.dtype != torch.float32:
                    raise ConfigError(f"invariant reduction takes fp32 gradients, got {grad.dtype}: keep "
                                      "fp32 master gradients (reduce before casting)")
                flat[:numel].copy_(grad.detach().reshape(-1))
                if numel < flat.numel():
                    flat[numel:].zero_()
            row += nblocks
        out[row:].zero_()
        return out

    def scatter(self, blocks: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter views (shaped like ``like``, contiguous) into (num_blocks, block_size)
        values: no copy, the caller hands over ``blocks``."""
        out, row = [], 0
        for ref, numel, nblocks in zip(like, self.numels, self.param_blocks):
            out.append(blocks[row:row + nblocks].view(-1)[:numel].view(ref.shape))
            row += nblocks
        return out


def reduce_blocks(micro_batches: list[torch.Tensor], *, num_micro_batches: int, group=None,
                  stats: ReduceStats | None = None, scatter_only: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The invariant SUM over every rank's micro-batches of (num_blocks, block_size) fp32 blocks.

    ``micro_batches`` are this rank's; ``num_micro_batches`` is M, the global count (it sets
    the fraction bits, so it must be the same at every DP size).  Returns the reduced fp32
    blocks, the same bits on every rank and at every DP size; ``scatter_only``: only this
    rank's share, rows [rank * n / W, (rank + 1) * n / W) (a reduce-scatter, no all-gather).
    ``out``: where to write that result (fp32, contiguous, its shape), else a new tensor.
    On the CPU the passes are the C library's (`_fixed.encode_sum` and friends: one pass each;
    `_fixed.reduce_here`'s one fused pass where a rank holds every contribution to its rows).
    """
    rank, world_size = group_rank_and_world_size(group)
    if not micro_batches:
        raise ConfigError(f"rank {rank}: no micro-batch gradient to reduce (call accumulate() after "
                          "each micro-batch's backward)")
    bits = fraction_bits(num_micro_batches)
    num_blocks, block_size = micro_batches[0].shape
    if world_size > 1 and num_blocks % world_size:
        raise ConfigError(f"rank {rank}: {num_blocks} blocks do not split over {world_size} ranks; pad the "
                          "buffer to a multiple of the group size")
    device = micro_batches[0].device  # NCCL needs the collectives' tensors on the GPU
    shard_blocks = num_blocks // world_size
    mine = slice(rank * shard_blocks, (rank + 1) * shard_blocks)
    shape = (num_blocks if not scatter_only else shard_blocks, block_size)
    if out is not None and (out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ConfigError(f"reduce_blocks: out must be a contiguous fp32 tensor of shape {shape}, got "
                          f"{out.dtype} {tuple(out.shape)}")
    reduced = torch.empty(shape, dtype=torch.float32, device=device) if out is None else out
    decoded = reduced if scatter_only or world_size == 1 else reduced[mine]
    # gloo has no reduce-scatter of its own (it all-reduces the whole buffer: twice the bytes)
    # and runs each collective in several rounds: here it gets one round of direct sends each.
    gloo = world_size > 1 and dist.get_backend(group) == "gloo"
    raw = gloo and len(micro_batches) <= 2  # fp32 inputs to their owner: no more bytes than int64 sums
    if raw:
        counts = _owner_reduce_scatter(micro_batches, bits, rank, world_size, group, decoded)
    elif world_size == 1:
        inexact, nonfinite = reduce_here(micro_batches, bits, out=decoded)
    else:
        exps = max_block_exponents(micro_batches)
        if gloo:  # the counts of this rank's rows: summed over the ranks below
            exps = _exchange_max(exps, rank, world_size, group)
            counts = (_exchange_reduce_scatter(micro_batches, exps, bits, rank, world_size, group, decoded),
                      int((exps[mine] == EXPONENT_NONFINITE).sum()))
        else:
            dist.all_reduce(exps, op=dist.ReduceOp.MAX, group=group)  # exact: a max of integers
            inexact = _nccl_reduce_scatter(micro_batches, exps, bits, group, decoded, mine, stats is not None)
        nonfinite = int((exps == EXPONENT_NONFINITE).sum()) if stats is not None else 0
    if gloo:  # the all-gather and the counts' sum in one round
        inexact, nonfinite = _exchange_all_gather(None if scatter_only else reduced, counts, rank, world_size, group)
    elif world_size > 1 and not scatter_only:  # the input is the output's own slice: no copy
        dist.all_gather_into_tensor(reduced, decoded, group=group)
    if stats is not None:
        element_bytes = num_blocks * block_size
        stats.num_elements += element_bytes
        stats.num_blocks += num_blocks
        stats.fraction_bits = bits
        stats.inexact_elements += inexact
        stats.nonfinite_blocks += nonfinite
        stats.bytes_sent += ((ring_bytes("reduce_scatter", 4 * len(micro_batches) * element_bytes, world_size) if raw
                              else ring_bytes("all_reduce", num_blocks, world_size)  # int8 exponents
                              + ring_bytes("reduce_scatter", 8 * element_bytes, world_size))
                             + (0 if scatter_only else ring_bytes("all_gather", 4 * element_bytes, world_size)))
        stats.fp32_allreduce_bytes += ring_bytes("all_reduce", 4 * element_bytes, world_size)
    return reduced


_WORKSPACES: dict[tuple, torch.Tensor] = {}
_MAX_WORKSPACES = 16  # one pair per DDP bucket / FSDP group shape; more distinct shapes start over


def _workspace(name: str, shape, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A buffer kept between steps (contents undefined): a fresh one costs its page faults on
    every call, about as long as the encode pass itself on the CPU."""
    key = (name, tuple(shape), str(device), dtype)
    buffer = _WORKSPACES.get(key)
    if buffer is None:
        if len(_WORKSPACES) >= _MAX_WORKSPACES:
            _WORKSPACES.clear()
        buffer = _WORKSPACES[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
    return buffer


def _peers(rank: int, world_size: int) -> list[int]:
    """The other ranks, starting after this one (so that no rank is everybody's first)."""
    return [(rank + i) % world_size for i in range(1, world_size)]


def _nccl_reduce_scatter(micro_batches: list[torch.Tensor], exps: torch.Tensor, bits: int, group,
                         out: torch.Tensor, mine: slice, count: bool) -> int:
    """Encode, the backend's int64 reduce-scatter, decode this rank's rows into ``out``; the
    global inexact count when ``count`` (a host sync), else 0."""
    shape = micro_batches[0].shape
    total, inexact = encode_sum(micro_batches, exps, bits, out=_workspace("total", shape, out.device))
    counts = torch.tensor([inexact], dtype=torch.int64, device=out.device)
    counted = dist.all_reduce(counts, group=group, async_op=True)  # overlaps the rest
    shard = torch.empty(out.shape, dtype=torch.int64, device=out.device)
    dist.reduce_scatter_tensor(shard, total, group=group)  # int64 SUM: exact and associative
    decode_into(shard, exps[mine], bits, out=out)
    counted.wait()
    return int(counts[0]) if count else 0


def _owner_reduce_scatter(micro_batches: list[torch.Tensor], bits: int, rank: int, world_size: int, group,
                          out: torch.Tensor) -> tuple[int, int]:
    """The reduce-scatter for gloo with one or two micro-batches a rank: each rank sends the
    fp32 rows of every micro-batch straight to the rank that owns them (4 or 8 bytes an element,
    no more than the int64 sums, and no exponent round before), and the owner computes what the
    other path computes, on its rows of all M micro-batches: the block exponents (the same MAX),
    the int64 encodings and their sum, the decode into ``out``.  Every bit is the same: an
    exponent is a MAX over the same inputs, an encoding depends on its element and exponent
    only, and int64 sums do not depend on the order.  Returns (inexact elements, non-finite
    blocks) of this rank's rows (`_exchange_all_gather` sums them over the ranks)."""
    rows, k = micro_batches[0].shape[0] // world_size, len(micro_batches)
    block_size, device = micro_batches[0].shape[1], micro_batches[0].device
    received = _workspace("raw", (world_size - 1, k, rows, block_size), device, torch.float32)

    def chunk(c: int) -> slice:
        return slice(c * rows, (c + 1) * rows)

    peers = _peers(rank, world_size)
    works = [dist.irecv(received[i, j], group=group, group_src=peer) for i, peer in enumerate(peers) for j in range(k)]
    works += [dist.isend(blocks[chunk(peer)], group=group, group_dst=peer) for peer in peers for blocks in micro_batches]
    for work in works:
        work.wait()
    mine = [blocks[chunk(rank)] for blocks in micro_batches] + [part for parts in received for part in parts]
    return reduce_here(mine, bits, out=out)


def _exchange_max(exps: torch.Tensor, rank: int, world_size: int, group) -> torch.Tensor:
    """The MAX of every rank's int8 block exponents: each rank sends its own to every other (one
    round); past 1 MiB of exponents at more than 2 ranks (block_size 1 on a large model), where
    that sends more bytes than a ring, gloo's all-reduce instead."""
    if world_size > 2 and exps.numel() > 1 << 20:
        dist.all_reduce(exps, op=dist.ReduceOp.MAX, group=group)
        return exps
    peers = _peers(rank, world_size)
    theirs = torch.empty(len(peers), *exps.shape, dtype=exps.dtype, device=exps.device)
    works = [dist.irecv(theirs[i], group=group, group_src=peer) for i, peer in enumerate(peers)]
    works += [dist.isend(exps, group=group, group_dst=peer) for peer in peers]
    for work in works:
        work.wait()
    return torch.maximum(exps, theirs.amax(dim=0))  # exact: a max of integers, any order


def _exchange_reduce_scatter(micro_batches: list[torch.Tensor], exps: torch.Tensor, bits: int, rank: int,
                             world_size: int, group, out: torch.Tensor) -> int:
    """The int64 reduce-scatter for gloo, whose own all-reduces the whole buffer and keeps a
    slice (twice the bytes): each rank encodes rank p's chunk and sends it to p straight away
    (so the encode overlaps the transfers), receives its own chunk's partial sums from every
    rank, and decodes their sum into ``out`` in one pass.  The bytes a rank sends are a ring's,
    (W - 1) / W of the buffer, in one round instead of W - 1.  Returns this rank's inexact count
    (the global one is the sum over ranks)."""
    rows = micro_batches[0].shape[0] // world_size
    total = _workspace("total", micro_batches[0].shape, micro_batches[0].device)
    received = _workspace("received", (world_size - 1, rows, total.shape[1]), total.device)

    def chunk(c: int) -> slice:
        return slice(c * rows, (c + 1) * rows)

    def encode_chunk(c: int) -> int:
        return encode_sum([blocks[chunk(c)] for blocks in micro_batches], exps[chunk(c)], bits, out=total[chunk(c)])[1]

    peers = _peers(rank, world_size)
    receiving = [dist.irecv(received[i], group=group, group_src=peer) for i, peer in enumerate(peers)]
    sending, inexact = [], 0
    for peer in reversed(peers):  # the rank just before this one gets its chunk first: it is everyone's last
        inexact += encode_chunk(peer)
        sending.append(dist.isend(total[chunk(peer)], group=group, group_dst=peer))
    inexact += encode_chunk(rank)
    for work in receiving:
        work.wait()
    decode_into(total[chunk(rank)], exps[chunk(rank)], bits, out=out, addends=list(received))
    for work in sending:
        work.wait()
    return inexact


def _exchange_all_gather(reduced: torch.Tensor | None, counts: tuple[int, int], rank: int, world_size: int,
                         group) -> tuple[int, int]:
    """All-gather of this rank's rows of ``reduced`` into everyone's (None: none, a reduce-scatter
    only), for gloo: straight sends and receives into the slices (one round, no staging copy),
    with every rank's ``counts`` (inexact elements, non-finite blocks) in the same round;
    returns their sums."""
    peers = _peers(rank, world_size)
    table = torch.tensor([counts] * world_size, dtype=torch.int64)  # [0]: this rank's, [1:]: the peers'
    works = [dist.irecv(table[i + 1], group=group, group_src=peer) for i, peer in enumerate(peers)]
    works += [dist.isend(table[0], group=group, group_dst=peer) for peer in peers]
    if reduced is not None:
        rows = reduced.shape[0] // world_size
        works += [dist.irecv(reduced[peer * rows:(peer + 1) * rows], group=group, group_src=peer) for peer in peers]
        works += [dist.isend(reduced[rank * rows:(rank + 1) * rows], group=group, group_dst=peer) for peer in peers]
    for work in works:
        work.wait()
    inexact, nonfinite = table.sum(dim=0).tolist()
    return inexact, nonfinite


class GradientAccumulator:
    """Invariant gradient accumulation and data-parallel reduction for a hand-written loop.

        acc = GradientAccumulator(model.named_parameters(), num_micro_batches=M, seed=0)
        for step in range(steps):
            for m in acc.micro_batches():                    # this rank's share of the M
                with acc.micro_batch(step, m):               # RNG keyed by (step, m)
                    loss = loss_sum(model, batch(step, m)) / acc.global_count(local_tokens)
                    loss.backward()
                acc.accumulate()                             # keeps this micro-batch's grads
            acc.reduce()                                     # p.grad = invariant sum, every rank
            norm = acc.clip_grad_norm_(1.0)
            optimizer.step(); optimizer.zero_grad()

    ``p.grad`` after `reduce` has the same bits at every data-parallel size (given the
    preconditions, checked at construction from ``rng_key`` and ``loss_normalization``).
    """

    def __init__(self, named_parameters: Iterable, *, num_micro_batches: int, seed: int = 0,
                 micro_batch_size: int | None = None, rng_key: str = "step_micro_batch",
                 loss_normalization: str = "global_tokens", block_size: int = DEFAULT_BLOCK_SIZE,
                 group=None):
        self.rank, self.world_size = group_rank_and_world_size(group)
        Preconditions(num_micro_batches=num_micro_batches, world_size=self.world_size,
                      micro_batch_size=micro_batch_size, rng_key=rng_key,
                      loss_normalization=loss_normalization).check()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size={block_size!r} must be a positive int")
        self.named = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not self.named:
            raise ConfigError("GradientAccumulator got no parameters that require grad")
        self.num_micro_batches, self.seed, self.group = num_micro_batches, seed, group
        # A DTensor parameter (a TP or FSDP2 shard) is reduced as its local shard: with
        # block_size=1 its blocks are whole at any split (module docstring).
        self.layout = _Blocks([_local(p).numel() for _, p in self.named], block_size, self.world_size)
        self._pending: list[torch.Tensor] = []
        self.last_stats: ReduceStats | None = None

    @property
    def num_local_micro_batches(self) -> int:
        return self.num_micro_batches // self.world_size

    def micro_batches(self) -> range:
        """This rank's canonical micro-batch indices: [r * M / W, (r + 1) * M / W)."""
        k = self.num_local_micro_batches
        return range(self.rank * k, (self.rank + 1) * k)

    @contextlib.contextmanager
    def micro_batch(self, step: int, index: int, generators: Iterable[torch.Generator] = ()):
        """Run one micro-batch with torch's global CPU RNG (and ``generators``) seeded from
        (seed, step, index) alone.  Every state is restored afterwards, so what a rank holds
        after a step does not depend on which micro-batches it ran."""
        seed = micro_batch_seed(self.seed, step, index)
        generators = list(generators)
        saved = [g.get_state() for g in generators]
        try:
            # torch.manual_seed seeds the CPU and every CUDA generator; fork the CUDA one in use too.
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=devices):
                manual_seed(seed)
                for offset, generator in enumerate(generators, start=1):
                    generator.manual_seed(micro_batch_seed(self.seed + offset, step, index))
                yield seed
        finally:
            for generator, state in zip(generators, saved):
                generator.set_state(state)

    def global_count(self, local_count) -> int:
        """The sum over ranks of an integer count (tokens, samples): an exact int64 all-reduce.
        Divide each micro-batch's summed loss by this, never by a local mean."""
        device = self.named[0][1].device
        value = torch.tensor([int(local_count)], dtype=torch.int64, device=device)
        if self.world_size > 1:
            dist.all_reduce(value, group=self.group)
        return int(value[0])

    def accumulate(self) -> None:
        """Take this micro-batch's gradients (``p.grad``) into the step and clear them."""
        if len(self._pending) >= self.num_local_micro_batches:
            raise SamebitsError(f"rank {self.rank}: accumulate() called {len(self._pending) + 1} times in one "
                                f"step, but this rank takes {self.num_local_micro_batches} of the "
                                f"{self.num_micro_batches} micro-batches; call reduce() after the last one")
        self._pending.append(self.layout.gather([None if p.grad is None else _local(p.grad) for _, p in self.named]))
        for _, p in self.named:
            p.grad = None

    def reduce(self) -> ReduceStats:
        """Reduce the step's micro-batches over every rank into ``p.grad`` (fp32, same bits on
        every rank and at every DP size); returns this step's `ReduceStats`."""
        if len(self._pending) != self.num_local_micro_batches:
            raise SamebitsError(f"rank {self.rank}: reduce() after {len(self._pending)} micro-batches, but this "
                                f"rank takes {self.num_local_micro_batches} of the {self.num_micro_batches} "
                                "(a rank that skips one would make every rank wait or sum the wrong set)")
        stats = ReduceStats()
        reduced = reduce_blocks(self._pending, num_micro_batches=self.num_micro_batches, group=self.group,
                                stats=stats)
        self._pending = []
        params = [p for _, p in self.named]
        for p, grad in zip(params, self.layout.scatter(reduced, [_local(p) for p in params])):
            grad = grad.to(_local(p).device)
            p.grad = grad if not isinstance(p, DTensor) else DTensor.from_local(
                grad, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        self.last_stats = stats
        return stats

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """`canonical_grad_norm` of the reduced gradients, then scale them by
        min(1, max_norm / (norm + 1e-6)) (max_norm 0: report only).  Returns the fp32 norm."""
        return clip_grad_norm_([p for _, p in self.named], max_norm)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor, as a plain tensor sharing storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class InvariantReduceScatter:
    """FSDP2's gradient reduce-scatter made invariant: every element its own block (so FSDP2's
    flat buffer, whatever its padding and order, is cut into whole blocks at any shard count),
    the int64 fixed point of `reduce_blocks`, and only this rank's shard decoded.

        for module in fsdp_modules:                      # each fully_shard'ed module
            module.set_custom_reduce_scatter(InvariantReduceScatter(num_micro_batches=M))
            module.set_gradient_divide_factor(1.0)       # a SUM: divide the loss by the global count

    Run a rank's k = M / W backwards of a step with gradient sync on (FSDP2's default): on the
    first k - 1 it keeps FSDP2's buffer and hands back zeros (FSDP2 adds them to the sharded
    gradient: 0 + g = g, exactly), on the k-th it reduces all M micro-batches.  One instance
    per module (per FSDP2 parameter group)."""

    def __init__(self, num_micro_batches: int, group=None):
        _, world_size = group_rank_and_world_size(group)
        Preconditions(num_micro_batches=num_micro_batches, world_size=world_size).check()
        self.num_micro_batches = num_micro_batches
        self.num_local_micro_batches = num_micro_batches // world_size
        self.last_stats = ReduceStats()
        self._pending: list[torch.Tensor] = []

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op=None,
                 async_op: bool = False):
        if op is not None and op == dist.ReduceOp.AVG:
            raise ConfigError("InvariantReduceScatter sums, but FSDP2 asked for an average: call "
                              "module.set_gradient_divide_factor(1.0) on every fully_shard'ed module and "
                              "divide the loss by the global count (GradientAccumulator.global_count)")
        if input_tensor.dtype != torch.float32:
            raise ConfigError(f"InvariantReduceScatter takes fp32 gradients, got {input_tensor.dtype}: keep "
                              "FSDP2's reduce_dtype fp32 (MixedPrecisionPolicy(reduce_dtype=torch.float32))")
        flat = input_tensor.detach().reshape(-1, 1)
        last = len(self._pending) + 1 == self.num_local_micro_batches
        self._pending.append(flat if last else flat.clone())  # FSDP2's buffer outlives this call only
        if not last:
            output_tensor.zero_()
            return None
        stats = ReduceStats()
        direct = output_tensor.dtype == torch.float32 and output_tensor.is_contiguous()
        shard = reduce_blocks(self._pending, num_micro_batches=self.num_micro_batches, group=group,
                              stats=stats, scatter_only=True, out=output_tensor.view(-1, 1) if direct else None)
        self._pending = []
        self.last_stats = stats
        if not direct:
            output_tensor.copy_(shard.reshape(-1))
        return None


def canonical_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` in one fixed order: each tensor's squares summed in fp64 in
    blocks of 256 (one row each), the blocks' sums then added sequentially in fp64 (cumsum)
    over every tensor in order.  The same bits for the same gradients at any DP size."""
    partials = []
    for grad in grads:
        flat = grad.detach().reshape(-1).to(torch.float64)
        pad = (-flat.numel()) % DEFAULT_BLOCK_SIZE
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        partials.append(flat.view(-1, DEFAULT_BLOCK_SIZE).square().sum(dim=1))
    if not partials:
        return torch.zeros((), dtype=torch.float32)
    total = torch.cumsum(torch.cat(partials), dim=0)[-1]  # a sequential sum: a canonical order
    return total.sqrt().to(torch.float32)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` by their `canonical_grad_norm`; returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = canonical_grad_norm(grads)
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coeff.to(grad.device))
    return norm


@dataclass
class InvariantHookState:
    """State of `invariant_comm_hook`: ``num_micro_batches`` (M, global) and the micro-batches
    this rank runs per step (M / W: DDP's backward is called that many times per step, without
    ``no_sync``).  Register with ``ddp_model.register_comm_hook(state, invariant_comm_hook)``."""

    num_micro_batches: int
    group: object = None
    last_stats: ReduceStats = field(default_factory=ReduceStats)
    _pending: dict = field(default_factory=dict)  # (data_ptr, numel) of a parameter -> its kept gradients
    _fresh: bool = True

    def __post_init__(self):
        _, world_size = group_rank_and_world_size(self.group)
        Preconditions(num_micro_batches=self.num_micro_batches, world_size=world_size).check()
        self.num_local_micro_batches = self.num_micro_batches // world_size


def invariant_comm_hook(state: InvariantHookState, bucket) -> torch.futures.Future:
    """A DDP communication hook that reduces each bucket invariantly.  Blocks are cut per
    parameter (not per bucket), so DDP's bucketing does not change the bits.  On a rank's
    first k - 1 backwards of a step it keeps the bucket's gradients and returns zeros (DDP
    writes them to ``p.grad``, which the next backward adds to: 0 + g = g, exactly); on the
    k-th it reduces all M micro-batches and returns the sum."""
    grads = bucket.gradients()
    layout = _Blocks([g.numel() for g in grads], DEFAULT_BLOCK_SIZE, group_rank_and_world_size(state.group)[1])
    # Kept per parameter: DDP rebuilds its buckets after the first iteration (other members,
    # other order), and the Python objects of bucket.parameters() are new on every call.
    keys = [(p.data_ptr(), p.numel()) for p in bucket.parameters()]
    # The last micro-batch's gradients are read (by `gather`) before the hook returns: no copy.
    last = len(state._pending.get(keys[0], [])) + 1 >= state.num_local_micro_batches
    for key, grad in zip(keys, grads):
        state._pending.setdefault(key, []).append(grad.detach().reshape(-1) if last else grad.detach().reshape(-1).clone())
    buffer = bucket.buffer()
    future = torch.futures.Future()
    if len(state._pending[keys[0]]) < state.num_local_micro_batches:
        future.set_result(torch.zeros_like(buffer))
        return future
    per_param = [state._pending.pop(key) for key in keys]
    kept = [layout.gather([flats[i] for flats in per_param]) for i in range(state.num_local_micro_batches)]
    if state._fresh:  # the first bucket reduced in this step
        state.last_stats, state._fresh = ReduceStats(), False
    reduced = reduce_blocks(kept, num_micro_batches=state.num_micro_batches, group=state.group,
                            stats=state.last_stats)
    state._fresh = not state._pending  # every bucket of the step reduced: the next one starts a step
    out = buffer.clone()
    for view, grad in zip(grads, layout.scatter(reduced, grads)):
        offset = view.storage_offset() - buffer.storage_offset()  # where DDP keeps it in the bucket
        out[offset:offset + grad.numel()].copy_(grad.reshape(-1))
    future.set_result(out)
    return future


# DDP checks the hook's return annotation as an object (a string, as `from __future__ import
# annotations` makes it, is refused).
invariant_comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


__all__ = ["GradientAccumulator", "ReduceStats", "reduce_blocks", "canonical_grad_norm", "clip_grad_norm_",
           "InvariantHookState", "invariant_comm_hook", "InvariantReduceScatter", "ring_bytes"]
