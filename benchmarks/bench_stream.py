"""Benchmarks of the stream writer and the comparator, as ratios against baselines
measured in the same run.

    python benchmarks/bench_stream.py                 # both
    python benchmarks/bench_stream.py --only compare  # comparator vs `cmp`
    python benchmarks/bench_stream.py --only recorder # Recorder vs bare digest_many
    python benchmarks/bench_stream.py --json

Comparator: synthetic runs of 64 ranks x 200 steps x 600 tensor records.  Baseline:
`cmp -s` over the same 64 pairs of stream files.  The comparator reads every frame of both
runs, checks every checksum and recomputes every step root (it trusts nothing stored), so
the target is >= 0.5x cmp's speed for identical runs and for runs that differ only at the
last step.  Both are timed as the best of 7 runs (the least disturbed by other load).
Recorder: digesting and writing 600 tensors totalling 400 MB per step, against the bare
batched digest of the same tensors.  Target: >= 0.8x (writing is never the bottleneck).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import samebits
from samebits.stream import _format as fmt
from samebits.stream.reader import StreamReader


def _timed(fn, repeat: int, best: bool = False) -> float:
    """The median of ``repeat`` timings, or the best (the least disturbed by other load on
    a shared machine; used for the comparator, whose baseline is equally treated)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def _write_rank0(directory: Path, num_steps: int, num_records: int, bump_last: bool) -> Path:
    names = [f"model.layers.{i // 20}.mlp.experts.{i % 20}.weight" for i in range(num_records)]
    tensors = [torch.full((8,), float(i)) for i in range(num_records)]
    with samebits.Recorder(directory, rank=0, world_size=64, config={"bench": True}) as rec:
        for step in range(num_steps):
            if bump_last and step == num_steps - 1:
                tensors[-1] = tensors[-1] + 1
            rec.tensors(step, "params", zip(names, tensors))
    return directory / fmt.stream_filename(0)


def _clone_for_ranks(rank0: Path, directory: Path, ranks: range) -> None:
    """Copy rank 0's stream to other ranks: a new header frame, the same step frames, and
    the step-index footer rebuilt for the shifted offsets."""
    reader = StreamReader(rank0)
    header_end = reader.end_offset
    index = reader.step_index()
    data = rank0.read_bytes()
    body = data[header_end : index[-1][3] + _frame_length(data, index[-1][3])]
    for rank in ranks:
        frame = fmt.frame(fmt.FRAME_HEADER, dataclasses.replace(reader.header, rank=rank).payload())
        shift = len(frame) - header_end
        footer = bytearray()
        fmt.encode_varint(len(index), footer)
        for step, count, root, offset in index:
            fmt.encode_varint(step, footer)
            fmt.encode_varint(count, footer)
            footer += fmt.pack_u64(root)
            fmt.encode_varint(offset + shift, footer)
        index_offset = len(frame) + len(body)
        tail = fmt.frame(fmt.FRAME_INDEX, footer) + fmt.frame(fmt.FRAME_CLOSE, fmt.pack_u64(index_offset) + fmt.CLOSE_MAGIC)
        (directory / fmt.stream_filename(rank)).write_bytes(frame + body + tail)


def _frame_length(data: bytes, offset: int) -> int:
    length, pos = fmt.decode_varint(data, offset + 1)
    return pos - offset + length + 4


def bench_compare(num_ranks=64, num_steps=200, num_records=600, repeat=7) -> dict:
    root = Path(tempfile.mkdtemp(prefix="samebits-bench-"))
    try:
        print(f"writing 3 synthetic runs of {num_ranks} ranks x {num_steps} steps x {num_records} records ...",
              file=sys.stderr)
        base = _write_rank0(root / "seed", num_steps, num_records, bump_last=False)
        bumped = _write_rank0(root / "seed-bumped", num_steps, num_records, bump_last=True)
        for name in ("a", "b", "c"):
            (root / name).mkdir()
            _clone_for_ranks(base, root / name, range(num_ranks))
        _clone_for_ranks(bumped, root / "c", range(num_ranks - 1, num_ranks))  # last rank, last step differs
        total_bytes = sum(p.stat().st_size for p in (root / "a").iterdir())

        def cmp_all(other):
            for rank in range(num_ranks):
                name = fmt.stream_filename(rank)
                subprocess.run(["cmp", "-s", str(root / "a" / name), str(root / other / name)])

        results = {"stream_bytes_per_run": total_bytes, "records_per_run": num_ranks * num_steps * num_records}
        for label, other in (("identical", "b"), ("last_step_differs", "c")):
            t_cmp = _timed(lambda: cmp_all(other), repeat, best=True)
            outcome = {}

            def run_diff():
                outcome["result"] = samebits.diff(root / "a", root / other)

            t_diff = _timed(run_diff, repeat, best=True)
            expected = "identical" if other == "b" else "diverged"
            assert outcome["result"].verdict == expected, outcome["result"].verdict
            results[label] = {"cmp_s": t_cmp, "samebits_diff_s": t_diff, "speed_vs_cmp": t_cmp / t_diff}
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_recorder(num_tensors=600, total_mb=400, num_steps=5) -> dict:
    numel = total_mb * 1024 * 1024 // 4 // num_tensors
    tensors = [torch.randn(numel) for _ in range(num_tensors)]
    names = [f"layers.{i}.weight" for i in range(num_tensors)]
    samebits.digest_many(tensors)  # warm-up (loads the native library)
    t_digest = _timed(lambda: samebits.digest_many(tensors), num_steps)
    root = Path(tempfile.mkdtemp(prefix="samebits-bench-"))
    try:
        rec = samebits.Recorder(root, rank=0, world_size=1)
        step_times = []
        for step in range(num_steps + 1):
            start = time.perf_counter()
            rec.tensors(step, "params", zip(names, tensors))
            rec.end_step(step)
            step_times.append(time.perf_counter() - start)
        rec.close()
        t_record = statistics.median(step_times[1:])
        bytes_per_record = (root / fmt.stream_filename(0)).stat().st_size / ((num_steps + 1) * num_tensors)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"tensors": num_tensors, "total_mb": total_mb, "digest_many_s": t_digest, "recorder_step_s": t_record,
            "speed_vs_digest": t_digest / t_record, "stream_bytes_per_record": bytes_per_record}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["compare", "recorder"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.only in (None, "compare"):
        results["compare"] = bench_compare()
    if args.only in (None, "recorder"):
        results["recorder"] = bench_recorder()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    if "compare" in results:
        c = results["compare"]
        print(f"comparator: 64 ranks x 200 steps x 600 records ({c['stream_bytes_per_run'] / 2**20:.1f} MiB per run)")
        print(f"{'case':<20} {'cmp (s)':>9} {'diff (s)':>9} {'speed vs cmp':>13}  target")
        for label, target in (("identical", ">= 0.5x"), ("last_step_differs", ">= 0.5x")):
            r = c[label]
            print(f"{label:<20} {r['cmp_s']:>9.3f} {r['samebits_diff_s']:>9.3f} {r['speed_vs_cmp']:>12.2f}x  {target}")
    if "recorder" in results:
        r = results["recorder"]
        print(f"recorder: {r['tensors']} tensors, {r['total_mb']} MB per step: digest_many {r['digest_many_s'] * 1e3:.1f} ms, "
              f"Recorder step {r['recorder_step_s'] * 1e3:.1f} ms -> {r['speed_vs_digest']:.2f}x (target >= 0.8x); "
              f"{r['stream_bytes_per_record']:.1f} bytes/record")


if __name__ == "__main__":
    main()
