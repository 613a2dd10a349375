"""Fingerprint streams: header, ordering, occurrences, crash safety, size, controls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import samebits
from samebits.errors import StreamError
from samebits.stream import StreamReader, open_run


def test_round_trip_records_and_header(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with samebits.Recorder(tmp_path, rank=0, world_size=1, config={"lr": 0.5},
                           coords={"dp": 0, "tp": 0}) as rec:
        rec.metrics(0, loss=2.5, lm_loss=torch.tensor(1.25, dtype=torch.bfloat16), tokens=7)
        rec.tensors(0, "params", [("w", t), ("w", t + 1), ("g", None)])
    reader = open_run(tmp_path).stream(0)
    header = reader.header
    assert header.schema == 2 and header.rank == 0 and header.world_size == 1
    assert header.coords == {"dp": 0, "tp": 0} and header.config == {"lr": 0.5}
    assert header.environment["torch"] == torch.__version__
    (block,) = list(reader.steps())
    records = block.records()
    assert [(r.kind, r.phase, r.name, r.occurrence) for r in records] == [
        ("metric", "metrics", "loss", 0), ("metric", "metrics", "lm_loss", 0), ("metric", "metrics", "tokens", 0),
        ("tensor", "params", "w", 0), ("tensor", "params", "w", 1), ("tensor", "params", "g", 0),
    ]
    assert records[0].value == 2.5 and records[0].dtype == "float64"
    assert records[1].value == 1.25 and records[1].dtype == "bfloat16" and len(records[1].raw) == 2
    assert records[2].value == 7
    assert records[3].digest == samebits.digest(t) and records[3].shape == (3, 4)
    assert records[4].digest == samebits.digest(t + 1)
    assert records[5].absent and records[5].digest is None
    assert reader.closed_cleanly is False or reader.stop_reason is None


def test_metric_bits_are_exact(tmp_path):
    value = 0.1 + 0.2  # not representable by a short print
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        rec.metrics(0, loss=value, neg_zero=-0.0)
    (block,) = list(open_run(tmp_path).stream(0).steps())
    loss, neg_zero = block.records()
    assert loss.value == value and loss.raw == torch.tensor([value], dtype=torch.float64).numpy().tobytes()
    assert str(neg_zero.value) == "-0.0"


def test_step_root_equal_for_equal_steps_and_differs_otherwise(tmp_path):
    for name, bump in (("a", 0.0), ("b", 0.0), ("c", 1e-3)):
        with samebits.Recorder(tmp_path / name, rank=0, world_size=1) as rec:
            for step in range(3):
                rec.tensors(step, "params", [("w", torch.ones(4) * step + (bump if step == 2 else 0))])
    roots = {n: [b.root for b in open_run(tmp_path / n).stream(0).steps()] for n in "abc"}
    assert roots["a"] == roots["b"]
    assert roots["a"][:2] == roots["c"][:2] and roots["a"][2] != roots["c"][2]


def test_existing_stream_is_never_overwritten(tmp_path):
    samebits.Recorder(tmp_path, rank=0, world_size=1).close()
    with pytest.raises(StreamError, match="never overwrites"):
        samebits.Recorder(tmp_path, rank=0, world_size=1)


def test_append_continues_a_stream_as_a_new_segment(tmp_path):
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        rec.tensors(0, "params", [("w", torch.ones(3))])
    with samebits.Recorder(tmp_path, rank=0, world_size=1, append=True) as rec:
        rec.tensors(1, "params", [("w", torch.ones(3) * 2), ("new", torch.zeros(2))])
        with pytest.raises(ValueError, match="steps must not decrease"):
            rec.tensors(0, "params", [("w", torch.ones(3))])
    reader = open_run(tmp_path).stream(0)
    blocks = list(reader.steps())
    assert [b.step for b in blocks] == [0, 1] and reader.num_segments == 2
    assert [r.name for r in blocks[1].records()] == ["w", "new"]
    with pytest.raises(ValueError, match="already written"):
        with samebits.Recorder(tmp_path, rank=0, world_size=1, append=True) as rec:
            rec.tensors(1, "params", [("w", torch.ones(3))])


def test_appending_to_a_torn_stream_warns_at_the_recorders_caller(tmp_path):
    """The warning that a torn last frame is dropped points at the line that made the Recorder,
    and the step times' warning too, not at samebits' own files."""
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        rec.tensors(0, "params", [("w", torch.ones(3))])
    path = tmp_path / "rank-00000.sbs"
    path.write_bytes(path.read_bytes()[:-3])  # a killed writer: the close frame torn
    with pytest.warns(UserWarning, match="torn frame is dropped") as caught:
        samebits.Recorder(tmp_path, rank=0, world_size=1, append=True).close()
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    steptimes = tmp_path / "rank-00000.steptimes"
    steptimes.unlink()
    steptimes.mkdir()  # cannot be opened for appending
    with pytest.warns(UserWarning, match="cannot write step times") as caught:
        samebits.Recorder(tmp_path, rank=0, world_size=1, append=True).close()
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def _write_steps(directory, num_steps, num_tensors=3):
    with samebits.Recorder(directory, rank=0, world_size=1) as rec:
        for step in range(num_steps):
            rec.metrics(step, loss=float(step))
            rec.tensors(step, "params", [(f"w{i}", torch.full((4,), float(step + i))) for i in range(num_tensors)])


def test_every_truncation_point_reads_back_complete_steps(tmp_path):
    """A writer killed at any byte leaves a stream whose complete frames all read back."""
    _write_steps(tmp_path / "full", 4)
    full = (tmp_path / "full" / "rank-00000.sbs").read_bytes()
    full_steps = [b.step for b in StreamReader(tmp_path / "full" / "rank-00000.sbs").steps()]
    header_end = StreamReader(tmp_path / "full" / "rank-00000.sbs").end_offset
    cut = tmp_path / "cut"
    cut.mkdir()
    path = cut / "rank-00000.sbs"
    for size in range(header_end, len(full)):
        path.write_bytes(full[:size])
        reader = StreamReader(path)
        steps = [b.step for b in reader.steps()]
        assert steps == full_steps[: len(steps)]
        assert reader.stop_reason is not None, size
        for block in list(StreamReader(path).steps()):
            block.records()  # every step that is listed decodes


def test_sigkill_mid_write_leaves_readable_stream(tmp_path):
    script = textwrap.dedent(f"""
        import torch, samebits, sys
        rec = samebits.Recorder({str(tmp_path)!r}, rank=0, world_size=1)
        step = 0
        while True:
            rec.tensors(step, "params", [("w%d" % i, torch.full((64,), float(step))) for i in range(50)])
            rec.end_step(step)
            if step == 3:
                print("ready", flush=True)
            step += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader = open_run(tmp_path).stream(0)
    blocks = list(reader.steps())
    assert len(blocks) >= 4 and [b.step for b in blocks] == list(range(len(blocks)))
    assert all(len(b.records()) == 50 for b in blocks)
    assert reader.stop_reason is not None and not reader.closed_cleanly


def test_corrupt_stream_names_file_and_offset(tmp_path):
    _write_steps(tmp_path, 3)
    path = tmp_path / "rank-00000.sbs"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StreamError, match=r"rank-00000.sbs: checksum mismatch .* at byte \d+"):
        list(StreamReader(path).steps())


def test_other_schema_version_is_refused(tmp_path, monkeypatch):
    from samebits.stream import _format

    monkeypatch.setattr(_format, "SCHEMA_VERSION", 99)
    samebits.Recorder(tmp_path, rank=0, world_size=1).close()
    monkeypatch.undo()
    with pytest.raises(StreamError, match="schema version 99"):
        open_run(tmp_path)


def test_the_header_formats_back_to_the_bytes_written(tmp_path):
    """`StreamHeader` parses a header once and writes it back key for key (the name filters
    included, a newer writer's unknown key kept)."""
    from samebits.stream import StreamHeader
    from samebits.stream import _format

    with samebits.Recorder(tmp_path, rank=0, world_size=1, config={"lr": 0.5}, include=["metrics/*"]) as rec:
        rec.metrics(0, loss=1.0)
    data = (tmp_path / "rank-00000.sbs").read_bytes()
    length, start = _format.decode_varint(data, 1)
    payload = data[start : start + length]
    header = StreamHeader.from_payload(payload, "the header")
    assert header.payload() == payload and header == open_run(tmp_path).header
    assert header.include == ["metrics/*"] and header.exclude == [] and header.segment == 0
    newer = StreamHeader.read({**header.to_dict(), "from_the_future": [1]}, "a header")
    assert newer.extra == {"from_the_future": [1]} and newer.to_dict()["from_the_future"] == [1]


@pytest.mark.parametrize("field, value, problem", [
    ("run_id", 5, r"run_id = 5 is not str or None"),
    ("segment", -1, r"segment = -1 is below 0"),
    ("max_tensor_bytes", "64", r"max_tensor_bytes = '64' is not int or None"),
    ("rank", None, r"rank is missing"),
])
def test_a_header_field_missing_or_of_a_wrong_type_is_refused_by_name(tmp_path, field, value, problem):
    import json

    from samebits.stream import _format

    header = {"schema": 2, "rank": 0, "world_size": 1, field: value}
    if value is None:
        del header[field]
    (tmp_path / "rank-00000.sbs").write_bytes(
        _format.frame(_format.FRAME_HEADER, _format.MAGIC + json.dumps(header).encode()))
    with pytest.raises(StreamError, match=rf"rank-00000\.sbs: header at byte 0 is invalid \({problem}"):
        open_run(tmp_path)


def test_not_a_stream(tmp_path):
    (tmp_path / "rank-00000.sbs").write_bytes(b"hello world, not a stream")
    with pytest.raises(StreamError, match="not a samebits stream"):
        open_run(tmp_path)
    with pytest.raises(StreamError, match="no such run directory"):
        open_run(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StreamError, match="no fingerprint streams"):
        open_run(empty)


def test_compact_tensor_records(tmp_path):
    """At most 40 bytes per tensor record on average at scale (names interned once)."""
    names = [f"model.layers.{i}.mlp.experts.{j}.weight" for i in range(30) for j in range(20)]
    tensor = torch.ones(128, 64)
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        for step in range(20):
            rec.tensors(step, "params", [(n, tensor) for n in names])
    size = (tmp_path / "rank-00000.sbs").stat().st_size
    assert size / (20 * len(names)) <= 40


def test_controls_window_ranks_cap_and_off(tmp_path, monkeypatch):
    t = torch.ones(100)
    with samebits.Recorder(tmp_path / "w", rank=0, world_size=1, steps="2:4", max_tensor_bytes=100) as rec:
        for step in range(6):
            rec.tensors(step, "p", [("big", t), ("small", t[:10])])
    blocks = list(open_run(tmp_path / "w").stream(0).steps())
    assert [b.step for b in blocks] == [2, 3]
    big, small = blocks[0].records()
    assert big.capped and big.digest is None and big.shape == (100,) and not small.capped
    with samebits.Recorder(tmp_path / "ph", rank=0, world_size=1, phases="params") as rec:
        rec.metrics(0, loss=1.0)
        rec.tensors(0, "grads", [("x", t)])
        rec.tensors(0, "params", [("x", t)])
    (block,) = open_run(tmp_path / "ph").stream(0).steps()
    assert [(r.phase, r.name) for r in block.records()] == [("params", "x")]
    monkeypatch.setenv("SAMEBITS_RANKS", "1")
    rec = samebits.Recorder(tmp_path / "r", rank=0, world_size=2)
    rec.tensors(0, "p", [("x", t)])
    rec.close()
    assert not (tmp_path / "r").exists()
    monkeypatch.delenv("SAMEBITS_RANKS")
    monkeypatch.setenv("SAMEBITS_DISABLE", "1")
    monkeypatch.setenv("SAMEBITS_DIR", str(tmp_path / "off"))
    rec = samebits.Recorder()
    rec.tensors(0, "p", [("x", t)])
    rec.close()
    assert not (tmp_path / "off").exists()


def test_env_settings_are_validated(monkeypatch, tmp_path):
    monkeypatch.setenv("SAMEBITS_STEPS", "ten")
    with pytest.raises(ValueError, match="SAMEBITS_STEPS='ten' is not a step window"):
        samebits.Recorder(tmp_path, rank=0, world_size=1)
    monkeypatch.delenv("SAMEBITS_STEPS")
    with pytest.raises(ValueError, match="needs a directory"):
        samebits.Recorder(rank=0, world_size=1)


def test_bounded_flushing(tmp_path):
    rec = samebits.Recorder(tmp_path, rank=0, world_size=1, flush_every=2)
    path = tmp_path / "rank-00000.sbs"
    sizes = []
    for step in range(4):
        rec.tensors(step, "p", [("x", torch.ones(3))])
        rec.end_step(step)
        sizes.append(path.stat().st_size)
    rec.close()
    assert sizes[0] == sizes[-4] and sizes[1] > sizes[0] and sizes[2] == sizes[1] and sizes[3] > sizes[2]


def test_live_reference_check(tmp_path):
    _write_steps(tmp_path / "ref", 3)
    results = []
    with samebits.Recorder(tmp_path / "live", rank=0, world_size=1, reference=tmp_path / "ref") as rec:
        for step in range(4):
            rec.metrics(step, loss=float(step) + (0.5 if step == 2 else 0.0))
            rec.tensors(step, "params", [(f"w{i}", torch.full((4,), float(step + i))) for i in range(3)])
            results.append(rec.end_step(step))
    assert results == [True, True, False, None]
