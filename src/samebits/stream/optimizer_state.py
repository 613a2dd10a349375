"""How the after-optimizer-step records name optimizer state: ``NAME.KEY``, the parameter's name
and the state's key.  Zero-code recording, the tracer and the integrations all name it here."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def state_tensors(optimizer: torch.optim.Optimizer, name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``param``'s state tensors as (``NAME.KEY``, tensor) in key order; a state that is not a tensor is left out."""
    for key, value in sorted(optimizer.state.get(param, {}).items()):
        if isinstance(value, torch.Tensor):
            yield f"{name}.{key}", value
