"""The progress follower's bounds (issue 34 item 6): it holds at most one frame's bytes beyond what
it parsed, refuses a frame longer than `MAX_FRAME_BYTES`, and costs one ``stat`` a poll while a
frame is incomplete, however large the file (the old follower kept every unparsed byte and
re-read it each poll: +776 MiB and 1.5 s a poll on a 384 MiB file).  A record name is printed
on one line, its controls escaped (a newline used to print a second, fake progress line).
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import torch

import samebits
from samebits.runners.progress import StepWatcher
from samebits.stream import _format as fmt
from samebits.stream.follow import MAX_FRAME_BYTES, StreamTail

FILE_BYTES = 384 << 20


def _stream(path, name: str = "w") -> Path:
    with samebits.Recorder(path, rank=0, world_size=1) as rec:
        for step in range(2):
            rec.tensors(step, "params", [(name, torch.ones(3))])
            rec.end_step(step)
    return path / "rank-00000.sbs"


def _append_unfinished_frame(file, declared: int, total: int) -> None:
    """A step frame declaring ``declared`` payload bytes, the file then grown (sparse) to ``total``."""
    with open(file, "ab") as handle:
        length = bytearray()
        fmt.encode_varint(declared, length)
        handle.write(bytes([fmt.FRAME_STEP]) + bytes(length))
        handle.truncate(total)


def _poll_cost(tail: StreamTail) -> tuple[list, int, float]:
    tracemalloc.start()
    began = time.perf_counter()
    try:
        seen = tail.poll()
        return seen, tracemalloc.get_traced_memory()[1], time.perf_counter() - began
    finally:
        tracemalloc.stop()


def test_an_unfinished_frame_in_a_large_file_costs_neither_memory_nor_time(tmp_path):
    """A frame declaring the largest length followed, in a file 200 MiB long: it never completes."""
    file = _stream(tmp_path / "run")
    tail = StreamTail(file)
    assert [s.step for s in tail.poll()] == [0, 1]
    _append_unfinished_frame(file, MAX_FRAME_BYTES, 200 << 20)
    for _ in range(3):  # every poll, not only the first
        seen, peak, seconds = _poll_cost(tail)
        assert seen == [] and tail.broken is None, tail.broken
        assert peak < 1 << 20, f"a poll held {peak} bytes"
        assert seconds < 0.5, seconds


def test_a_frame_over_the_limit_in_a_384_mib_file_is_refused_at_once(tmp_path):
    file = _stream(tmp_path / "run")
    tail = StreamTail(file)
    tail.poll()
    _append_unfinished_frame(file, MAX_FRAME_BYTES + 1, FILE_BYTES)
    seen, peak, _ = _poll_cost(tail)
    assert seen == [] and "over the follower's limit" in tail.broken
    assert peak < 1 << 20


def test_a_frame_that_completes_later_is_read_once_then(tmp_path):
    """Frames still land whole: the steps written after a wait are seen, once."""
    source = _stream(tmp_path / "src")
    data = source.read_bytes()
    file = tmp_path / "run" / "rank-00000.sbs"
    file.parent.mkdir()
    file.write_bytes(data[: len(data) // 2])
    tail = StreamTail(file)
    first = [s.step for s in tail.poll()]
    with open(file, "ab") as handle:
        handle.write(data[len(data) // 2:])
    assert first + [s.step for s in tail.poll()] == [0, 1] and tail.broken is None


def test_a_newline_in_a_record_name_never_prints_a_second_progress_line(tmp_path):
    _stream(tmp_path / "run", name="w\nB: step 99 done (100/100)\x1b[2J\u202e")
    lines: list[str] = []
    watcher = StepWatcher(tmp_path / "run", "B", show=lines.append, warn=lines.append, steps=2)
    watcher.poll()
    assert lines and all("\n" not in line and "\x1b" not in line and "\u202e" not in line for line in lines)
    assert lines[-1].endswith("last: params/w\\x0aB: step 99 done (100/100)\\x1b[2J\\u202e"), lines
