"""A fake data-parallel program for tests/test_across_rule.py: ``verify --across dp=1,2 -- python
fake_replicas.py --nproc {nproc} --out {out} ...`` records every rank of one "layout" in one
process (rank-local records only, as a command without `Recorder.global_tensors` does).

Each rank records, per step, a replicated parameter ``w`` (or ``module.w``, as DDP names it,
with ``--ddp-names`` at a data-parallel size above 1), a large parameter ``big`` (over
``--max-tensor-bytes`` when given: recorded without a digest) and the loss.  At a size above 1,
``--vary w`` or ``--vary big`` gives that tensor other bits from step 1 on, and ``--drop w``
leaves ``w`` unrecorded: the attacks of issue 34 item 1.
"""

import argparse

import torch

import samebits


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ddp-names", action="store_true")
    parser.add_argument("--vary", default="")
    parser.add_argument("--drop", default="")
    parser.add_argument("--max-tensor-bytes", type=int)
    args = parser.parse_args(argv)
    other = args.nproc > 1
    for rank in range(args.nproc):
        with samebits.Recorder(args.out, rank=rank, world_size=args.nproc,
                               max_tensor_bytes=args.max_tensor_bytes) as rec:
            for step in range(args.steps):
                w = torch.full((4,), float(step))
                big = torch.full((64, 64), float(step))
                if other and step >= 1:
                    if args.vary == "w":
                        w[0] += 0.5
                    if args.vary == "big":
                        big[0, 0] += 0.5
                tensors = [("big", big)]
                if not (other and args.drop == "w"):
                    tensors.insert(0, ("module.w" if other and args.ddp_names else "w", w))
                rec.tensors(step, "params", tensors)
                rec.metrics(step, loss=float(step))
                rec.end_step(step)


if __name__ == "__main__":
    main()
