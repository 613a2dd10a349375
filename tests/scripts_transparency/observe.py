"""Prints what a program can observe of the classes zero-code recording watches, one line
per check, so that a plain run and a run under `samebits run` can be compared line for line
(tests/test_transparency.py).  Nothing here imports samebits."""

import copy
import io
import pickle
import random
import re
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

warnings.simplefilter("ignore")  # the deprecated torch.cuda.amp.GradScaler says so once per run
torch.manual_seed(0)
torch.set_rng_state(torch.get_rng_state())  # a restore: recording watches the next draws until a step begins


def show(label, thunk):
    """One line: what ``thunk()`` gives, or the exception it raises (its type and text)."""
    try:
        value = thunk()
    except Exception as err:  # noqa: BLE001 - the observation is the point
        value = f"raises {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    print(f"{label}: {re.sub(' at 0x[0-9a-f]+', '', str(value))}", flush=True)  # an address differs run to run


def roundtrips(obj):
    """pickle, deepcopy and torch.save/torch.load of ``obj``: each one's result type or error."""
    def torch_roundtrip():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return type(torch.load(buffer, weights_only=False)).__name__
    return {"pickle": lambda: type(pickle.loads(pickle.dumps(obj))).__name__,
            "deepcopy": lambda: type(copy.deepcopy(obj)).__name__,
            "torch.save": torch_roundtrip}


def check_roundtrips(name, obj):
    for how, thunk in roundtrips(obj).items():
        show(f"{name} {how}", thunk)


# --- generators ---------------------------------------------------------------------------
gen = torch.Generator().manual_seed(7)
show("type(gen)", lambda: type(gen))
show("type(gen) is torch.Generator", lambda: type(gen) is torch.Generator)
show("isinstance(default_generator, Generator)", lambda: isinstance(torch.default_generator, torch.Generator))
show("isinstance(gen, (int, Generator))", lambda: isinstance(gen, (int, torch.Generator)))
show("issubclass(type(gen), Generator)", lambda: issubclass(type(gen), torch.Generator))
show("torch.Generator is torch._C.Generator", lambda: torch.Generator is torch._C.Generator)
show("Generator name", lambda: (torch.Generator.__module__, torch.Generator.__qualname__))


def seed_or_generator(seed_or_gen):
    """A helper as libraries write it: a seed, or a generator to use as it is."""
    if isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    if isinstance(seed_or_gen, int):
        return torch.Generator().manual_seed(seed_or_gen)
    raise TypeError(f"not a seed or a generator: {seed_or_gen!r}")


show("seed_or_generator(default)", lambda: torch.rand(2, generator=seed_or_generator(torch.default_generator)).shape)


def annotated(generator: torch.Generator) -> torch.Generator:
    return generator


show("annotation", lambda: annotated.__annotations__["generator"] is torch.Generator)
check_roundtrips("gen", gen)
show("gen copy state", lambda: torch.equal(copy.deepcopy(gen).get_state(), gen.get_state()))
show("pickled class", lambda: pickle.loads(pickle.dumps(torch.Generator)) is torch.Generator)


class LabelledGenerator(torch.Generator):
    def __init__(self, device="cpu"):  # torch.Generator's own __new__ takes the device too
        super().__init__()
        self.label = "mine"


sub = LabelledGenerator("cpu")
sub.manual_seed(3)
show("subclass", lambda: (type(sub).__name__, isinstance(sub, torch.Generator), sub.label, sub.initial_seed()))
show("subclass vars", lambda: sorted(vars(sub)))
show("subclass draw", lambda: torch.rand(2, generator=sub).tolist())


@torch.compile(backend="eager")
def noisy(x, generator):
    return x + torch.rand(x.shape, generator=generator)


show("compile with a generator", lambda: noisy(torch.zeros(3), torch.Generator().manual_seed(0)).tolist())
np_rng = np.random.default_rng(5)
show("numpy default_rng", lambda: (type(np_rng).__name__, np_rng.integers(0, 100, 3).tolist()))
show("numpy default_rng pickles", lambda: pickle.loads(pickle.dumps(np.random.default_rng)) is np.random.default_rng)
check_roundtrips("np_rng", np_rng)

show("torch.manual_seed is torch.random.manual_seed", lambda: torch.manual_seed is torch.random.manual_seed)
for name, function in (("torch.manual_seed", torch.manual_seed), ("torch.set_rng_state", torch.set_rng_state),
                       ("torch.seed", torch.seed), ("random.seed", random.seed), ("random.setstate", random.setstate),
                       ("np.random.seed", np.random.seed), ("np.random.set_state", np.random.set_state)):
    show(f"{name} pickles", lambda function=function: callable(pickle.loads(pickle.dumps(function))))

# --- data loaders -------------------------------------------------------------------------
dataset = TensorDataset(torch.arange(12.0).reshape(6, 2))
loader = DataLoader(dataset, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
show("vars(loader) before", lambda: sorted(vars(loader)))
iterator = iter(loader)
first = next(iterator)
show("first batch", lambda: first[0].tolist())
show("vars(loader) iterated", lambda: sorted(vars(loader)))
show("vars(iterator)", lambda: sorted(vars(iterator)))
check_roundtrips("loader", loader)
show("epoch", lambda: [batch[0].tolist() for batch in loader])


class MyLoader(DataLoader):
    def __init__(self, data, **kwargs):
        super().__init__(data, **kwargs)
        self.note = "mine"


mine = MyLoader(dataset, batch_size=3)
show("loader subclass", lambda: (type(mine).__name__, mine.note, [b[0].shape[0] for b in mine]))
show("loader subclass vars", lambda: sorted(vars(mine)))
check_roundtrips("loader subclass", mine)
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:
    print("torchdata: not installed")
else:
    stateful = StatefulDataLoader(dataset, batch_size=2)
    it = iter(stateful)
    next(it)
    state = stateful.state_dict()
    resumed = StatefulDataLoader(dataset, batch_size=2)
    resumed.load_state_dict(state)
    show("stateful resumed", lambda: [b[0].tolist() for b in resumed])
    show("stateful vars", lambda: sorted(vars(resumed)))
    check_roundtrips("stateful", StatefulDataLoader(dataset, batch_size=2))

# --- optimizers, schedulers, scalers ------------------------------------------------------
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
model(torch.ones(1, 2)).sum().backward()
optimizer.step()
scheduler.step()
for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
    show(f"vars({name})", lambda obj=obj: sorted(vars(obj)))
    check_roundtrips(name, obj)
show("type(optimizer) is SGD", lambda: type(optimizer) is torch.optim.SGD)
show("SGD.__init__ name", lambda: (torch.optim.SGD.__init__.__name__, torch.optim.Optimizer.__init__.__qualname__))
scalers = {"amp enabled": lambda: torch.amp.GradScaler("cpu", enabled=True),
           "amp disabled": lambda: torch.amp.GradScaler("cpu", enabled=False),
           "cuda.amp disabled": lambda: torch.cuda.amp.GradScaler(enabled=False)}
for name, make in scalers.items():
    scaler = make()
    show(f"scaler {name}", lambda scaler=scaler: (type(scaler).__name__, sorted(vars(scaler))))
    check_roundtrips(f"scaler {name}", scaler)


class MyOptimizer(torch.optim.SGD):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.extra = 1


class MyScheduler(torch.optim.lr_scheduler.LambdaLR):
    pass


class MyScaler(torch.amp.GradScaler):
    pass


mine_opt = MyOptimizer(model.parameters(), lr=0.1)
show("optimizer subclass", lambda: (type(mine_opt).__name__, mine_opt.extra, sorted(vars(mine_opt))))
show("scheduler subclass", lambda: type(MyScheduler(mine_opt, lambda epoch: 1.0)).__name__)
show("scaler subclass", lambda: type(MyScaler("cpu", enabled=False)).__name__)
show("optimizer init error", lambda: torch.optim.SGD(model.parameters(), lr=-1.0))
show("loader init error", lambda: DataLoader(dataset, batch_size=0))
show("final weight", lambda: model.weight.detach().tolist())
sys.stdout.flush()
