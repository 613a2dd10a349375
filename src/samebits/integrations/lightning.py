"""`SamebitsCallback` for Lightning 2.x: recording, and random states that make resume exact.

Records per optimizer step and rank (docs/integrations.md, "What is recorded").  A Lightning
checkpoint holds no random state, so the callback stores every random state twice (as at the
epoch's start and as at the save) and restores them at the same points of the resumed run
(docs/integrations.md, "Resume").  Under zero-code recording it only keeps the random states.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch

from samebits.checkpoint import capture_rng_state, restore_rng_state
from samebits.integrations._steps import StepRecorder, optimizers_of, say, zero_code_active

_OWNER = "lightning.SamebitsCallback"
_KEY = "samebits"  # the callback's entry in a Lightning checkpoint


class SamebitsCallback(L.Callback):
    """Record into ``out`` (``None``: ``SAMEBITS_DIR``, or nothing) and make resume exact."""

    def __init__(self, out: str | os.PathLike | None = None, *, params: bool = True, grads: bool = True,
                 optimizer_state: bool = True, rng: bool = True):
        self.rng = rng
        self.zero_code = zero_code_active()
        record = not self.zero_code and (out is not None or os.environ.get("SAMEBITS_DIR"))
        self.steps = StepRecorder(out, params=params, grads=grads, optimizer_state=optimizer_state,
                                  config={"integration": "lightning.Trainer"}, owner=_OWNER) if record else None
        self._epoch_rng: dict[str, Any] | None = None  # this epoch's states before its data order
        self._restore_at_batch: dict[str, Any] | None = None
        self._last_step = None

    # --- random states -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if self.rng:
            progress = trainer.fit_loop.epoch_loop.batch_progress
            checkpoint[_KEY] = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                                "batch_in_epoch": progress.current.completed,
                                "epoch_done": bool(progress.is_last_batch),
                                "epoch_start_rng": self._epoch_rng, "rng": capture_rng_state()}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Restore now: a resumed run makes its first data iterator before any later hook."""
        if not self.rng:
            return
        saved = checkpoint.get(_KEY)
        if saved is None:
            say(_OWNER, "the checkpoint holds no random states (saved without SamebitsCallback): "
                        "this resume will not be bitwise exact", finding=True, step=trainer.global_step)
        elif saved["epoch_done"]:  # saved at an epoch's end: continue from the save
            restore_rng_state(saved["rng"])
            self._epoch_rng = saved["rng"]
        elif saved["epoch_start_rng"] is not None:  # mid-epoch: redraw the same data order first
            restore_rng_state(saved["epoch_start_rng"])
            self._epoch_rng = saved["epoch_start_rng"]
            self._restore_at_batch = saved

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.rng:  # before the data loader draws this epoch's order
            self._epoch_rng = capture_rng_state()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        saved, self._restore_at_batch = self._restore_at_batch, None
        if saved is None:
            return
        if not _resumable(trainer.train_dataloader):
            say(_OWNER, f"this resume cannot be bitwise exact: the checkpoint was taken in the middle of "
                        f"epoch {saved['epoch']} (after {saved['batch_in_epoch']} batches) and the train data "
                        f"loader is not resumable, so Lightning restarts its epoch. Use a data loader with "
                        f"state_dict/load_state_dict (torchdata's StatefulDataLoader) or checkpoint at epoch ends.",
                finding=True, step=trainer.global_step)
        restore_rng_state(saved["rng"])

    # --- recording -----------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self.zero_code:
            say(_OWNER, "zero-code recording is on (samebits run/verify): the callback only keeps random states")
        if self.steps is not None:
            self.steps.start(pl_module, first_step=trainer.global_step)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.steps.add_loss(loss)
        if trainer.global_step == self._last_step:  # accumulating: the optimizer has not stepped
            return
        self._last_step = trainer.global_step
        for optimizer in optimizers_of(trainer.optimizers):
            self.steps.step = trainer.global_step - 1
            self.steps.finish_step(optimizer)
            break

    def on_train_end(self, trainer, pl_module) -> None:
        if self.steps is not None:
            self.steps.close()


def _resumable(loaders: Any) -> bool:
    """Whether Lightning can restore the data position of these loaders (as it decides)."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    return all(callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))
               for x in loaders)


__all__ = ["SamebitsCallback"]
