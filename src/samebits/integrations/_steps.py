"""What both callbacks share: one recorder per rank, written once per optimizer step; the
callbacks feed it each step's pieces and say when the step is complete (it never guesses).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from samebits import ConfigError, Recorder, settings
from samebits.autorecord import note
from samebits.stream.optimizer_state import state_tensors
from samebits.stream.phases import LOSS


def zero_code_active() -> bool:
    """True when `samebits run`/`verify` already records this process (zero-code recording)."""
    return bool(settings.read("SAMEBITS_AUTORECORD"))


class StepRecorder:
    """Records one rank's steps.  ``out`` is the run directory (``None``: ``SAMEBITS_DIR``)."""

    def __init__(self, out: str | os.PathLike | None, *, params: bool, grads: bool,
                 optimizer_state: bool, config: dict[str, Any], owner: str):
        if out is None and not settings.read("SAMEBITS_DIR"):
            raise ConfigError(f"{owner}: no run directory: pass out='runs/a' or set SAMEBITS_DIR")
        self.out = None if out is None else Path(out)
        self.params, self.grads, self.optimizer_state = params, grads, optimizer_state
        self.config = config
        self.owner = owner
        self.recorder: Recorder | None = None
        self.step = 0
        self.losses: list[torch.Tensor] = []  # the micro-batch losses of the open step, in order
        self.names: dict[int, str] = {}

    def start(self, model: torch.nn.Module, first_step: int) -> None:
        """Open the stream at ``first_step`` (a resumed run appends to the stream it continues)."""
        self.step = first_step
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.recorder = Recorder(self.out, config=self.config, append=first_step > 0)  # a resumed run appends

    def add_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach().reshape(()).clone())

    def finish_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer just stepped: record the step and close it."""
        rec = self.recorder
        if rec is None:
            return
        step = self.step
        named = [(self.names.get(id(param), f"group{g}.param{i}"), param)
                 for g, group in enumerate(optimizer.param_groups) for i, param in enumerate(group["params"])]
        metrics: dict[str, float] = {}
        if self.losses:
            rec.tensors(step, LOSS, [(f"microbatch{i}", t) for i, t in enumerate(self.losses)])
            metrics["loss"] = math.fsum(float(t) for t in self.losses) / len(self.losses)
        grads = [p.grad for _, p in named if p.grad is not None]
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
            metrics["grad_norm"] = float(torch.linalg.vector_norm(norms))
        for g, group in enumerate(optimizer.param_groups):
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor):
                lr = float(lr)
            if isinstance(lr, (int, float)):
                metrics["lr" if g == 0 else f"lr.group{g}"] = float(lr)
        rec.metrics(step, **metrics)
        state = [pair for n, p in named for pair in state_tensors(optimizer, n, p)] if self.optimizer_state else None
        rec.optimizer_step(step, grads=[(n, p.grad) for n, p in named] if self.grads else None,
                           params=[(n, p.detach()) for n, p in named] if self.params else None, optimizer=state)
        rec.end_step(step)
        self.losses = []
        self.step += 1

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None


def say(owner: str, message: str, *, finding: bool = False, step: int | None = None) -> None:
    """One line on stderr from rank 0; a ``finding`` (it makes the run differ) is also left in the
    recorded run for `samebits verify` (`samebits.autorecord.note`)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"samebits ({owner}): {message}", file=sys.stderr, flush=True)
        if finding:
            note(owner, message, step)


def optimizers_of(value: Any) -> Iterable[torch.optim.Optimizer]:
    """The torch optimizers inside a trainer's (possibly wrapped) optimizer object(s)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        while item is not None and not isinstance(item, torch.optim.Optimizer):
            item = getattr(item, "optimizer", None) or getattr(item, "_optimizer", None)
        if item is not None:
            yield item
