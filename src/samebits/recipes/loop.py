"""The training loop of the reference recipe: `train(config, steps=...) -> TrainResult`.

Each step runs the same phases in the same order: data, forward and losses, backward with
DP reduction and clipping, update; a recorder (duck-typed, see docs/recipe.md) sees each
phase.  The command line around it is `python -m samebits.recipes` (recipes/cli.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from samebits.errors import ConfigError
from samebits import checkpoint, trace
from samebits.stream import phases
from samebits.determinism import derive_seed, deterministic_mode, seed_all
from samebits.invariant import GradientAccumulator
from samebits.recipes import communication, parallelize
from samebits.recipes.cells import AXES, ParallelDims
from samebits.recipes.config import RecipeConfig
from samebits.recipes.data import Batches, build_token_source
from samebits.recipes.model import ModelOutput, Transformer
from samebits.recipes.optim import build_optimizer
from samebits.recipes.precision import apply_precision

JITTER_GENERATOR = "router_jitter"


@dataclass
class TrainResult:
    """What one call of `train` did on this rank."""

    start_step: int  # first step run (0, or the resumed step)
    end_step: int  # next step to run: steps, the save step, or stopped_at + 1
    metrics: list[dict[str, float]] = field(default_factory=list)  # per step run, this rank
    stopped_at: int | None = None  # step that diverged from the reference run
    checkpoint: Path | None = None  # directory saved by save_at (its first step)
    checkpoints: list[Path] = field(default_factory=list)  # every directory saved, in step order
    layout_change: dict[str, Any] | None = None  # a resume under another layout: from, to (StateBundle)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # final local parameters


def train(config: RecipeConfig, *, steps: int, recorder: Any = None, census: Any = None,
          save_at: int | Sequence[int] | None = None, ckpt_dir: str | Path | None = None,
          resume_from: str | Path | None = None,
          allow_layout_change: bool = False, keep_going: bool = False, log: bool = False) -> TrainResult:
    """Run optimizer steps [start, steps) on this rank; start is 0 or the resumed step.

    `save_at=K` saves to `ckpt_dir` before step K and returns (``keep_going``: trains on;
    several steps need it).  `recorder` (duck-typed, docs/recipe.md): when its `end_step`
    returns False on any rank, every rank stops.  `census` defaults to the census stream beside
    a samebits Recorder's.  `allow_layout_change`: resume a checkpoint of another DP or TP size
    where the bits do not depend on it (`_Run._check_layout_change`).
    """
    saves = _save_steps(save_at)
    if saves and (ckpt_dir is None or not all(0 <= k <= steps for k in saves)):
        raise ConfigError(f"save_at={save_at} needs ckpt_dir and 0 <= save_at <= steps={steps}")
    if len(saves) > 1 and not keep_going:
        raise ConfigError(f"save_at={save_at}: saving at several steps needs keep_going (the run trains on "
                          "after each save)")
    with session(config) as (rank, world_size):
        run = _Run(config, rank, world_size)
        if resume_from is not None:
            run.resume(resume_from, allow_layout_change=allow_layout_change)
        opened = census is None
        if opened:
            census = checkpoint.census_recorder(recorder, append=resume_from is not None)
        try:
            return run.loop(steps, recorder=recorder, census=census, save_at=saves, ckpt_dir=ckpt_dir,
                            keep_going=keep_going, log=log and rank == 0)
        finally:
            if opened and census is not None:
                census.close()


@contextlib.contextmanager
def session(cfg: RecipeConfig):
    """The process settings of a run, undone on exit: the torchrun group, then deterministic
    mode or just the thread count; yields (rank, world_size).  A caller that builds something
    under them first (the CLI's Recorder) opens one around `train`, which nests inside.
    """
    rank, world_size, created = communication.init_process_group(cfg.device)
    try:
        # The layout must fit the world (a ConfigError naming the sizes before anything runs).
        coordinates = ParallelDims.resolve(cfg, world_size).coordinates(rank)
        if cfg.deterministic:
            # Fails closed with every violation at once (config rules included), then pins
            # the thread count, torch flags and environment, and publishes its record.
            with deterministic_mode(seed=cfg.seed, num_threads=cfg.num_threads, coordinates=coordinates,
                                    config=cfg.to_dict()):
                yield rank, world_size
            return
        threads = torch.get_num_threads()
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(cfg.num_threads)
        torch.use_deterministic_algorithms(False)
        try:
            yield rank, world_size
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
    finally:
        if created:
            dist.destroy_process_group()


class _Run:
    """Everything one rank trains with, built identically for a fresh and a resumed run."""

    def __init__(self, cfg: RecipeConfig, rank: int, world_size: int):
        self.cfg, self.rank = cfg, rank
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device; use device=cpu")
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" \
            else torch.device("cpu")
        model = Transformer(cfg)
        # Initialised on the CPU from one generator: the same weights on every rank and device.
        model.init_weights(torch.Generator().manual_seed(derive_seed(cfg.seed, purpose="init")))
        # Low-precision linears replace nn.Linear before parallelising (as torchtitan converts
        # before it shards), so the same initial weights are rounded on every layout.
        self.precision = apply_precision(model, cfg.precision, cfg.precision_gemm, device=cfg.device,
                                         history_len=cfg.fp8_amax_history_len,
                                         save_history=cfg.fp8_save_amax_history)
        self.layout = parallelize.parallelize(model, cfg, rank, world_size, device)
        self.model = model.to(device).train()
        # Training randomness differs per data-parallel replica (the seed rule) and is the same
        # on a replica's TP ranks and stages, whose activations must match: dropout draws from
        # the global torch RNG, router jitter from the recipe's own generator.
        coordinates = self.layout.dims.coordinates(rank)
        replica = {"dp": coordinates["dp"]}  # not "tp" or "pp": the same on a replica's ranks
        seed_all(derive_seed(cfg.seed, purpose="data", coordinates=replica))
        torch.manual_seed(derive_seed(cfg.seed, purpose="dropout", coordinates=replica))
        self.jitter = torch.Generator(device).manual_seed(
            derive_seed(cfg.seed, purpose="expert", coordinates={**replica, "ep": coordinates["ep"]}))
        for moe in model.moe_layers():
            moe.jitter_generator = self.jitter
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        # Every rank of a replica (TP ranks, pipeline stages) reads the replica's micro-batch.
        self.data = Batches(build_token_source(cfg), cfg.micro_batch_size, coordinates["dp"],
                            self.layout.dims.dp)
        # grad_reduce="invariant": this DP rank takes its share of the step's micro-batches in
        # order (docs/invariance.md); each element is its own block, so shards hold whole blocks
        # (under FSDP2 its reduce-scatter, `InvariantReduceScatter`, sums them instead).
        experts = self.layout.expert_param_names
        self.accumulator = GradientAccumulator(
            [(n, p) for n, p in model.named_parameters() if n not in experts],
            num_micro_batches=cfg.num_micro_batches, seed=cfg.seed, micro_batch_size=cfg.micro_batch_size,
            block_size=1, group=self.layout.dp_group) if cfg.grad_reduce == "invariant" else None
        # Under EP the expert shards' gradients are kept per micro-batch by their owner.
        self.expert_grads = communication.InvariantExpertGradients(model, cfg.num_micro_batches, self.layout.dims.ep) \
            if self.accumulator is not None and experts else None
        # The parameters the optimizer updates, walked once: the records of every step list
        # them (a walk of the module tree costs about as much as digesting the tiny recipe).
        # Nothing replaces a parameter after this point (a resume loads into them in place).
        self.named_params = list(model.named_parameters())
        self.step = 0
        self.layout_change: dict[str, Any] | None = None  # set by a resume under another layout

    def bundle(self) -> checkpoint.StateBundle:
        # DTensor shards (TP, FSDP2) go through views that save each rank's local shard, with
        # its place in the global tensor (a load at another TP size cuts its shard from them).
        sharded = parallelize.sharded_names(self.model)
        model = parallelize.LocalShardsModel(self.model) if sharded else self.model
        optimizer = parallelize.LocalShardsOptimizer(self.optimizer) if sharded \
            else self.optimizer
        return checkpoint.StateBundle(
            model=model, optimizer=optimizer, lr_scheduler=self.scheduler,
            progress={"step": self.step, **self.data.state_dict()},
            generators={JITTER_GENERATOR: self.jitter},
            layout=self.layout.checkpoint_layout,
            rank_local=self.layout.expert_param_names | sharded
            | self.precision.rank_local_names,
            shards=_shard_places(self.model),
            metadata={"config": self.cfg.to_dict()},
            # the layout's own fields differ between layouts by design: not resumable state
            layout_metadata=tuple(f"config.{field}" for field in LAYOUT_FIELDS),
        )

    def resume(self, path: str | Path, *, allow_layout_change: bool = False) -> None:
        bundle = self.bundle()
        reseeded_rng = False
        if allow_layout_change:
            saved = checkpoint.saved_layout(path)
            if saved["world_size"] != self.layout.world_size or saved["layout"] != bundle.layout:
                reseeded_rng = self._check_layout_change(path, saved, dict(bundle.layout))
        checkpoint.load(path, bundle, allow_layout_change=allow_layout_change, reseeded_rng=reseeded_rng)
        self.layout_change = bundle.layout_change
        self.step = int(bundle.progress["step"])
        self.data.load_state_dict(bundle.progress)
        saved_config = bundle.metadata.get("config", {})
        ignored = LAYOUT_FIELDS if self.layout_change is not None else ()
        changed = ", ".join(f"{k}: {saved_config.get(k)!r} -> {v!r}" for k, v in sorted(self.cfg.to_dict().items())
                            if saved_config.get(k) != v and k not in ignored)
        if changed and self.layout_change is not None:
            raise ConfigError(f"resuming {path} at another layout with a different config ({changed}): a layout "
                              "change is bitwise only with the saved config; resume with it (only the layout may "
                              "change)")
        if changed and self.rank == 0:
            warnings.warn(f"resuming from {path} with a different config ({changed}); the run will not be bitwise "
                          "equal to an uninterrupted one", stacklevel=3)

    def _check_layout_change(self, path, saved: dict[str, Any], layout: dict[str, int]) -> bool:
        """Refuse a layout change the recipe cannot make bitwise (ConfigError naming the switch
        it needs); returns whether the random states stay live (`checkpoint.load`'s
        reseeded_rng: under grad_reduce=invariant every draw is keyed by (step, micro-batch))."""
        cfg, before = self.cfg, _full_layout(saved["layout"])
        after = _full_layout(layout)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        where = (f"resuming {path} (saved at world_size={saved['world_size']}, layout {saved['layout']}) "
                 f"at world_size={self.layout.world_size}, layout {layout}")
        others = [k for k in changed if k not in ("dp", "dp_shard", "tp", "sequence_parallel")]
        if others:
            raise ConfigError(f"{where} changes {', '.join(others)}: the recipe moves a checkpoint "
                              "only to another DP size, plain or FSDP2 (grad_reduce=invariant), or TP "
                              "size (tp_reduce=invariant), where the bits do not depend on the layout; "
                              "resume at the saved layout")
        dp_changes = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in changed if k in ("dp", "dp_shard"))
        if dp_changes and cfg.grad_reduce != "invariant":
            raise ConfigError(f"{where} changes the DP layout ({dp_changes}), "
                              f"but grad_reduce={cfg.grad_reduce!r} sums gradients in an order that depends "
                              "on it, so the resumed run would differ from the uninterrupted one: "
                              "train and resume with --set grad_reduce=invariant (docs/invariance.md), "
                              "or resume at the saved layout")
        tp_changes = [k for k in changed if k in ("tp", "sequence_parallel")]
        if tp_changes and cfg.tp_reduce != "invariant":
            raise ConfigError(f"{where} changes the TP layout ({', '.join(tp_changes)}), "
                              f"but tp_reduce={cfg.tp_reduce!r} sums the row-parallel products over "
                              "the TP ranks, so the bits depend on it: train and resume with --set "
                              "tp_reduce=invariant (docs/invariance.md), or resume at the saved layout")
        # grad_reduce=invariant seeds every draw from (seed, step, micro-batch) and restores the
        # streams after it: they carry nothing, at any layout.  Else (a TP change alone) the
        # TP ranks of a replica hold the same streams, which the load moves.
        return cfg.grad_reduce == "invariant"

    def loop(self, steps: int, *, recorder, census=None, save_at, ckpt_dir, log: bool,
             keep_going: bool = False) -> TrainResult:
        result = TrainResult(start_step=self.step, end_step=self.step, layout_change=self.layout_change)
        if save_at and save_at[0] < self.step:
            raise ConfigError(f"save_at={save_at[0]} is before the resumed step {self.step}")
        tracer = trace.attach_from_env(self.model, recorder)  # off unless SAMEBITS_TRACE* is set
        while True:
            if self.step in save_at:
                result.checkpoints.append(checkpoint.save(ckpt_dir, self.bundle()))
                result.checkpoint = result.checkpoint or result.checkpoints[-1]
                if not keep_going:
                    break
                if log:
                    print(f"saved {result.checkpoints[-1]} (before step {self.step}); going on", flush=True)
            if self.step >= steps:
                break
            with tracer.step(self.step):  # encloses the whole step, the recorder's end_step too
                self.record_census(census, tracer)
                metrics, ok = self.train_step(recorder)
            result.metrics.append(metrics)
            if log:
                print(_format_line(metrics), flush=True)
            self.step += 1
            if communication.any_rank(ok is False, self.layout):
                result.stopped_at = self.step - 1
                break
        tracer.close()
        result.end_step = self.step
        result.params = {n: communication.local(p.detach()).clone()
                         for n, p in self.model.named_parameters()}
        return result

    def record_census(self, census, tracer) -> None:
        """The state census at the step start into its own stream (names the state a resume did
        not restore); samebits' own work: never traced."""
        step = self.step
        if census is None or not _wanted_phases(census, step)(phases.STATE):
            return
        with tracer.suspended():
            census.tensors(step, phases.STATE, checkpoint.state_census(
                optimizers=[self.optimizer], schedulers=[self.scheduler],
                generators={JITTER_GENERATOR: self.jitter}) + self.precision.state_records())
            census.end_step(step)

    def train_step(self, rec) -> tuple[dict[str, float], bool | None]:
        cfg, step, model = self.cfg, self.step, self.model
        start = time.perf_counter()
        keep = _wanted_phases(rec, step)

        if self.accumulator is not None:
            return self._invariant_step(rec, start, keep)

        # Data: this rank's micro-batch of the global step batch.
        tokens = self.data.next().to(self.layout.device)  # (B, T+1)
        if keep(phases.DATA):
            rec.tensors(step, phases.DATA, [("tokens", tokens)])

        # Forward and losses; through a pipeline, forward and backward of each micro-batch.
        self.optimizer.zero_grad(set_to_none=True)
        with _block_outputs(model, enabled=keep(phases.FORWARD)) as activations, \
                self.precision.autocast(self.layout.device.type):
            if self.layout.pipeline is None:
                output = model(tokens[:, :-1])
                losses, logits = _losses(output, tokens, cfg), output.logits.detach()
            else:
                losses, logits = self._pipeline_step(tokens)
        if keep(phases.FORWARD):
            rec.tensors(step, phases.FORWARD, [*_merge_microbatches(activations),
                                          *([("logits", logits)] if logits is not None else [])])

        # Backward, DP reduction, clipping.
        if self.layout.pipeline is None:
            losses["loss"].backward()
        communication.reduce_gradients(model, self.layout)
        grad_norm = communication.clip_grad_norm(model, self.layout, cfg.grad_clip)
        return self._update(rec, keep, losses, grad_norm, start, per_rank=True)

    def _update(self, rec, keep, losses: dict, grad_norm, start: float, *,
                per_rank: bool = False) -> tuple[dict[str, float], bool | None]:
        """Record the metrics, update, record the update: (the step's metrics, the recorder's
        end_step).  ``per_rank``: the losses are this rank's, the log line shows their mean."""
        step, lr = self.step, self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        losses = {k: v.detach() for k, v in losses.items()}
        if keep(phases.METRICS):
            rec.metrics(step, **losses, grad_norm=grad_norm, lr=lr)
        self.optimizer.step()
        self.scheduler.step()
        ok = self._record_update(rec, keep)
        values = torch.stack(list(losses.values()))
        mean = communication.mean_over_ranks(values, self.layout) if per_rank else values
        metrics = {"step": step, **{k: float(v) for k, v in zip(losses, values)},
                   **{f"mean_{k}": float(v) for k, v in zip(losses, mean)},
                   "grad_norm": float(grad_norm), "lr": lr, "step_time_s": time.perf_counter() - start}
        return metrics, ok

    def _record_update(self, rec, keep) -> bool | None:
        """Record the step's gradients and updated parameters; returns the recorder's end_step."""
        if rec is None:
            return None
        step, named = self.step, self.named_params
        # The gradients, recorded after the update (AdamW never writes them; tests/test_recipe.py
        # checks): next to the parameters, the recording runs in one stretch, in cache (issue 16).
        grads = ([(n, communication.local(g)) for n, p in named if (g := p.grad) is not None]
                 if keep(phases.GRADS) else None)
        # The local params records, then the layout-independent global ones (diff across
        # cells; collective).  Given the parameters themselves: a detached tensor loses the
        # shard attributes (tensor_model_parallel, partition_dim) that make expert shards
        # global.  A samebits.Recorder writes both in one call (an unsharded parameter is
        # digested once for both records); a duck-typed recorder gets the calls one by one.
        step_records = getattr(rec, "optimizer_step", None)
        if step_records is not None:
            with torch.no_grad():
                step_records(step, grads=grads, params=named, whole=(phases.PARAMS,), group=self.layout.expert_group)
            return rec.end_step(step)
        if grads is not None:
            rec.tensors(step, phases.GRADS, grads)
        if keep(phases.PARAMS):
            rec.tensors(step, phases.PARAMS, [(n, communication.local(p.detach())) for n, p in named])
        if hasattr(rec, "global_tensors"):
            with torch.no_grad():
                rec.global_tensors(step, phases.PARAMS, named, group=self.layout.expert_group)
        return rec.end_step(step)

    def _invariant_step(self, rec, start: float, keep) -> tuple[dict[str, float], bool | None]:
        """A step whose bits do not depend on the layout: this DP rank's micro-batches, draws keyed
        by (step, micro-batch, block), each loss divided by the global micro-batch count, gradients
        summed in int64 fixed point (by the accumulator, or FSDP2's reduce-scatter)."""
        cfg, step, model, acc = self.cfg, self.step, self.model, self.accumulator
        fsdp = self.layout.dims.dp_shard > 1  # InvariantReduceScatter sums in each backward
        size, count, first = cfg.micro_batch_size, cfg.num_micro_batches, self.data.consumed_samples
        keys, device = self.layout.block_keys, self.layout.device
        self.optimizer.zero_grad(set_to_none=True)
        names, parts = list(LOSS_NAMES), torch.zeros(count, len(LOSS_NAMES), dtype=torch.float32, device=device)
        batches = {}  # parts: (micro-batch, loss) with each row filled by one rank
        for index in acc.micro_batches():
            samples = np.arange(first + index * size, first + (index + 1) * size)
            batches[index] = torch.from_numpy(self.data.source.tokens(samples)).to(device)
            if keep(phases.DATA):
                rec.tensors(step, phases.DATA, [(f"tokens.mb{index}", batches[index])])
        if self.layout.pipeline is not None:
            self._invariant_pipeline(batches, parts)
        else:
            for position, (index, tokens) in enumerate(batches.items()):
                if fsdp:  # FSDP2 keeps the gathered parameters for the rank's next micro-batch's forward
                    model.set_reshard_after_backward(position == len(batches) - 1)
                with acc.micro_batch(step, index, generators=[self.jitter]), keys.micro_batch(step, index), \
                        self.precision.autocast(device.type):
                    losses = _losses(model(tokens[:, :-1]), tokens, cfg)
                    (losses["loss"] / count).backward()
                if not fsdp:
                    acc.accumulate()
                if self.expert_grads is not None:
                    self.expert_grads.micro_batch_done()
                parts[index] = torch.stack([v.detach().float() for v in losses.values()])
        self.data.consumed_samples = first + count * size
        if not fsdp:
            acc.reduce()
        if self.expert_grads is not None:
            self.expert_grads.reduce()
        grad_norm = communication.clip_grad_norm(model, self.layout, cfg.grad_clip)  # the same at any split
        if self.layout.dp_group is not None:  # a replica's TP ranks and stages hold the same rows
            dist.all_reduce(parts, group=self.layout.dp_group)  # one nonzero row per micro-batch: exact
        losses = dict(zip(names, parts.sum(dim=0) / count))  # the global mean, a fixed order
        return self._update(rec, keep, losses, grad_norm, start)

    def _invariant_pipeline(self, batches: dict[int, torch.Tensor], parts: torch.Tensor) -> None:
        """This DP rank's micro-batches through the pipeline, one pipeline micro-batch each:
        each stage's forward of micro-batch m keyed by (step, m) (`acc.micro_batch`, the
        blocks' `BlockKeys`), the accumulator taking each backward's gradients; the last
        stage's losses (each micro-batch's divided by the global count) in ``parts``'s rows,
        sent to every stage."""
        cfg, step, acc, keys = self.cfg, self.step, self.accumulator, self.layout.block_keys
        indices, count = list(batches), cfg.num_micro_batches
        done = []  # the last stage's loss rows, in pipeline micro-batch order

        def loss_fn(outputs, target):
            mb_logits, balance, *mtp_logits = outputs
            losses = _losses(ModelOutput(mb_logits, list(mtp_logits), balance.reshape(())), target, cfg)
            done.append(torch.stack([v.detach().float() for v in losses.values()]))
            return losses["loss"] / count

        @contextlib.contextmanager
        def keyed(chunk: int):
            with acc.micro_batch(step, indices[chunk], generators=[self.jitter]), \
                    keys.micro_batch(step, indices[chunk]):
                yield

        with self.precision.autocast(self.layout.device.type):
            self.layout.pipeline.run_keyed(torch.cat([batches[i] for i in indices]), loss_fn, keyed,
                                           lambda _chunk: acc.accumulate())
        for chunk, row in enumerate(done):
            parts[indices[chunk]] = row
        self.layout.pipeline.broadcast_from_last(parts)

    def _pipeline_step(self, tokens: torch.Tensor):
        """Forward and backward of every micro-batch through the pipeline: the mean losses (sent
        from the last stage to every stage) and the last stage's logits (None on the others)."""
        parts, logits = [], []
        count = self.cfg.pp_microbatches

        def loss_fn(outputs, target):  # on the last stage, once per micro-batch
            mb_logits, balance, *mtp_logits = outputs
            mb = _losses(ModelOutput(mb_logits, list(mtp_logits), balance.reshape(())),
                         target, self.cfg)
            parts.append(torch.stack([v.detach() for v in mb.values()]))
            logits.append(mb_logits.detach())
            return mb["loss"] / count  # gradients add up over micro-batches: their mean

        self.layout.pipeline.run(tokens, loss_fn)
        mean = torch.stack(parts).mean(dim=0) if parts else torch.zeros(len(LOSS_NAMES))
        mean = self.layout.pipeline.broadcast_from_last(mean.to(self.layout.device))
        return dict(zip(LOSS_NAMES, mean.unbind())), torch.cat(logits) if logits else None


LOSS_NAMES = ("loss", "lm_loss", "load_balancing_loss", "mtp_loss")


def _save_steps(save_at: int | Sequence[int] | None) -> list[int]:
    """The steps to save before, sorted: none, one (an int) or several."""
    if save_at is None:
        return []
    return sorted({int(save_at)} if isinstance(save_at, int) else {int(k) for k in save_at})


# Config fields that name the layout: a resume under another layout may change them.
LAYOUT_FIELDS = (*(axis.field for axis in AXES), "sequence_parallel")


def _full_layout(layout: dict[str, int]) -> dict[str, int]:
    """A checkpoint layout with the sizes it leaves out (1) and sequence_parallel (0) filled."""
    return {"dp_shard": 1, "tp": 1, "pp": 1, "sequence_parallel": 0, **layout}


def _shard_places(model: torch.nn.Module) -> dict[str, checkpoint.TensorShard]:
    """Each DTensor parameter's place in its global tensor, for Shard and Replicate placements
    (FSDP2's strided shards under TP have none and cannot move to another layout)."""
    places = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and all(type(p) in (Shard, Replicate) for p in param.placements):
            (chunk,) = param.__create_chunk_list__()
            places[name] = checkpoint.TensorShard(tuple(param.shape), tuple(chunk.offsets))
    return places


def _wanted_phases(rec, step: int):
    """phase -> whether ``rec`` keeps that phase's records at ``step``, so records it would drop
    are never built; a duck-typed recorder without ``wants`` keeps all."""
    if rec is None:
        return lambda phase: False
    wants = getattr(rec, "wants", None)
    if wants is None:
        return lambda phase: True
    return lambda phase: wants(step, phase)


def _merge_microbatches(activations: list[tuple[str, torch.Tensor]]):
    """One record per block: a pipeline stage sees each block once per micro-batch, and
    those outputs are concatenated along the batch dimension in micro-batch order."""
    merged: dict[str, list[torch.Tensor]] = {}
    for name, value in activations:
        merged.setdefault(name, []).append(value)
    return [(name, values[0] if len(values) == 1 else torch.cat(values))
            for name, values in merged.items()]


def _losses(output: ModelOutput, tokens: torch.Tensor, cfg: RecipeConfig) -> dict:
    """Total, LM, load-balancing and MTP losses (0-dim tensors), in that order."""
    vocab = cfg.vocab_size
    lm = F.cross_entropy(output.logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    mtp = lm.new_zeros(())
    for depth, logits in enumerate(output.mtp_logits, start=1):  # predicts token t+1+depth
        mtp = mtp + F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1 + depth:].reshape(-1))
    if output.mtp_logits:
        mtp = mtp / len(output.mtp_logits)
    balance = output.load_balancing_loss
    total = lm + cfg.moe_aux_loss_coeff * balance + cfg.mtp_loss_coeff * mtp
    return {"loss": total, "lm_loss": lm, "load_balancing_loss": balance, "mtp_loss": mtp}


@contextlib.contextmanager
def _block_outputs(model: Transformer, enabled: bool):
    """Collect (name, detached output) of every block during the forward."""
    captured: list[tuple[str, torch.Tensor]] = []
    handles = []
    if enabled:
        for i, layer in model.layers.items():
            def hook(_module, _inputs, output, name=f"layers.{i}"):
                captured.append((name, output[0].detach()))
            handles.append(layer.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _format_line(m: dict[str, float]) -> str:
    """Rank 0's log line: losses averaged over ranks; the loss's float32 bits in brackets."""
    bits = np.float32(m["mean_loss"]).view(np.uint32)
    return (f"step {m['step']:>5} | loss {m['mean_loss']:.4f} [{bits:08x}] | "
            f"lm {m['mean_lm_loss']:.4f} | lb {m['mean_load_balancing_loss']:.4f} | "
            f"mtp {m['mean_mtp_loss']:.4f} | grad_norm {m['grad_norm']:.4f} | lr {m['lr']:.2e} | "
            f"{1000 * m['step_time_s']:.0f} ms")
