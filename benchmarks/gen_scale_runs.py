"""Synthetic run pairs shaped like the seed's headline run: 2,432 ranks x 800 steps.

    python benchmarks/gen_scale_runs.py OUT_DIR --records 64            # 2,432 x 800 x 64
    python benchmarks/gen_scale_runs.py OUT_DIR --ranks 8 --steps 20    # a small pair

writes four run directories under OUT_DIR:

    a/          the reference run
    b/          identical to a (its own files: another run id in every header)
    b-last/     b, but the last record of the last step of the last rank differs
    b-early/    b, but one rank (the middle one) differs from step 3 on

Every stream is a genuine samebits stream: one *seed* stream per variant is written by
`samebits.Recorder` (real tensors, real digests, a metric and tensor records in two phases),
and each rank's file is that seed's step frames behind the rank's own header frame, with
the step-index footer and close frame rebuilt for the rank's offsets (what a Recorder on
that rank would write, had every rank recorded the same values).  Writing 2,432 Recorders
would only repeat the seed's work 2,432 times.  The comparator trusts none of this: it
checks every checksum, recomputes every root, and checks every footer.

Size: about 21 bytes per tensor record, so 64 records per step make one run about 2.6 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import samebits
from samebits.stream import _format as fmt
from samebits.stream.reader import StreamReader

SEED_RANKS, SEED_STEPS = 2432, 800
EARLY_STEP = 3


def write_seed(path: Path, *, world_size: int, num_steps: int, num_records: int, run_id: str,
               change_last: bool = False, change_from: int | None = None) -> Path:
    """One rank's stream written by the Recorder: per step a `loss` metric and
    ``num_records - 1`` tensors (half gradients, half parameters), whose values change every
    step.  ``change_last`` changes the last tensor of the last step by one ulp; ``change_from``
    changes every tensor from that step on."""
    num_tensors = num_records - 1
    half = max(1, num_tensors // 2)
    names = [("grads", f"layers.{i}.weight") if i < half else ("params", f"layers.{i - half}.weight")
             for i in range(num_tensors)]
    base = torch.arange(16, dtype=torch.float32)
    with samebits.Recorder(path, rank=0, world_size=world_size, run_id=run_id,
                           config={"model": "seed-shaped", "records_per_step": num_records}) as rec:
        for step in range(num_steps):
            tensors = [base + (step * num_tensors + i) for i in range(num_tensors)]
            if change_from is not None and step >= change_from:
                tensors = [torch.nextafter(t, t + 1) for t in tensors]
            if change_last and step == num_steps - 1:
                tensors[-1] = torch.nextafter(tensors[-1], tensors[-1] + 1)
            rec.metrics(step, loss=1.0 / (step + 1))
            for (phase, name), tensor in zip(names, tensors):
                rec.tensors(step, phase, [(name, tensor)])
    return path / fmt.stream_filename(0)


class _Seed:
    """A seed stream split into its header, its step frames and its step index."""

    def __init__(self, path: Path):
        reader = StreamReader(path)
        self.header = reader.header
        self.index = reader.step_index()
        data = path.read_bytes()
        index_at = fmt.unpack_u64(data, len(data) - fmt.CLOSE_FRAME_SIZE + 2)
        length, at = fmt.decode_varint(data, 1)
        self.header_end = at + length + 4  # kind, length, payload, crc of the header frame
        self.body = data[self.header_end : index_at]  # NAMES and STEP frames, as written
        reader.close()

    def write_rank(self, path: Path, rank: int) -> int:
        """This seed's frames as rank ``rank``'s stream: its header frame, the same body, the
        footer's offsets shifted by the header's new length."""
        head = fmt.frame(fmt.FRAME_HEADER, dataclasses.replace(self.header, rank=rank).payload())
        shift = len(head) - self.header_end
        footer = bytearray()
        fmt.encode_varint(len(self.index), footer)
        for step, count, root, offset in self.index:
            fmt.encode_varint(step, footer)
            fmt.encode_varint(count, footer)
            footer += fmt.pack_u64(root)
            fmt.encode_varint(offset + shift, footer)
        index_at = len(head) + len(self.body)
        tail = fmt.frame(fmt.FRAME_INDEX, footer) + fmt.frame(fmt.FRAME_CLOSE, fmt.pack_u64(index_at) + fmt.CLOSE_MAGIC)
        with open(path, "xb") as file:
            file.write(head)
            file.write(self.body)
            file.write(tail)
        return len(head) + len(self.body) + len(tail)


def generate(out: str | os.PathLike, *, num_ranks: int = SEED_RANKS, num_steps: int = SEED_STEPS,
             num_records: int = 64, early_rank: int | None = None, progress: bool = False) -> dict:
    """Write the pair variants under ``out`` (see the module docstring); return their paths and
    sizes.  ``early_rank`` (default: the middle rank) is the rank of ``b-early`` that differs
    from step 3 on."""
    if num_records < 2 or num_steps < EARLY_STEP + 1 or num_ranks < 1:
        raise SystemExit("need >= 2 records, >= 4 steps and >= 1 rank")
    out = Path(out)
    early_rank = num_ranks // 2 if early_rank is None else early_rank
    seeds_dir = Path(tempfile.mkdtemp(prefix="seeds-", dir=out.parent if out.parent.exists() else None))
    try:
        shape = dict(world_size=num_ranks, num_steps=num_steps, num_records=num_records)
        seed_a = _Seed(write_seed(seeds_dir / "a", run_id="a" * 32, **shape))
        seed_b = _Seed(write_seed(seeds_dir / "b", run_id="b" * 32, **shape))
        seed_last = _Seed(write_seed(seeds_dir / "last", run_id="b" * 32, change_last=True, **shape))
        seed_early = _Seed(write_seed(seeds_dir / "early", run_id="b" * 32, change_from=EARLY_STEP, **shape))
    finally:
        shutil.rmtree(seeds_dir, ignore_errors=True)
    dirs = {name: out / name for name in ("a", "b", "b-last", "b-early")}
    for path in dirs.values():
        path.mkdir(parents=True)
    sizes = {"a": 0, "b": 0}
    started = time.perf_counter()
    for rank in range(num_ranks):
        name = fmt.stream_filename(rank)
        sizes["a"] += seed_a.write_rank(dirs["a"] / name, rank)
        sizes["b"] += seed_b.write_rank(dirs["b"] / name, rank)
        # The divergent variants share b's files (hard links) except the rank that differs.
        for variant, seed, differs in (("b-last", seed_last, rank == num_ranks - 1),
                                       ("b-early", seed_early, rank == early_rank)):
            if differs:
                seed.write_rank(dirs[variant] / name, rank)
            else:
                os.link(dirs["b"] / name, dirs[variant] / name)
        if progress and (rank + 1) % 256 == 0:
            print(f"  {rank + 1}/{num_ranks} ranks written ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return {"paths": {k: str(v) for k, v in dirs.items()}, "bytes_per_run": sizes["a"], "num_ranks": num_ranks,
            "num_steps": num_steps, "num_records": num_records, "early_rank": early_rank,
            "records_per_run": num_ranks * num_steps * num_records}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a new directory for the runs")
    parser.add_argument("--ranks", type=int, default=SEED_RANKS)
    parser.add_argument("--steps", type=int, default=SEED_STEPS)
    parser.add_argument("--records", type=int, default=64, help="records per step (one metric, the rest tensors)")
    args = parser.parse_args(argv)
    info = generate(args.out, num_ranks=args.ranks, num_steps=args.steps, num_records=args.records, progress=True)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
