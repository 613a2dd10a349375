"""Rerun-based fault classification: is a suspicious step a hardware fault, nondeterminism, or
simply what the code computes?  (docs/rerun.md)

`StepValidator` keeps what a step needs to run again; after a suspicious step (NaN/inf loss, a
spike, ``check``, or every ``every`` steps) it restores, reruns and compares digests:
REPRODUCIBLE, TRANSIENT_FAULT (a third run equals one of two) or NONDETERMINISTIC.  Under
torch.distributed every rank calls `run` every step: the decisions are agreed over the group.
"""

from __future__ import annotations

import copy
import enum
import math
import struct
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from samebits import settings
from samebits._torchutil import group_rank_and_world_size, int_view
from samebits.checkpoint import capture_rng_state, restore_rng_state
from samebits.errors import ConfigError
from samebits.fingerprint import digest_many
from samebits.stream import Recorder
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_OK, EXIT_RERUN_ELSEWHERE, ToDict

FLIP_ENV = "SAMEBITS_TEST_FLIP"


class RerunVerdict(str, enum.Enum):
    """What re-executing a step showed."""

    REPRODUCIBLE = "reproducible"  # the rerun gave the same bits
    TRANSIENT_FAULT = "transient_fault"  # one execution differed, two agreed: a one-off fault
    NONDETERMINISTIC = "nondeterministic"  # three executions, three results

    @property
    def code(self) -> int:  # as recorded in the stream (metric rerun/verdict)
        return list(RerunVerdict).index(self)

    def __str__(self) -> str:
        return self.value


@dataclass
class RerunResult(ToDict):
    """One validated step: why it was validated, what the reruns showed, what to do."""

    step: int
    rank: int
    verdict: RerunVerdict
    trigger: str  # "every", "nan", "spike", "check"
    roots: list[str]  # the digest root of each execution (hex), first run first
    faulty: str | None = None  # "first run" / "rerun 1" for a transient fault
    exit_code: int = EXIT_OK

    @property
    def message(self) -> str:
        where = f"step {self.step} on rank {self.rank} (validated: {self.trigger})"
        if self.verdict is RerunVerdict.REPRODUCIBLE:
            text = f"{where}: reproducible: the rerun gave the same bits; the value is what this code computes on this data"
            if self.exit_code == EXIT_RERUN_ELSEWHERE:
                text += (" here. A check failed, and a fault that repeats on this hardware would look the same: run "
                         f"the step on other hardware (exit code {EXIT_RERUN_ELSEWHERE})")
            return text
        if self.verdict is RerunVerdict.TRANSIENT_FAULT:
            return (f"{where}: transient fault in the {self.faulty}: two of three executions agree bit for bit; "
                    f"the training continues with their result. Suspect the hardware (exit code {self.exit_code})")
        return (f"{where}: nondeterministic step: three executions, three different results. A determinism bug, "
                "not hardware: narrow it with `samebits bisect --nondeterministic`")

    def dict_extras(self) -> dict:
        return {"message": self.message}


@dataclass(frozen=True)
class FaultSpec:
    """A planted fault (a test hook): flip one bit of the first output of the ``call``-th
    call of aten op ``op`` on ``rank`` at ``step``, once (first execution) or always."""

    step: int
    rank: int
    op: str
    mode: str = "once"
    call: int = 0
    bit: int = 20  # a mantissa bit of a float32: visible, never a NaN

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        fields = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"{FLIP_ENV}={text!r}: write step=S,rank=R,op=OP[,mode=once|always][,call=N]")
            fields[key.strip()] = value.strip()
        try:
            spec = cls(step=int(fields.pop("step")), rank=int(fields.pop("rank")), op=fields.pop("op"),
                       mode=fields.pop("mode", "once"), call=int(fields.pop("call", 0)))
        except (KeyError, ValueError):
            raise ConfigError(f"{FLIP_ENV}={text!r}: step, rank and op are required (step and rank integers): "
                              "e.g. step=3,rank=0,op=mm,mode=once") from None
        if fields:
            raise ConfigError(f"{FLIP_ENV}={text!r}: unknown field(s) {sorted(fields)}")
        if spec.mode not in ("once", "always"):
            raise ConfigError(f"{FLIP_ENV}={text!r}: mode is once (a transient fault) or always (a persistent one)")
        return spec


class _FlipMode(TorchDispatchMode):
    """Flips one bit of the chosen op call's first floating-point output."""

    def __init__(self, spec: FaultSpec):
        super().__init__()
        self.spec, self.calls, self.flipped = spec, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.flipped or self.spec.op not in (name, f"aten.{name}", str(func)):
            return out
        if self.calls == self.spec.call:
            first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
            if first is not None and first.is_floating_point() and first.numel():
                word = int_view(first.detach()[(0,) * first.dim()])  # a view: reshape copies a strided output
                word.bitwise_xor_(1 << min(self.spec.bit, 8 * first.element_size() - 2))
                self.flipped = True
        self.calls += 1
        return out


class StepValidator:
    """Keeps each step re-executable and classifies the steps it validates; ``stateful``: more
    objects the step changes, with ``state_dict``/``load_state_dict`` (LR schedulers, scalers)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 every: int | None = None, check: Callable[[int, Any], bool] | None = None,
                 spike_sigma: float | None = None, spike_warmup: int = 10, stateful: Sequence[Any] = (),
                 recorder: Recorder | None = None, on_verdict: Callable[[RerunResult], None] | None = None,
                 group=None, fault: FaultSpec | None = None):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError(f"StepValidator(every={every!r}): give a positive number of steps, or None.")
        if spike_sigma is not None and not spike_sigma > 0:
            raise ConfigError(f"StepValidator(spike_sigma={spike_sigma!r}): give a positive number of deviations.")
        self.model, self.optimizer, self.stateful = model, optimizer, list(stateful)
        self.every, self.check, self.spike_sigma, self.spike_warmup = every, check, spike_sigma, spike_warmup
        self.recorder, self.on_verdict, self.group = recorder, on_verdict, group
        text = settings.read(FLIP_ENV)
        self.fault = fault if fault is not None else (FaultSpec.parse(text) if text else None)
        self.rank = group_rank_and_world_size(group)[0]
        self.results: list[RerunResult] = []
        self.last: RerunResult | None = None
        self._mean = self._var = 0.0
        self._seen = 0

    # -- the step -------------------------------------------------------------------------

    def run(self, step: int, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn(*args, **kwargs)`` as step ``step``, validated when a trigger fires; its result."""
        self.last = None
        snapshot = self._snapshot(args, kwargs)
        out = self._execute(step, 0, fn, args, kwargs)
        loss = _loss_value(out)
        trigger = self._trigger(step, loss)
        if trigger is None:
            return out
        roots = [self._root(out)]
        verdict, faulty = None, None
        for attempt in (1, 2):
            self._restore(snapshot)
            rerun_args, rerun_kwargs = tree_map(_clone, snapshot["args"])
            out = self._execute(step, attempt, fn, rerun_args, rerun_kwargs)
            roots.append(self._root(out))
            if attempt == 1 and not self._any(roots[1] != roots[0]):
                verdict = RerunVerdict.REPRODUCIBLE
                break
        if verdict is None:
            first, rerun, again = roots
            if again == rerun:
                verdict, faulty = RerunVerdict.TRANSIENT_FAULT, "first run"
            elif again == first:
                verdict, faulty = RerunVerdict.TRANSIENT_FAULT, "rerun 1"
            else:
                verdict = RerunVerdict.NONDETERMINISTIC
        exit_code = EXIT_OK
        if verdict is RerunVerdict.TRANSIENT_FAULT or (verdict is RerunVerdict.REPRODUCIBLE and trigger != "every"):
            exit_code = EXIT_RERUN_ELSEWHERE
        elif verdict is RerunVerdict.NONDETERMINISTIC:
            exit_code = EXIT_BAD_VERDICT
        result = RerunResult(step, self.rank, verdict, trigger, [f"{r:016x}" for r in roots], faulty, exit_code)
        self.results.append(result)
        self.last = result
        if self.recorder is not None:
            self.recorder.metrics(step, phase="rerun", verdict=verdict.code, attempts=len(roots) - 1)
        if self.on_verdict is not None:
            self.on_verdict(result)
        return out

    def _execute(self, step, attempt, fn, args, kwargs):
        fault = self.fault
        if fault is not None and fault.step == step and fault.rank == self.rank and (
                fault.mode == "always" or attempt == 0):
            with _FlipMode(fault):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def _trigger(self, step: int, loss: float | None) -> str | None:
        """Why this step is validated (agreed over the group), or None."""
        reason = 0
        if loss is not None and not math.isfinite(loss):
            reason = 1
        elif self.check is not None and self.check(step, loss):
            reason = 3
        elif loss is not None and self.spike_sigma is not None:
            if self._seen >= self.spike_warmup and abs(loss - self._mean) > self.spike_sigma * math.sqrt(self._var):
                reason = 2
        if loss is not None and math.isfinite(loss) and reason != 2:
            self._update_statistic(loss)
        reason = self._max(reason)  # a NaN on one rank makes every rank rerun (no-op without a group)
        if reason:
            return {1: "nan", 2: "spike", 3: "check"}[reason]
        if self.every is not None and step % self.every == 0:
            return "every"
        return None

    def _update_statistic(self, loss: float) -> None:
        """Welford's running mean and variance of the finite losses (spikes left out)."""
        self._seen += 1
        delta = loss - self._mean
        self._mean += delta / self._seen
        self._var += (delta * (loss - self._mean) - self._var) / self._seen

    # -- state ----------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        """What a step's result is: parameters, buffers, optimizer state tensors."""
        tensors = [p.detach() for p in self.model.parameters()] + [b for b in self.model.buffers()]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors += [v for _, v in sorted(state.items(), key=lambda kv: str(kv[0])) if torch.is_tensor(v)]
        return tensors

    def _root(self, out) -> int:
        leaves = [t.detach() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        digests = digest_many(leaves + self._tensors())
        return int.from_bytes(hashlib.sha256(struct.pack(f"<{len(digests)}Q", *digests)).digest()[:8], "little")

    def _snapshot(self, args, kwargs) -> dict:
        params = list(self.model.parameters())
        snap = {
            "params": [p.detach().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
            "buffers": [b.clone() for b in self.model.buffers()],
            "rng": capture_rng_state(),
            "stateful": [copy.deepcopy(obj.state_dict()) for obj in self.stateful],
            "args": tree_map(_clone, (args, kwargs)),
        }
        if self.optimizer is not None:
            opt = self.optimizer
            snap["opt_state"] = {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()}
            snap["opt_groups"] = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                                  for g in opt.param_groups]
        return snap

    def _restore(self, snap: dict) -> None:
        with torch.no_grad():
            for p, saved, grad in zip(self.model.parameters(), snap["params"], snap["grads"]):
                p.copy_(saved)
                p.grad = None if grad is None else grad.clone()
            for b, saved in zip(self.model.buffers(), snap["buffers"]):
                b.copy_(saved)
        if self.optimizer is not None:
            opt = self.optimizer
            opt.state.clear()
            for p, s in snap["opt_state"].items():
                opt.state[p] = {k: _clone(v) for k, v in s.items()}
            for group, saved in zip(opt.param_groups, snap["opt_groups"]):
                group.update(copy.deepcopy(saved))
        for obj, saved in zip(self.stateful, snap["stateful"]):
            obj.load_state_dict(copy.deepcopy(saved))
        restore_rng_state(snap["rng"])

    # -- agreement over the group ---------------------------------------------------------

    def _max(self, value: int) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return value
        flag = torch.tensor([value], dtype=torch.int64,
                            device="cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def _any(self, condition: bool) -> bool:
        return bool(self._max(int(condition)))


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _loss_value(out) -> float | None:
    """The step's loss, when it returned one (a scalar tensor or a number, or first of a tuple)."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return float(out.detach().float().item())
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return float(out)
    return None


__all__ = ["StepValidator", "RerunVerdict", "RerunResult", "FaultSpec", "FLIP_ENV", "EXIT_RERUN_ELSEWHERE"]
