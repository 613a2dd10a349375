"""A verdict is proof or nothing: damaged, missing, partial or empty data is never IDENTICAL,
bad input is a clear error (never a traceback), and output cannot drive the terminal."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.cli._format import escape, table
from samebits.compare import RankStep, divergent_steps
from samebits.errors import ConfigError, StreamError
from samebits.stream import _format as fmt
from samebits.stream import open_run
from samebits.verdicts import Verdict


def _frames(data: bytes):
    out, pos = [], 0
    while pos < len(data):
        length, start = fmt.decode_varint(data, pos + 1)
        out.append((data[pos], pos, start, start + length))
        pos = start + length + 4
    return out


def _rewrite_frame(data: bytes, frame, payload: bytes) -> bytes:
    """Replace one frame's payload (a valid frame: new length and checksum)."""
    kind, offset, _, end = frame
    return data[:offset] + fmt.frame(kind, payload) + data[end + 4:]


# -- stored data is never trusted --------------------------------------------------------


def test_damaged_step_is_found_even_when_the_footer_agrees(make_run, capsys):
    """The INDEX footer is not trusted: a flipped digest byte with the footer intact is
    corruption (exit 2) naming file, offset and frame, not IDENTICAL."""
    a, b = make_run(), make_run()
    path = b / "rank-00001.sbs"
    data = bytearray(path.read_bytes())
    step = [f for f in _frames(bytes(data)) if f[0] == fmt.FRAME_STEP][3]
    data[step[3] - 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert main(["diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"rank-00001.sbs: checksum mismatch in the step frame at byte {step[1]}" in err
    assert "truncated" not in err and "writer killed" not in err


def test_step_root_is_recomputed(make_run):
    """A digest edited with the frame checksum recomputed: only the stored root disagrees."""
    a, b = make_run(), make_run()
    path = b / "rank-00000.sbs"
    data = path.read_bytes()
    step = [f for f in _frames(data) if f[0] == fmt.FRAME_STEP][1]
    payload = bytearray(data[step[2]:step[3]])
    payload[-1] ^= 0x01
    path.write_bytes(_rewrite_frame(data, step, bytes(payload)))
    with pytest.raises(StreamError, match=r"step 1 \(the step frame at byte \d+ .*\) stores root .* records hash"):
        samebits.diff(a, b)


def test_damaged_length_with_data_after_it_is_corruption_not_truncation(make_run):
    a, b = make_run(), make_run()
    path = b / "rank-00000.sbs"
    data = bytearray(path.read_bytes())
    step = [f for f in _frames(bytes(data)) if f[0] == fmt.FRAME_STEP][1]
    data[step[1] + 2] |= 0x7F  # the length's high byte: now past the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(StreamError, match="runs past the end of the file although") as info:
        samebits.diff(a, b)
    assert "writer killed" not in str(info.value) and f"at byte {step[1]}" in str(info.value)


def test_edited_footer_is_corruption(make_run):
    a, b = make_run(), make_run()
    path = b / "rank-00000.sbs"
    data = path.read_bytes()
    index = [f for f in _frames(data) if f[0] == fmt.FRAME_INDEX][0]
    payload = bytearray(data[index[2]:index[3]])
    payload[-1] ^= 0x01  # the last step's frame offset
    path.write_bytes(_rewrite_frame(data, index, bytes(payload)))  # same length: CLOSE still points at it
    with pytest.raises(StreamError, match="step index .* disagrees"):
        samebits.diff(a, b)


def test_malformed_frames_with_valid_checksums_are_stream_errors(tmp_path):
    """Bytes that pass the checksum but do not parse: a StreamError naming the frame, never
    UnicodeDecodeError, struct.error, IndexError or `torch.none`."""
    with samebits.Recorder(tmp_path / "good", rank=0, world_size=1) as rec:
        rec.metrics(0, loss=1.5)
        rec.tensors(0, "params", [("w", torch.ones(2))])
    good = (tmp_path / "good" / "rank-00000.sbs").read_bytes()
    frames = _frames(good)
    names = next(f for f in frames if f[0] == fmt.FRAME_NAMES)
    step = next(f for f in frames if f[0] == fmt.FRAME_STEP)
    step_payload = good[step[2]:step[3]]

    def names_frame(*raw: bytes) -> bytes:
        body = bytearray((0, len(raw)))
        for item in raw:
            body += bytes((len(item),)) + item
        return bytes(body)

    def step_frame(records: bytes, count: int) -> bytes:
        # a consistent root, so the record parser itself must catch the damage
        hasher = fmt.new_names_hasher()
        for text in ("metrics", "loss", "params", "w"):
            hasher.update(fmt.name_bytes(text))
        return bytes((0, count)) + fmt.pack_u64(fmt.step_root(hasher.digest(), records)) + records

    metric_none = bytes((fmt.RECORD_METRIC, 4, 0, 1, 0, 0))  # metric with dtype code 0 ("none")
    short_digest = bytes((fmt.RECORD_TENSOR, 7, 2, 3, 0, 9, 0, 1, 2, 1, 2, 3))  # digest cut short
    bad_name_id = bytes((fmt.RECORD_TENSOR, 15, 2, 77, 0, 9, 0, 1, 2)) + bytes(8)
    cases = {
        "invalid utf-8 name": (names, names_frame(b"metrics", b"\xff\xfe", b"params", b"w")),
        "name past the frame": (names, bytes((0, 1, 40)) + b"abc"),
        "truncated step prefix": (step, step_payload[:5]),
        "metric of dtype none": (step, step_frame(metric_none, 1)),
        "digest cut short": (step, step_frame(short_digest, 1)),
        "unknown name id": (step, step_frame(bad_name_id, 1)),
        "fewer records than counted": (step, step_frame(b"", 3)),
    }
    for label, (frame, payload) in cases.items():
        directory = tmp_path / label.replace(" ", "_")
        directory.mkdir()
        (directory / "rank-00000.sbs").write_bytes(_rewrite_frame(good, frame, payload)[: frame[1]]
                                                   + fmt.frame(frame[0], payload))
        with pytest.raises(StreamError, match=r"rank-00000.sbs.*(byte|frame) \d+|malformed") as info:
            reader = open_run(directory).stream(0)
            for block in reader.steps():
                for record in block.records():
                    record.summary()
        assert "corrupt" in str(info.value) or "malformed" in str(info.value), label
        assert main(["dump", str(directory)]) == 2, label


def test_unambiguous_roots_names_with_nul(tmp_path):
    """phase "p" + name "x\\0y" and phase "p\\0x" + name "y" used to share a root."""
    t = torch.ones(3)
    for name, (phase, label) in (("a", ("p", "x\0y")), ("b", ("p\0x", "y"))):
        with samebits.Recorder(tmp_path / name, rank=0, world_size=1) as rec:
            rec.tensors(0, phase, [(label, t)])
    roots = [next(open_run(tmp_path / n).stream(0).steps()).root for n in "ab"]
    assert roots[0] != roots[1]
    result = samebits.diff(tmp_path / "a", tmp_path / "b", allow_config_diff=True)
    assert result.verdict is Verdict.DIVERGED


def _schema1_stream(path, digest: int) -> None:
    """A stream as samebits wrote it before schema 2 (BLAKE2b root over NUL-joined strings)."""
    header = {"schema": 1, "rank": 0, "world_size": 1, "config": {}, "coords": {}, "environment": {}}
    data = bytearray(fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(header).encode()))
    names = bytearray((0, 2))
    for text in (b"params", b"w"):
        names += bytes((len(text),)) + text
    data += fmt.frame(fmt.FRAME_NAMES, names)
    tail = bytes((0, 9, 0, 1, 3))  # occurrence, dtype float32, flags, ndim 1, size 3
    record = bytes((fmt.RECORD_TENSOR, 2 + len(tail) + 8, 0, 1)) + tail + fmt.pack_u64(digest)
    canonical = bytes((fmt.RECORD_TENSOR,)) + b"params\0w\0" + tail + fmt.pack_u64(digest)
    root = int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "little")
    data += fmt.frame(fmt.FRAME_STEP, bytes((0, 1)) + fmt.pack_u64(root) + record)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(data))


def test_schema1_streams_are_still_read_and_checked(tmp_path):
    _schema1_stream(tmp_path / "a" / "rank-00000.sbs", 1234)
    _schema1_stream(tmp_path / "b" / "rank-00000.sbs", 1235)
    (block,) = open_run(tmp_path / "a").stream(0).steps()
    assert block.schema == 1 and block.records()[0].digest == 1234
    result = samebits.diff(tmp_path / "a", tmp_path / "b")
    assert result.verdict is Verdict.DIVERGED and result.first_divergence.name == "w"
    # A schema-1 stream predates digest version 2: appending version-2 digests to it is refused
    # (its steps and the new ones could not be compared), and the stream is left as it was.
    before = (tmp_path / "a" / "rank-00000.sbs").read_bytes()
    assert open_run(tmp_path / "a").digest_version == 1
    with pytest.raises(StreamError, match="cannot append: the stream was recorded with digest version 1"):
        samebits.Recorder(tmp_path / "a", rank=0, world_size=1, append=True)
    assert (tmp_path / "a" / "rank-00000.sbs").read_bytes() == before
    # A segment of another digest version inside one stream is refused by the reader too.
    _schema1_stream(tmp_path / "c" / "rank-00000.sbs", 1234)
    path = tmp_path / "c" / "rank-00000.sbs"
    header = {"schema": 2, "digest_version": 2, "rank": 0, "world_size": 1, "config": {}, "coords": {},
              "environment": {}}
    path.write_bytes(path.read_bytes() + fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(header).encode()))
    with pytest.raises(StreamError, match="has digest version 2, appended to a stream of digest version 1"):
        list(open_run(tmp_path / "c").stream(0).steps())


# -- steps, names and tensors the Recorder refuses -----------------------------------------


@pytest.mark.parametrize("step", [-1, 2**63, 2**64, 1.5, True, "3"])
def test_out_of_range_steps_are_refused_at_record_time(tmp_path, step):
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        with pytest.raises(ConfigError, match="step"):
            rec.tensors(step, "params", [("w", torch.ones(2))])
        with pytest.raises(ConfigError, match="step"):
            rec.metrics(step, loss=1.0)
        rec.metrics(2**63 - 1, loss=1.0)  # the largest step reads back
    (block,) = open_run(tmp_path).stream(0).steps()
    assert block.step == 2**63 - 1


def test_bad_tensors_and_names_are_clear_errors_and_leave_the_step_intact(tmp_path):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        rec.tensors(0, "params", [("w", torch.ones(2))])
        with pytest.raises(ConfigError, match="'n' is a nested tensor"):
            rec.tensors(0, "params", [("x", torch.ones(2)), ("n", nested)])
        with pytest.raises(ConfigError, match="cannot be stored as utf-8"):
            rec.tensors(0, "params", [("\ud800", torch.ones(2))])
        with pytest.raises(ConfigError, match="does not fit in int64"):
            rec.metrics(0, tokens=2**70)
        with pytest.raises(ConfigError, match="nested"):
            rec.metrics(0, loss=nested)
    (block,) = open_run(tmp_path).stream(0).steps()
    assert [r.name for r in block.records()] == ["w"]  # nothing half-recorded


# -- missing, partial and empty data -------------------------------------------------------


def test_missing_rank_file_is_not_identical(make_run, capsys):
    a, b = make_run(), make_run()
    (b / "rank-00001.sbs").unlink()
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.INCOMPLETE and "no stream for rank 1" in result.incomplete[0]
    assert main(["diff", str(a), str(b)]) == 2
    assert "INCOMPLETE" in capsys.readouterr().out
    (a / "rank-00001.sbs").unlink()  # missing in both, never selected out: still missing data
    assert samebits.diff(a, b).verdict is Verdict.INCOMPLETE


def test_ranks_filtered_out_on_purpose_are_not_missing(tmp_path, monkeypatch):
    from conftest import write_run

    monkeypatch.setenv("SAMEBITS_RANKS", "0")
    write_run(tmp_path / "a")
    write_run(tmp_path / "b")
    assert samebits.diff(tmp_path / "a", tmp_path / "b").verdict is Verdict.IDENTICAL


def test_window_with_nothing_to_compare(make_run, capsys):
    a, b = make_run(), make_run()
    result = samebits.diff(a, b, start_step=50)
    assert result.verdict is Verdict.INCOMPLETE and "nothing to compare" in result.incomplete[0]
    assert main(["diff", str(a), str(b), "--from-step", "50"]) == 2
    assert main(["diff", str(a), str(b), "--from-step", "3", "--to-step", "2"]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="nothing to compare"):
        samebits.diff(a, b, start_step=3, stop_step=3)


def test_killed_writer_with_equal_steps_is_incomplete(make_run):
    a, b = make_run(), make_run()
    path = b / "rank-00000.sbs"
    data = path.read_bytes()
    index = [f for f in _frames(data) if f[0] == fmt.FRAME_INDEX][0]
    path.write_bytes(data[: index[1]])  # every step there, no footer: the writer never finished
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.INCOMPLETE and "did not finish" in result.incomplete[0]
    assert samebits.diff(a, b, stop_step=3).verdict is Verdict.IDENTICAL  # the window was covered


def test_verdict_enum_and_divergent_steps(make_run):
    a, b = make_run(), make_run(plant=(3, 1, "grads", "layer2.weight"))
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.DIVERGED and result.verdict == "diverged"
    assert result.to_dict()["verdict"] == "diverged" and result.to_dict()["exit_code"] == 1
    found = list(divergent_steps(a, b))
    assert [(r.rank, r.step) for r in found] == [(1, 3)] and isinstance(found[0], RankStep)
    differing = [(x.name, y.name) for x, y in zip(found[0].records_a, found[0].records_b) if not x.same_content(y)]
    assert differing == [("layer2.weight", "layer2.weight")]
    assert list(divergent_steps(a, b, stop_step=3)) == []
    ended = list(divergent_steps(a, make_run(stop_after=(0, 1))))
    assert [(r.rank, r.step, r.missing, r.records_b) for r in ended] == [(0, 2, "b", [])]


# -- one writer per stream -----------------------------------------------------------------


def test_second_writer_in_another_process_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, torch, samebits
        rec = samebits.Recorder({str(tmp_path)!r}, rank=0, world_size=1)
        rec.tensors(0, "params", [("w", torch.ones(2))])
        rec.end_step(0)
        print("ready", flush=True)
        sys.stdin.readline()
        rec.tensors(1, "params", [("w", torch.ones(2))])
        rec.close()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        second = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import torch, samebits
            rec = samebits.Recorder({str(tmp_path)!r}, rank=0, world_size=1, append=True)
        """)], capture_output=True, text=True)
        assert second.returncode != 0
        assert "StreamError" in second.stderr and "rank-00000.sbs is being written by another Recorder" in second.stderr
        assert f"pid {holder.pid}" in second.stderr
    finally:
        holder.communicate("go\n", timeout=60)
    assert holder.returncode == 0
    steps = [b.step for b in open_run(tmp_path).stream(0).steps()]
    assert steps == [0, 1]
    with samebits.Recorder(tmp_path, rank=0, world_size=1, append=True) as rec:  # free again
        rec.metrics(2, loss=1.0)


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    first = samebits.Recorder(tmp_path, rank=0, world_size=1)
    with pytest.raises(StreamError, match="being written by another Recorder"):
        samebits.Recorder(tmp_path, rank=0, world_size=1, append=True)
    first.close()


# -- terminal safety and tracebacks --------------------------------------------------------


def test_escape_and_table_neutralise_control_characters():
    assert escape("a\x1b[2Kb\rc\u202e") == "a\\x1b[2Kb\\x0dc\\u202e"
    assert escape("two\nlines", keep_newlines=True) == "two\nlines"
    assert "\x1b" not in table(["name"], [["\x1b[1A\x1b[2KIDENTICAL"]])


def test_hostile_names_cannot_rewrite_the_verdict(tmp_path, capsys):
    evil = "w\x1b[1A\x1b[2K\rIDENTICAL: bit for bit."
    for name, value in (("a", 1.0), ("b", 2.0)):
        with samebits.Recorder(tmp_path / name, rank=0, world_size=1, config={"note": "\x1b[31m"}) as rec:
            rec.tensors(0, "params\x07", [(evil, torch.full((2,), value))])
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "DIVERGED" in out
    for command in (["show", str(tmp_path / "a")], ["dump", str(tmp_path / "a")]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\\x1b" in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first_divergence"]["name"] == evil  # JSON stays exact


def test_permission_denied_is_a_clear_error(make_run, monkeypatch, capsys):
    a, b = make_run(), make_run()
    real_open = builtins.open

    def refusing_open(path, *args, **kwargs):
        if str(path).endswith("rank-00001.sbs") and str(b) in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    real_os_open = os.open

    def refusing_os_open(path, *args, **kwargs):  # the reader opens with os.open (O_NONBLOCK)
        if str(path).endswith("rank-00001.sbs") and str(b) in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    monkeypatch.setattr(os, "open", refusing_os_open)
    assert main(["diff", str(a), str(b)]) == 2
    assert "permission denied" in capsys.readouterr().err


def test_dump_into_a_closed_pipe_has_no_traceback(tmp_path):
    with samebits.Recorder(tmp_path, rank=0, world_size=1) as rec:
        for step in range(4):
            rec.tensors(step, "params", [(f"model.layers.{i}.weight", torch.ones(2)) for i in range(600)])
    proc = subprocess.Popen([sys.executable, "-m", "samebits", "dump", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
    assert proc.returncode != 0



def test_a_huge_claimed_world_is_reported_without_walking_it(tmp_path):
    for name in "ab":
        with samebits.Recorder(tmp_path / name, rank=0, world_size=10**12) as rec:
            rec.metrics(0, loss=1.0)
    result = samebits.diff(tmp_path / "a", tmp_path / "b")
    assert result.verdict is Verdict.INCOMPLETE
    assert "neither run has a stream for 999999999999 rank(s) of world size 1000000000000 (1, 2, 3" \
        in result.incomplete[0]


def _with_longer_header(source, target, shift_offsets_by=0):
    """``source``'s stream with a longer header (an extra environment note): every frame after
    it moves, so the footer's offsets are rebuilt (``shift_offsets_by`` damages them)."""
    data = source.read_bytes()
    frames = _frames(data)
    header = json.loads(data[frames[0][2] + len(fmt.MAGIC):frames[0][3]])
    header["environment"]["note"] = "a longer header"
    head = fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(header).encode())
    shift = len(head) - (frames[0][3] + 4)
    index = next(f for f in frames if f[0] == fmt.FRAME_INDEX)
    entries = open_run(source.parent).stream(0).step_index()
    footer = bytearray()
    fmt.encode_varint(len(entries), footer)
    for step, count, root, offset in entries:
        fmt.encode_varint(step, footer)
        fmt.encode_varint(count, footer)
        footer += fmt.pack_u64(root)
        fmt.encode_varint(offset + shift + shift_offsets_by, footer)
    body = data[frames[1][1]:index[1]]
    index_offset = len(head) + len(body)
    target.parent.mkdir(parents=True)
    target.write_bytes(head + body + fmt.frame(fmt.FRAME_INDEX, footer)
                       + fmt.frame(fmt.FRAME_CLOSE, fmt.pack_u64(index_offset) + fmt.CLOSE_MAGIC))


def test_byte_equal_streams_with_headers_of_other_lengths(tmp_path):
    """Streams equal after their headers are verified once; the second one's own footer
    offsets are still checked."""
    with samebits.Recorder(tmp_path / "a", rank=0, world_size=1) as rec:
        for step in range(3):
            rec.tensors(step, "params", [("w", torch.full((3,), float(step)))])
    source = tmp_path / "a" / "rank-00000.sbs"
    _with_longer_header(source, tmp_path / "b" / "rank-00000.sbs")
    result = samebits.diff(tmp_path / "a", tmp_path / "b")
    assert result.verdict is Verdict.IDENTICAL and result.compared["steps"] == 3
    _with_longer_header(source, tmp_path / "c" / "rank-00000.sbs", shift_offsets_by=1)
    with pytest.raises(StreamError, match="step index .* disagrees"):
        samebits.diff(tmp_path / "a", tmp_path / "c")
    with pytest.raises(StreamError, match="step index .* disagrees"):
        list(open_run(tmp_path / "c").stream(0).steps())


def test_the_reader_refuses_a_fifo_without_blocking(tmp_path):
    """A FIFO in place of a stream is refused by the reader itself (library callers too), at
    once: the open does not wait for a writer."""
    import os

    import pytest

    from samebits.errors import StreamError
    from samebits.stream import StreamReader

    fifo = tmp_path / "rank-00000.sbs"
    os.mkfifo(fifo)
    with pytest.raises(StreamError, match="not a regular file \\(a FIFO\\)"):
        StreamReader(fifo)
    with pytest.raises(StreamError, match="a directory"):
        StreamReader(tmp_path)
