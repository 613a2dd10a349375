"""Fuzzing the stream reader and the comparator: damaged streams never compare IDENTICAL.

A small closed run is mutated in four ways (random byte changes, truncation, insertion,
and payload edits whose frame checksum is recomputed so only the step root can tell) and
compared against its pristine copy, through the library for every mutant and through
`samebits diff` for a sample.  The only exceptions allowed are samebits errors, and no
mutant that changed a byte may be called identical.  Seeded and fast.
"""

from __future__ import annotations

import random
import shutil
import zlib

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.errors import SamebitsError
from samebits.stream import _format as fmt

NUM_PER_KIND = 130  # 4 kinds -> 520 mutants
CLI_SAMPLE = 40


def _write_small_run(directory) -> None:
    gen = torch.Generator().manual_seed(0)
    with samebits.Recorder(directory, rank=0, world_size=1, config={"lr": 0.1}) as rec:
        for step in range(4):
            rec.metrics(step, loss=1.0 / (step + 1), tokens=step * 7)
            rec.tensors(step, "params", [(f"w{i}", torch.randn(3, 2, generator=gen)) for i in range(3)]
                        + [("frozen", None)])


def _frames(data: bytes) -> list[tuple[int, int, int, int]]:
    """(kind, offset, payload start, payload end) of every frame of a valid stream."""
    out, pos = [], 0
    while pos < len(data):
        length, start = fmt.decode_varint(data, pos + 1)
        out.append((data[pos], pos, start, start + length))
        pos = start + length + 4
    return out


def _refresh_crc(data: bytearray, frame: tuple[int, int, int, int]) -> None:
    _, offset, start, end = frame
    data[end : end + 4] = fmt._U32.pack(zlib.crc32(bytes(data[offset:end])))


def _mutants(pristine: bytes, rng: random.Random):
    frames = _frames(pristine)
    editable = [f for f in frames if f[0] != fmt.FRAME_HEADER and f[3] > f[2]]
    for _ in range(NUM_PER_KIND):  # random byte changes (1-3 bytes), anywhere
        data = bytearray(pristine)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(data))
            data[pos] ^= rng.randint(1, 255)
        yield "flip", bytes(data)
    for _ in range(NUM_PER_KIND):  # truncation at any byte (the header always survives)
        yield "truncate", pristine[: rng.randrange(frames[1][1], len(pristine))]
    for _ in range(NUM_PER_KIND):  # random bytes inserted anywhere after the header
        pos = rng.randrange(frames[1][1], len(pristine) + 1)
        yield "insert", pristine[:pos] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + pristine[pos:]
    for _ in range(NUM_PER_KIND):  # a payload byte edited and the frame checksum recomputed
        data = bytearray(pristine)
        frame = rng.choice(editable)
        pos = rng.randrange(frame[2], frame[3])
        data[pos] ^= rng.randint(1, 255)
        _refresh_crc(data, frame)
        yield "crc-recomputed", bytes(data)


def test_damaged_streams_never_compare_identical(tmp_path):
    pristine_dir, damaged_dir = tmp_path / "pristine", tmp_path / "damaged"
    _write_small_run(pristine_dir)
    path = fmt.stream_filename(0)
    pristine = (pristine_dir / path).read_bytes()
    rng = random.Random(20261201)
    outcomes: dict[str, dict[str, int]] = {}
    identical, cli_checked, total = [], 0, 0
    for kind, data in _mutants(pristine, rng):
        if data == pristine:
            continue  # an insertion can, rarely, reproduce the original bytes
        total += 1
        shutil.rmtree(damaged_dir, ignore_errors=True)
        damaged_dir.mkdir()
        (damaged_dir / path).write_bytes(data)
        try:
            verdict = str(samebits.diff(pristine_dir, damaged_dir).verdict)
        except SamebitsError as err:  # anything else is a traceback: the test fails with it
            verdict = type(err).__name__
        try:  # the damaged run as run a: the same must hold
            reverse = str(samebits.diff(damaged_dir, pristine_dir).verdict)
        except SamebitsError as err:
            reverse = type(err).__name__
        if reverse == "identical":
            identical.append((kind, len(data), "as run a"))
        outcomes.setdefault(kind, {}).setdefault(verdict, 0)
        outcomes[kind][verdict] += 1
        if verdict == "identical":
            identical.append((kind, len(data)))
        if total % (4 * NUM_PER_KIND // CLI_SAMPLE) == 0:  # the command line on a sample
            cli_checked += 1
            code = main(["diff", str(pristine_dir), str(damaged_dir)])
            assert code != 0, (kind, verdict)
            assert code == (2 if verdict not in ("diverged",) else 1), (kind, verdict, code)
    assert total >= 500 and cli_checked >= CLI_SAMPLE - 2
    assert identical == [], f"damaged streams called identical: {identical[:5]} (outcomes: {outcomes})"
    # every kind of damage was exercised and most of it is caught as damage (exit 2)
    for kind in ("flip", "truncate", "insert", "crc-recomputed"):
        assert sum(outcomes[kind].values()) >= NUM_PER_KIND - 5


def test_mutants_are_reported_as_damage_with_file_offset_and_frame(tmp_path):
    """A payload edit with a recomputed checksum is caught by the recomputed step root, and
    the message names the file, the byte offset and the frame."""
    pristine_dir, damaged_dir = tmp_path / "pristine", tmp_path / "damaged"
    _write_small_run(pristine_dir)
    path = fmt.stream_filename(0)
    data = bytearray((pristine_dir / path).read_bytes())
    step_frame = [f for f in _frames(bytes(data)) if f[0] == fmt.FRAME_STEP][2]
    data[step_frame[3] - 1] ^= 0x01  # the last byte of the last digest of step 2
    _refresh_crc(data, step_frame)
    damaged_dir.mkdir()
    (damaged_dir / path).write_bytes(bytes(data))
    with pytest.raises(SamebitsError, match=rf"rank-00000.sbs: step 2 \(the step frame at byte {step_frame[1]} "
                                            r".*stores root .* but its records hash to"):
        samebits.diff(pristine_dir, damaged_dir)
