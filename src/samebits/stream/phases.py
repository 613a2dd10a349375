"""The phases of a fingerprint stream: one table (`PHASES`), read by every writer and reader, and
the derived names ``global:params``, ``optimizer1.params`` and ``trace:<category>:<phase>``.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tracer's training phases, in the order they happen within a step (`trace:<category>:<phase>`).
TRAINING_PHASES = ("init", "pre", "forward", "backward", "recompute", "reduce", "optimizer", "post")
GLOBAL_PHASE_PREFIX = "global:"  # the digests of whole tensors behind shards (`Recorder.global_tensors`)
TRACE_PHASE_PREFIX = "trace:"  # the tracer's records (samebits.trace)

# The main stream: what a step records, in the order the step writes it.
DATA = "data"  # the step's input tokens (the recipe)
FORWARD = "forward"  # activations: top-level forward outputs, the recipe's block outputs
BACKWARD = "backward"  # the root passed to backward() (zero-code recording: the loss)
LOSS = "loss"  # the micro-batch losses the integrations see
METRICS = "metrics"  # scalars with their exact bits (loss, grad norm, learning rate)
GRADS = "grads"  # after the optimizer step: the gradients it used,
PARAMS = "params"  # the updated parameters
OPTIMIZER = "optimizer"  # and the optimizer's state tensors
AFTER_OPTIMIZER_STEP = (GRADS, PARAMS, OPTIMIZER)  # `Recorder.optimizer_step`, in this order

# The census stream (samebits.checkpoint): the program's state, never part of the verdict.
STATE = "state"  # every RNG, optimizer, scheduler, scaler and data loader at the step's start
STATE_END = "state_end"  # the generators again after the optimizer step
INPUTS = "inputs"  # the tensor arguments of each top-level forward (the batch)
RESTORED_PARAMS = "restored.params"  # a process's parameters as its first step begins
RESTORED_OPTIMIZER = "restored.optimizer"  # and its optimizer state


@dataclass(frozen=True)
class Phase:
    """One plain phase: ``training``, its training phase (`TRAINING_PHASES`; None: outside the
    step's computation), ``group``, the report's name for its tensors, and ``state``: census state."""

    name: str
    training: str | None = None
    group: str | None = None
    state: bool = False


PHASES = {phase.name: phase for phase in (
    Phase(DATA, training="forward", group="inputs"),
    Phase(FORWARD, training="forward", group="activations"),
    # Unordered among the training phases, as the origin ordering always had them (an
    # ordering change would reorder findings: a behaviour change, not this table's to make).
    Phase(BACKWARD),
    Phase(LOSS),
    Phase(METRICS, training="reduce"),
    Phase(GRADS, training="reduce", group="grads"),
    Phase(PARAMS, training="optimizer", group="params"),
    Phase(OPTIMIZER, training="optimizer", group="optimizer state"),
    Phase(STATE, state=True),
    Phase(STATE_END, state=True),
    Phase(INPUTS, state=True),
    Phase(RESTORED_PARAMS, state=True),
    Phase(RESTORED_OPTIMIZER, state=True),
)}
# The report's tensor groups, in the order it shows them.
REPORT_GROUPS = ("params", "grads", "optimizer state", "activations", "inputs")


def optimizer_phase(phase: str, number: int | None) -> str:
    """The phase of ``phase``'s records for optimizer ``number``: the optimizer that ends the
    step (None) records under the plain phase, any other under ``optimizer<number>.<phase>``."""
    return phase if number is None else f"optimizer{number}.{phase}"


def split_optimizer_phase(phase: str) -> tuple[str, str | None]:
    """(the plain phase, the optimizer's number) of a phase `optimizer_phase` made: ``params``
    -> ("params", None), ``optimizer1.params`` -> ("params", "1")."""
    head, dot, plain = phase.partition(".")
    number = head.removeprefix("optimizer")
    return (plain, number) if dot and head.startswith("optimizer") and number.isdigit() else (phase, None)


def training_rank(phase: str) -> int:
    """Where a plain phase's records sit among `TRAINING_PHASES` (for ordering findings);
    ``len(TRAINING_PHASES)`` for a phase outside the step's computation or not in the table."""
    entry = PHASES.get(phase)
    return TRAINING_PHASES.index(entry.training) if entry is not None and entry.training else len(TRAINING_PHASES)


def report_group(phase: str) -> str:
    """What the report calls ``phase``'s tensors (the phase's own name when the table has none)."""
    entry = PHASES.get(phase)
    return entry.group if entry is not None and entry.group else phase
