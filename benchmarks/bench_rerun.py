"""The cost of keeping every training step re-executable (`samebits.rerun.StepValidator`).

    python benchmarks/bench_rerun.py                      # a 4-layer d=256 encoder, AdamW, 20 steps
    python benchmarks/bench_rerun.py --steps 30 --json out.json

Three loops over the same steps, in one process, interleaved step by step so machine load
hits all alike: plain training; with a validator that snapshots each step but validates
none (the standing cost: a copy of parameters, gradients, optimizer state, RNG states and
the batch per step); and with ``every=10`` (one step in ten re-executed once).  Reports the
median step time of each (ratio to plain) and the bytes a snapshot holds (ratio to the
parameters' bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from samebits.rerun import StepValidator


def _trainer(seed: int, d_model: int, layers: int):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(d_model, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return model, optimizer, step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 128, args.d_model, generator=gen), torch.randn(8, 128, 1, generator=gen))
               for _ in range(args.steps)]
    loops = {}
    for label, kwargs in (("plain", None), ("snapshot_only", {}), ("every_10", {"every": 10})):
        model, optimizer, step = _trainer(0, args.d_model, args.layers)
        validator = None if kwargs is None else StepValidator(model, optimizer, **kwargs)
        loops[label] = (step, validator, [])
    for index, (x, y) in enumerate(batches):
        for label, (step, validator, times) in loops.items():
            start = time.perf_counter()
            if validator is None:
                step(x, y)
            else:
                validator.run(index, step, x, y)
            times.append(time.perf_counter() - start)
    validator = loops["snapshot_only"][1]
    snapshot = validator._snapshot((batches[0],), {})
    snap_bytes = sum(t.numel() * t.element_size() for t in _tensors(snapshot))
    param_bytes = sum(p.numel() * p.element_size() for p in loops["snapshot_only"][1].model.parameters())
    plain = statistics.median(loops["plain"][2][2:])
    result = {
        "model": f"TransformerEncoder d={args.d_model} x {args.layers} layers + AdamW, batch 8x128",
        "threads": torch.get_num_threads(), "load_avg": os.getloadavg(), "steps": args.steps,
        "plain_step_s": plain,
        "snapshot_only_step_ratio": statistics.median(loops["snapshot_only"][2][2:]) / plain,
        "every_10_step_ratio": statistics.mean(loops["every_10"][2][2:]) / statistics.mean(loops["plain"][2][2:]),
        "parameter_bytes": param_bytes, "snapshot_bytes": snap_bytes, "snapshot_to_parameters": snap_bytes / param_bytes,
        "validated_steps": [r.to_dict()["verdict"] for r in loops["every_10"][1].results],
    }
    text = json.dumps(result, indent=2)
    if args.json:
        open(args.json, "w").write(text)
    print(text)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


if __name__ == "__main__":
    main()
