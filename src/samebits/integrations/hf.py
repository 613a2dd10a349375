"""`SamebitsCallback` for the Hugging Face `transformers.Trainer` (docs/integrations.md).

Records per optimizer step (``global_step``) and rank; a resumed run continues the numbering
and appends to its stream.  Under zero-code recording the process is already recorded: the
callback records nothing, says so once, and stays out of the way.
"""

from __future__ import annotations

import os

import torch
from transformers import TrainerCallback

from samebits.integrations._steps import StepRecorder, optimizers_of, say, zero_code_active

_OWNER = "hf.SamebitsCallback"


class SamebitsCallback(TrainerCallback):
    """Record the run into ``out`` (a run directory; ``None``: ``SAMEBITS_DIR``).

    ``params``, ``grads``, ``optimizer_state``: which tensors to digest each step.
    """

    def __init__(self, out: str | os.PathLike | None = None, *, params: bool = True, grads: bool = True,
                 optimizer_state: bool = True):
        self.zero_code = zero_code_active()
        self.steps = None if self.zero_code else StepRecorder(
            out, params=params, grads=grads, optimizer_state=optimizer_state,
            config={"integration": "transformers.Trainer"}, owner=_OWNER)
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.zero_code:
            say(_OWNER, "zero-code recording is on (samebits run/verify): the callback records nothing")
            return
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self._forward_output)
        self._model = model

    def _forward_output(self, module, args, output):
        if not torch.is_grad_enabled():  # evaluation, not a training micro-batch
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None:
            self.steps.add_loss(loss)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.steps is None:
            return
        found = list(optimizers_of(optimizer))
        if not found:
            return
        if self.steps.recorder is None:  # opened here: the Trainer has restored global_step by now
            self.steps.start(self._model, first_step=state.global_step)
        self.steps.step = state.global_step  # the step the optimizer just took (counted after this)
        self.steps.finish_step(found[0])

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.steps is not None:
            self.steps.close()


__all__ = ["SamebitsCallback"]
