"""`CensusName`: the name of one state-census record (``rng.python``, ``optim<i>.<field>``,
``data.<site>``, ...), built and parsed in this one place, with what a record is in words
(its title, the sentence when it differs).  No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Kinds of census records.
RNG = "rng"  # a global generator: key python, numpy or torch_cpu
CUDA_RNG = "cuda_rng"  # a CUDA device's generator: key the device's number
USER_RNG = "user_rng"  # a generator of the program's own: key its name (zero-code: its creation site)
OPTIMIZER = "optimizer"  # key the optimizer's number, field step | lr | hparams
SCHEDULER = "scheduler"  # key the LR scheduler's number, field last_epoch | step_count | lr
SCALER = "scaler"  # key the GradScaler's number
DATA_POSITION = "data_position"  # key the data loader's site: the batches its iterator yielded
DATA_STATE = "data_state"  # key the data loader's site: its state_dict
OTHER = "other"  # anything else (a recipe's fp8 amax histories): key the whole name

GENERATORS = (RNG, CUDA_RNG, USER_RNG)
COMPONENTS = {OPTIMIZER: "optim", SCHEDULER: "sched", SCALER: "scaler"}  # numbered: optim<i>.<field>
LOADERS = (DATA_POSITION, DATA_STATE)
_PREFIXES = {CUDA_RNG: "rng.cuda:", USER_RNG: "rng.user.", RNG: "rng.", DATA_STATE: "data.state.", DATA_POSITION: "data."}
GLOBAL_GENERATORS = ("python", "numpy", "torch_cpu")

_NOT_RESTORED = "seeded from something that changes, or not restored on resume"
_SITE = re.compile(r"\.py:\d+(#\d+)?$")
_GLOBAL_TITLES = {"python": "Python random generator", "numpy": "NumPy global generator",
                  "torch_cpu": "torch CPU generator"}
_GLOBAL_LABELS = {"python": "Python `random`", "numpy": "NumPy's global generator (np.random)",
                  "torch_cpu": "the torch CPU generator"}
_GLOBAL_SENTENCES = {"python": "Python `random` state", "numpy": "NumPy global random state (np.random)",
                     "torch_cpu": "torch CPU RNG state"}
_FIELD_TITLES = {OPTIMIZER: {"step": "step counts", "lr": "learning rates", "hparams": "group settings"},
                 SCHEDULER: {"last_epoch": "position (last_epoch)", "step_count": "step() calls", "lr": "last LR"}}
_SCHEDULER_FIELDS = {"last_epoch": "position (last_epoch, the steps it has counted)",
                     "step_count": "step count (_step_count)", "lr": "last computed LR (get_last_lr())"}


# A record's title (a state picture's row) and subject ("C has no <subject>"), by kind; a kind
# not listed is called by its key, or its whole name.
_TITLES = {
    RNG: lambda name: _GLOBAL_TITLES[name.key],
    CUDA_RNG: lambda name: f"CUDA generator {name.key}",
    USER_RNG: lambda name: f"generator {name.key}",
    DATA_STATE: lambda name: f"data loader {name.key} state",
    DATA_POSITION: lambda name: f"data loader {name.key} position",
    OPTIMIZER: lambda name: f"optimizer {name.key} {_FIELD_TITLES[OPTIMIZER].get(name.field, name.field)}".strip(),
    SCHEDULER: lambda name: f"LR scheduler {name.key} {_FIELD_TITLES[SCHEDULER].get(name.field, name.field)}".strip(),
    SCALER: lambda name: f"GradScaler {name.key} scale",
}
_SUBJECTS = {
    OPTIMIZER: lambda name: f"optimizer {name.key} ({name})",
    SCHEDULER: lambda name: f"LR scheduler {name.key} ({name})",
    SCALER: lambda name: f"GradScaler ({name})",
    DATA_STATE: lambda name: f"the state of the data loader made at {name.key}",
    DATA_POSITION: lambda name: f"data loader made at {name.key}",
}


@dataclass(frozen=True)
class CensusName:
    """One census record's name: ``kind``, ``key`` (which generator, component number or loader
    site; `OTHER`: the whole name) and ``field`` (``step`` of ``optim0.step``); ``str()`` formats it."""

    kind: str
    key: str
    field: str = ""

    # The kinds, for readers (`CensusName.OPTIMIZER`).
    RNG, CUDA_RNG, USER_RNG, OPTIMIZER, SCHEDULER, SCALER = RNG, CUDA_RNG, USER_RNG, OPTIMIZER, SCHEDULER, SCALER
    DATA_POSITION, DATA_STATE, OTHER = DATA_POSITION, DATA_STATE, OTHER
    GENERATOR_KINDS = GENERATORS

    # -- writing ------------------------------------------------------------------------

    @classmethod
    def rng(cls, which: str) -> "CensusName":
        return cls(RNG, which)

    @classmethod
    def cuda_rng(cls, device: int) -> "CensusName":
        return cls(CUDA_RNG, str(device))

    @classmethod
    def user_rng(cls, name: str) -> "CensusName":
        return cls(USER_RNG, name)

    @classmethod
    def component(cls, kind: str, index: int, field: str = "") -> "CensusName":
        """Optimizer, LR scheduler or GradScaler ``index``'s record ``field``."""
        return cls(kind, str(index), field)

    @classmethod
    def loader(cls, site: str) -> "CensusName":
        return cls(DATA_POSITION, site)

    def __str__(self) -> str:
        if self.kind in COMPONENTS:
            return f"{COMPONENTS[self.kind]}{self.key}" + (f".{self.field}" if self.field else "")
        return _PREFIXES.get(self.kind, "") + self.key

    # -- reading ------------------------------------------------------------------------

    @classmethod
    def parse(cls, name: str) -> "CensusName":
        """The name a census record carries, parsed (`OTHER` for a name the census does not write)."""
        for kind, prefix in _PREFIXES.items():  # the longest prefix first: rng.cuda: before rng.
            if name.startswith(prefix) and (kind != RNG or name[len(prefix):] in GLOBAL_GENERATORS):
                return cls(kind, name[len(prefix):])
        head, _, field = name.partition(".")
        for kind, prefix in COMPONENTS.items():
            number = head[len(prefix):]
            if head.startswith(prefix) and number.isdigit():
                return cls(kind, number, field)
        return cls(OTHER, name)

    @property
    def is_generator(self) -> bool:
        return self.kind in GENERATORS

    @property
    def is_torch_generator(self) -> bool:
        """A torch generator (CPU, CUDA, the program's own), whose draws a trace's RNG ops show;
        Python's and NumPy's global generators are not."""
        return self.kind in (CUDA_RNG, USER_RNG) or (self.kind == RNG and self.key == "torch_cpu")

    @property
    def is_loader(self) -> bool:
        return self.kind in LOADERS

    @property
    def is_component(self) -> bool:
        """An optimizer's, LR scheduler's or GradScaler's record (numbered, with fields)."""
        return self.kind in COMPONENTS

    @property
    def head(self) -> str:
        """What the record belongs to: ``optim0`` for every record of optimizer 0, the whole
        name for any other record."""
        return f"{COMPONENTS[self.kind]}{self.key}" if self.kind in COMPONENTS else str(self)

    def loader_state(self) -> "CensusName":
        """The state_dict record of the loader whose position this is."""
        return CensusName(DATA_STATE, self.key)

    @property
    def site(self) -> str:
        """A loader's site without its ``#k`` (the k-th loader made there)."""
        return self.key.split("#")[0]

    # -- words --------------------------------------------------------------------------

    def title(self) -> str:
        """What a person calls the record (a state picture's row)."""
        return _TITLES.get(self.kind, lambda name: name.key)(self)

    def subject(self) -> str:
        """The record as the thing one run has and the other lacks ("C has no <subject>")."""
        return _SUBJECTS.get(self.kind, str)(self)

    def field_words(self) -> str:
        """An LR scheduler record's field in words ("position (last_epoch, ...)")."""
        return _SCHEDULER_FIELDS.get(self.field, self.field)

    def generator(self) -> tuple[str, str]:
        """A generator record's (id in a finding, how a person calls it)."""
        if self.kind == RNG:
            return self.key, _GLOBAL_LABELS[self.key]
        if self.kind == CUDA_RNG:
            return f"cuda:{self.key}", f"the torch CUDA generator of device {self.key}"
        return f"user:{self.key}", f"the generator made at {self.key}"

    def describe(self, present=None) -> str:
        """`describe_state_record`: the sentence a user needs when the record differs."""
        kind, key, field = self.kind, self.key, self.field
        if kind == OPTIMIZER and field == "lr":
            if present is not None and not has_scheduler(present):
                return (f"optimizer {key}'s learning rate (its param groups' lr) differs at step start, and the "
                        "program has no LR scheduler: the loop sets the LR itself, from an iteration counter that "
                        "was not restored from the checkpoint (restore it, e.g. iter_num = checkpoint['iter_num'])")
            if present is None:
                return (f"optimizer {key}'s learning rate (its param groups' lr) differs at step start: the LR's "
                        "position was not restored on resume (an LR scheduler's state, or the iteration counter a "
                        "loop computes the LR from)")
            return (f"optimizer {key}'s learning rate (its param groups' lr) differs at step start: the LR "
                    "scheduler's position or the optimizer's param groups were not restored on resume")
        if kind == SCHEDULER and field:
            what = {"last_epoch": "position (last_epoch: the steps it has counted)"}.get(field, self.field_words())
            return (f"LR scheduler {key}'s {what} differs at step start: the "
                    "scheduler was not restored on resume (scheduler.load_state_dict(checkpoint['scheduler']))")
        if kind == RNG:
            return f"{_GLOBAL_SENTENCES[key]} differs at step start: {_NOT_RESTORED}"
        if kind == CUDA_RNG:
            return f"torch CUDA RNG state of device {key} differs at step start: {_NOT_RESTORED}"
        if kind == USER_RNG:
            if _SITE.search(key):  # zero-code recording names the generators a program makes by site
                return f"the private generator made at {key} is in another state at step start: {_NOT_RESTORED}"
            return f"generator '{key}' state differs at step start: {_NOT_RESTORED}"
        if kind == OPTIMIZER and field == "step":
            return (f"optimizer {key} step counts differ at step start: optimizer state not "
                    "restored on resume, or a step skipped")
        if kind == OPTIMIZER and field == "hparams":
            return (f"optimizer {key}'s group settings (betas, weight decay, eps, ...) differ at step "
                    "start: optimizer state not restored on resume, or the groups were built differently")
        if kind == SCALER:
            return (f"GradScaler {key}'s scale or growth tracker differs at step start: "
                    "scaler.load_state_dict not called on resume")
        if kind == DATA_STATE:
            return (f"data loader {key}'s own state (its state_dict: where its dataset "
                    "is in the data) differs at step start: the data position was not restored on resume")
        if kind == DATA_POSITION:
            return (f"data loader {key} is at another position in its epoch at step "
                    "start (batches its iterator yielded): the data position was not restored on resume")
        return (f"training state {str(self)!r} differs at step start: some state was not restored on "
                "resume, or was seeded from something that changes")


def describe_state_record(name: str, present=None) -> str:
    """The sentence a user needs when census record ``name`` differs at a step's start, naming
    only what the program has: ``present`` is every record name of that census (None: not
    known), so an LR without a scheduler is blamed on the loop's own iteration counter."""
    return CensusName.parse(name).describe(present)


def has_scheduler(names) -> bool:
    """Does a census with records ``names`` hold an LR scheduler (``sched<i>.*``)?"""
    return any(CensusName.parse(name).kind == SCHEDULER for name in names)
