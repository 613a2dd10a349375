"""Trust, round 3 (issue 25, and issue 24's order-only differences): a record whose value was
never compared is never counted as compared; the rank files of two runs in one folder are
refused; an honest writer (a forked child, a resume of another world size) cannot wreck its
own stream; a stream's edge cases (a repeated identity, an unknown record kind, an edited
schema, steps out of order, a dropped frame, another recording window, a live writer, a
crafted torn tail) are damage or INCOMPLETE, never a verdict they do not prove; equal records
in another order are reported as such, also when the live check stopped the run there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.errors import ConfigError, StreamError
from samebits.stream import _format as fmt
from samebits.stream import _files as stream_files
from samebits.verdicts import Verdict

RANK0 = fmt.stream_filename(0)


# -- helpers --------------------------------------------------------------------------------


def _record(directory, *, world_size=1, steps=4, bump=None, order=None, cap=None, window=None, close=True,
            run_id=None, names=("layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight"), **kwargs):
    """A small run: per step a loss and four params.  ``bump=(step, name)`` changes one value
    from that step on; ``order``: the params' order at every step (a list of names)."""
    recorders = []
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(rank)
        params = {name: torch.randn(3, 4, generator=gen) for name in names}
        rec = samebits.Recorder(directory, rank=rank, world_size=world_size, config={"lr": 0.1},
                                max_tensor_bytes=cap, steps=window, run_id=run_id, **kwargs)
        for step in range(steps):
            values = dict(params)
            if bump is not None and step >= bump[0]:
                values[bump[1]] = values[bump[1]] + 1.0
            rec.metrics(step, loss=float(sum(v.sum() for v in values.values())))
            listed = [(name, values[name]) for name in (order or names)]
            rec.tensors(step, "params", listed)
            rec.end_step(step)
            params = {n: p * 0.5 for n, p in params.items()}
        if close:
            rec.close()
        recorders.append(rec)
    return recorders


def _frames(data: bytes) -> list[tuple[int, int, int, int]]:
    """(kind, offset, payload start, payload end) of every frame of a valid stream."""
    out, pos = [], 0
    while pos < len(data):
        length, start = fmt.decode_varint(data, pos + 1)
        out.append((data[pos], pos, start, start + length))
        pos = start + length + 4
    return out


def _split_records(body: bytes) -> list[bytes]:
    records, pos = [], 0
    while pos < len(body):
        length, start = fmt.decode_varint(body, pos + 1)
        records.append(body[pos : start + length])
        pos = start + length
    return records


def _rewrite(path: Path, edit, *, header=None) -> None:
    """Re-encode a closed stream with ``edit(step, records) -> records`` applied to each step
    (records as stored bytes; None drops the step) and ``header(dict) -> dict`` to its first
    header: every checksum, step root, the index and the close frame recomputed, so that only
    the reader's structural checks can tell (a forgery, not bit rot)."""
    data = path.read_bytes()
    out = bytearray()
    names_hasher = fmt.new_names_hasher()
    index = []
    for kind, offset, start, end in _frames(data):
        payload = data[start:end]
        if kind == fmt.FRAME_HEADER and header is not None and offset == 0:
            payload = fmt.MAGIC + json.dumps(header(json.loads(payload[len(fmt.MAGIC):]))).encode()
        elif kind == fmt.FRAME_NAMES:
            first, pos = fmt.decode_varint(payload, 0)
            _, pos = fmt.decode_varint(payload, pos)
            names_hasher.update(payload[pos:])
        elif kind == fmt.FRAME_STEP:
            step, pos = fmt.decode_varint(payload, 0)
            _, pos = fmt.decode_varint(payload, pos)
            records = edit(step, _split_records(payload[pos + 8 :]))
            if records is None:
                continue
            body = b"".join(records)
            root = fmt.step_root(names_hasher.digest(), body)
            prefix = bytearray()
            fmt.encode_varint(step, prefix)
            fmt.encode_varint(len(records), prefix)
            payload = bytes(prefix) + fmt.pack_u64(root) + body
            index.append((step, len(records), root, len(out)))
        elif kind == fmt.FRAME_INDEX:
            entries = bytearray()
            fmt.encode_varint(len(index), entries)
            for step, count, root, at in index:
                fmt.encode_varint(step, entries)
                fmt.encode_varint(count, entries)
                entries += fmt.pack_u64(root)
                fmt.encode_varint(at, entries)
            index_at = len(out)
            payload = bytes(entries)
        elif kind == fmt.FRAME_CLOSE:
            payload = fmt.pack_u64(index_at) + fmt.CLOSE_MAGIC
        out += fmt.frame(kind, payload)
    path.write_bytes(bytes(out))


def _both_orders(a, b):
    """The verdict (or error type) of diff(a, b) and diff(b, a)."""
    results = []
    for x, y in ((a, b), (b, a)):
        try:
            results.append(samebits.diff(x, y))
        except StreamError as err:
            results.append(err)
    return results


# -- 1. values never compared ---------------------------------------------------------------


def test_capped_records_are_compared_by_shape_only_and_never_identical(tmp_path, capsys):
    """Two runs whose params differ in value but are over the size cap: no digest, so nothing
    says they are equal.  (Before: IDENTICAL, exit 0.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, cap=1)
    _record(b, cap=1, bump=(0, "layer1.weight"))
    # the loss differs too: leave it out, so that only capped records are left to compare
    for run in (a, b):
        _rewrite(run / RANK0, lambda step, records: records[1:])
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.INCOMPLETE, result.to_dict()
    assert result.compared["records_shape_only"] == 16 and result.compared["records"] == 0
    reason = " ".join(result.incomplete)
    assert "16 record(s) were compared by shape and dtype only" in reason
    assert "max_tensor_bytes 1" in reason and "--max-tensor-bytes" in reason and "SAMEBITS_MAX_TENSOR_BYTES" in reason
    assert "rank 0 step 0 params/layer0.weight" in reason
    assert main(["diff", str(a), str(b)]) == 2
    assert "compared by shape and dtype only" in capsys.readouterr().out
    # equal bytes (the byte-equal twin path) prove no more
    c = tmp_path / "c"
    shutil.copytree(a, c)
    assert samebits.diff(a, c).verdict is Verdict.INCOMPLETE


def test_a_cap_on_one_side_only_is_not_a_divergence_and_not_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a)
    _record(b, cap=40)  # 3x4 fp32 = 48 bytes: every param capped in b
    for x, y in ((a, b), (b, a)):
        result = samebits.diff(x, y)
        assert result.verdict is Verdict.INCOMPLETE and result.compared["records_shape_only"] == 16
        assert result.compared["records"] == 4  # the losses


def test_a_divergence_beside_capped_records_is_still_proof(tmp_path):
    """Every param is capped, but the loss (a metric: never capped) differs from step 2."""
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, cap=40)
    _record(b, cap=40, bump=(2, "layer1.weight"))
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.DIVERGED and result.first_divergence.step == 2
    assert result.first_divergence.name == "loss"
    assert any("compared by shape and dtype only" in note for note in result.notes)


def test_non_positive_caps_are_refused(tmp_path, monkeypatch):
    for cap in (0, -1):
        with pytest.raises(ConfigError, match=rf"max_tensor_bytes={cap}: the size cap is a positive number"):
            samebits.Recorder(tmp_path / "x", rank=0, world_size=1, max_tensor_bytes=cap)
    monkeypatch.setenv("SAMEBITS_MAX_TENSOR_BYTES", "-1")
    with pytest.raises(ConfigError, match=r"SAMEBITS_MAX_TENSOR_BYTES=-1"):
        samebits.Recorder(tmp_path / "y", rank=0, world_size=1)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").glob("*.sbs"))
    monkeypatch.delenv("SAMEBITS_MAX_TENSOR_BYTES")
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_info:
            main(["run", "--out", str(tmp_path / "z"), "--max-tensor-bytes", value, "--", sys.executable, "-c", "0"])
        assert exit_info.value.code == 2
    assert not (tmp_path / "z").exists()


# -- 2. two runs in one folder ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["launcher", "directory"])
def test_rank_files_of_two_runs_in_one_folder_are_refused(tmp_path, monkeypatch, capsys, how):
    runs = {}
    for name in ("a", "b", "c"):
        if how == "launcher":  # as under torchrun: every rank of one run shares TORCHELASTIC_RUN_ID
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"job-{name}")
        _record(tmp_path / name, world_size=2)
        runs[name] = tmp_path / name
    assert samebits.diff(runs["a"], runs["b"]).verdict is Verdict.IDENTICAL
    mixed = tmp_path / "m"
    mixed.mkdir()
    shutil.copy(runs["c"] / fmt.stream_filename(0), mixed)
    shutil.copy(runs["b"] / fmt.stream_filename(1), mixed)
    for x, y in ((runs["a"], mixed), (mixed, runs["a"])):
        with pytest.raises(StreamError, match=r"the rank files come from different runs .*rank-00000\.sbs.*"
                                              r"rank-00001\.sbs"):
            samebits.diff(x, y)
    assert main(["show", str(mixed)]) == 2
    assert "come from different runs" in capsys.readouterr().err


def test_the_ranks_of_one_run_agree_on_its_id(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SAMEBITS_RUN_ID", raising=False)

    def ids(directory):
        run = samebits.open_run(directory)
        return {(h.run_id, h.run_id_source) for h in run.headers.values()}

    _record(tmp_path / "d", world_size=3)  # ranks in one directory: its id file
    (found,) = ids(tmp_path / "d")
    assert found[1] == "directory" and (tmp_path / "d" / stream_files.RUN_ID_FILE).read_text().strip() == found[0]
    monkeypatch.setenv("SAMEBITS_RUN_ID", "exp-7")
    _record(tmp_path / "e", world_size=2)
    assert ids(tmp_path / "e") == {("exp-7", "SAMEBITS_RUN_ID")}
    monkeypatch.delenv("SAMEBITS_RUN_ID")
    # a process group: the first rank to ask sets the id in the group's store
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _record(tmp_path / "g")
        _record(tmp_path / "h")
        assert ids(tmp_path / "g") == ids(tmp_path / "h") and next(iter(ids(tmp_path / "g")))[1] == "process group"
    finally:
        dist.destroy_process_group()
    # a resumed run keeps the id of the stream it appends to, and gives it to a new stream beside it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first")
    _record(tmp_path / "r", world_size=2)
    os.remove(tmp_path / "r" / fmt.stream_filename(1))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "resumed")
    for rank in (0, 1):
        with samebits.Recorder(tmp_path / "r", rank=rank, world_size=2, append=True, config={"lr": 0.1}) as rec:
            rec.metrics(10, loss=1.0)
    run = samebits.open_run(tmp_path / "r")
    assert {h.run_id for h in run.headers.values()} == {"first"}
    reader = run.stream(0)
    list(reader.steps())
    assert [s.run_id for s in reader.segments] == ["first", "first"]


def test_ids_that_prove_nothing_are_not_refused(tmp_path, monkeypatch):
    """Streams whose ids were chosen per process (no launcher, no group, no shared directory;
    or written before the source was recorded) cannot be told apart by id: read as before."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(stream_files, "_directory_run_id", lambda directory, fresh: None)
    _record(tmp_path / "a", world_size=2)
    run = samebits.open_run(tmp_path / "a")
    assert len({h.run_id for h in run.headers.values()}) == 2
    assert {h.run_id_source for h in run.headers.values()} == {"random"}
    for rank in (0, 1):  # as written before `run_id_source` existed
        _rewrite(tmp_path / "a" / fmt.stream_filename(rank), lambda s, r: r,
                 header=lambda h: {k: v for k, v in h.items() if k != "run_id_source"})
    _record(tmp_path / "b", world_size=2)
    assert samebits.diff(tmp_path / "a", tmp_path / "b").verdict is Verdict.IDENTICAL


# -- 3. an honest writer wrecks its own stream -------------------------------------------------


def test_a_forked_child_never_touches_its_parents_stream(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, torch, samebits
        from samebits.errors import StreamError
        rec = samebits.Recorder({str(tmp_path)!r}, rank=0, world_size=1)
        rec.tensors(0, "params", [("w", torch.ones(3))])
        rec.end_step(0)
        pid = os.fork()
        if pid == 0:  # the child: writing is refused; exiting normally runs the exit-time close
            rec.tensors(1, "params", [("w", torch.zeros(3))])
            try:
                rec.end_step(1)
                print("child wrote", flush=True)
            except StreamError as err:
                print("refused:", err, flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        rec.tensors(1, "params", [("w", torch.ones(3) * 2)])
        rec.end_step(1)
        rec.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "a forked child never writes its parent's stream" in done.stdout
    reader = samebits.open_run(tmp_path).stream(0)
    blocks = list(reader.steps())
    assert [b.step for b in blocks] == [0, 1] and reader.closed_cleanly and reader.num_segments == 1
    assert blocks[1].records()[0].digest is not None
    assert not (tmp_path / ".rank-00000.sbs.lock").exists()


def test_append_refuses_another_world_size_before_writing_a_byte(tmp_path):
    _record(tmp_path, world_size=2)
    path = tmp_path / fmt.stream_filename(0)
    before = path.read_bytes()
    with pytest.raises(StreamError, match=r"cannot append: the stream was recorded by rank 0 of world size 2, "
                                          r"and this Recorder is rank 0 of world size 3"):
        samebits.Recorder(tmp_path, rank=0, world_size=3, append=True)
    assert path.read_bytes() == before
    # another rank's stream under this rank's name
    shutil.copy(tmp_path / fmt.stream_filename(1), tmp_path / "x.sbs")
    os.replace(tmp_path / "x.sbs", path)
    before = path.read_bytes()
    with pytest.raises(StreamError, match=r"recorded by rank 1 of world size 2, and this Recorder is rank 0"):
        samebits.Recorder(tmp_path, rank=0, world_size=2, append=True)
    assert path.read_bytes() == before


# -- 4. stream edge cases ------------------------------------------------------------------------


def test_a_repeated_identity_is_damage_in_both_orders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a)
    _record(b)

    def repeat_first_param(step, records):  # b: a copy of record 1 (layer0.weight #0) at the end
        return records + [records[1]] if step == 2 else records

    _rewrite(b / RANK0, repeat_first_param)
    for outcome in _both_orders(a, b):
        assert isinstance(outcome, StreamError), outcome
        assert "repeats an identity already in the step" in str(outcome)


def test_an_unknown_record_kind_is_refused_as_a_newer_writers(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a)
    _record(b)
    _rewrite(b / RANK0, lambda step, records: records + [bytes((9, 3)) + b"new"] if step == 1 else records)
    for outcome in _both_orders(a, b):
        assert isinstance(outcome, StreamError), outcome
        assert "of kind 9, which this samebits does not know" in str(outcome)
        assert "written by a newer samebits" in str(outcome)
    assert main(["dump", str(b), "--rank", "0", "--step", "1"]) == 2
    assert "written by a newer samebits" in capsys.readouterr().err


def test_a_header_edited_to_schema_1_is_damage_not_a_twin(tmp_path, capsys):
    """(Before: IDENTICAL through the byte-equal twin shortcut on every rank but the first,
    whose first step the names check reads in full.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, world_size=2)
    shutil.copytree(a, b)
    path = b / fmt.stream_filename(1)
    data = bytearray(path.read_bytes())
    header = _frames(bytes(data))[0]
    at = data.index(b'"schema": 2', header[2], header[3])
    data[at : at + 11] = b'"schema": 1'
    data[header[3] : header[3] + 4] = fmt._U32.pack(zlib.crc32(bytes(data[header[1] : header[3]])))
    path.write_bytes(bytes(data))
    assert main(["show", str(b)]) == 2
    for outcome in _both_orders(a, b):
        assert isinstance(outcome, StreamError), outcome
        assert "records hash to" in str(outcome)


@pytest.mark.parametrize("damage", ["swap", "drop"])
def test_structural_damage_is_exit_2_never_a_divergence(tmp_path, damage, capsys):
    """Steps out of order and a dropped frame (checksums intact) are damage: exit 2 in both
    orders, even though the walk meets the missing step first.  (Before: DIVERGED, exit 1.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, steps=6)
    _record(b, steps=6)
    path = b / RANK0
    data = path.read_bytes()
    steps = [f for f in _frames(data) if f[0] == fmt.FRAME_STEP]
    two, three = steps[2], steps[3]
    chunk_two, chunk_three = data[two[1] : two[3] + 4], data[three[1] : three[3] + 4]
    middle = chunk_three + chunk_two if damage == "swap" else chunk_three
    path.write_bytes(data[: two[1]] + middle + data[three[3] + 4 :])
    for outcome in _both_orders(a, b):
        assert isinstance(outcome, StreamError), outcome
    for x, y in ((a, b), (b, a)):
        assert main(["diff", str(x), str(y)]) == 2
        assert "the file is corrupt" in capsys.readouterr().err


def test_another_recording_window_is_incomplete_not_diverged(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, steps=10, window="0:10")
    _record(b, steps=10, window="5:10")
    for x, y, label in ((a, b, "b"), (b, a, "a")):
        result = samebits.diff(x, y)
        assert result.verdict is Verdict.INCOMPLETE, result.to_dict()
        assert result.first_divergence is None and result.compared["steps"] == 5
        assert f"run {label} rank 0 recorded only steps [5, 10)" in result.incomplete[0]
        assert "5 step(s)" in result.incomplete[0] and "--from-step" in result.incomplete[0]
    assert samebits.diff(a, b, start_step=5).verdict is Verdict.IDENTICAL
    c = tmp_path / "c"
    _record(c, steps=10, window="5:10", bump=(7, "layer2.weight"))
    result = samebits.diff(a, c)
    assert result.verdict is Verdict.DIVERGED and (result.first_divergence.step, result.first_divergence.name) == \
        (7, "loss")


def test_a_live_writer_is_incomplete_not_diverged(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, steps=6)
    (live,) = _record(b, steps=3, close=False)  # still writing: three steps on disk, no close frame
    try:
        for x, y, label in ((a, b, "b"), (b, a, "a")):
            result = samebits.diff(x, y)
            assert result.verdict is Verdict.INCOMPLETE, result.to_dict()
            assert f"run {label} rank 0: its stream ends before step 3" in result.incomplete[0]
            assert "without a clean close" in result.incomplete[0]
    finally:
        live.close()
    assert samebits.diff(a, b).verdict is Verdict.DIVERGED  # closed after 3 of 6 steps: it did end early


def test_a_crafted_torn_tail_is_read_in_linear_time(tmp_path, capsys):
    """A frame that runs past the end, followed by 2 MiB where every fourth byte starts a
    would-be frame of 1 MiB: the scan for a valid frame after it checksums within a budget
    linear in the bytes scanned.  (Before: about 256k checksums of 1 MiB each, minutes.)"""
    _record(tmp_path / "a")
    data = (tmp_path / "a" / RANK0).read_bytes()
    header = _frames(data)[0]
    torn = bytes((fmt.FRAME_STEP,)) + bytes((0xFF, 0xFF, 0xFF, 0x0F))  # a step frame of ~32 MiB
    crafted = data[: header[3] + 4] + torn + bytes((fmt.FRAME_STEP, 0x80, 0x80, 0x40)) * (1 << 19)
    run = tmp_path / "crafted"
    run.mkdir()
    (run / RANK0).write_bytes(crafted)
    started = time.monotonic()
    assert main(["show", str(run)]) == 0
    assert "truncated at byte" in capsys.readouterr().out
    result = samebits.diff(tmp_path / "a", run)
    assert result.verdict is Verdict.INCOMPLETE
    assert time.monotonic() - started < 30


# -- 5. (issue 24) order-only differences ------------------------------------------------------


NAMES = ("layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight", "layer4.weight", "layer5.weight")


def test_equal_records_in_another_order_are_an_order_divergence(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, names=NAMES)
    shuffled = ["layer0.weight", "layer2.weight", "layer3.weight", "layer4.weight", "layer1.weight", "layer5.weight"]
    _record(b, names=NAMES, order=shuffled)
    result = samebits.diff(a, b)
    d = result.first_divergence
    assert result.verdict is Verdict.DIVERGED and (d.step, d.rank, d.reason, d.phase, d.name) == \
        (0, 0, "order", "params", "layer1.weight")
    # position 0 is the loss: layer1.weight is record 2 in a and record 5 in b
    assert "step 0, rank 0, phase params: the same records in another order: first out of place " \
           "`layer1.weight` (position 2 in a, 5 in b)" in d.detail
    reverse = samebits.diff(b, a)
    assert reverse.verdict is Verdict.DIVERGED and reverse.first_divergence.reason == "order"
    assert main(["diff", str(a), str(b)]) == 1
    assert samebits.diff(a, b, verify=True).first_divergence.reason == "order"


def test_a_run_the_live_check_stopped_is_reported_as_the_live_check_found_it(tmp_path):
    """B checked live against A stops at its first step whose root differs (step 0: the same
    records in another order) and leaves stopped.json: the verdict names the order at step 0,
    never "b has no step 1"."""
    a, b = tmp_path / "a", tmp_path / "b"
    _record(a, names=NAMES)
    shuffled = list(reversed(NAMES))
    rec = samebits.Recorder(b, rank=0, world_size=1, config={"lr": 0.1}, reference=a)
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(3, 4, generator=gen) for name in NAMES}
    rec.metrics(0, loss=float(sum(v.sum() for v in params.values())))
    rec.tensors(0, "params", [(name, params[name]) for name in shuffled])
    assert rec.end_step(0) is False  # the live check: stop here
    rec.close()
    (b / "stopped.json").write_text(json.dumps({"stopped_at": 0, "rank": 0, "reference": str(a),
                                                "reason": "diverged from reference"}))
    result = samebits.diff(a, b)
    assert result.verdict is Verdict.DIVERGED
    assert result.first_divergence.reason == "order" and result.first_divergence.step == 0
    assert "has no step" not in json.dumps(result.to_dict())


def test_a_stop_the_comparison_cannot_see_is_incomplete_with_what_the_live_check_found(tmp_path):
    """B stopped by its live check against another reference (R, which differs at step 2)
    holds steps 0-2, equal to A's: INCOMPLETE saying what the live check found, never
    "b has no step 3"."""
    a, b, r = tmp_path / "a", tmp_path / "b", tmp_path / "r"
    _record(a, steps=5)
    _record(r, steps=5, bump=(2, "layer3.weight"))
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(3, 4, generator=gen) for name in
              ("layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight")}
    with samebits.Recorder(b, rank=0, world_size=1, config={"lr": 0.1}, reference=r) as rec:
        for step in range(5):
            rec.metrics(step, loss=float(sum(v.sum() for v in params.values())))
            rec.tensors(step, "params", list(params.items()))
            if rec.end_step(step) is False:
                break
            params = {n: p * 0.5 for n, p in params.items()}
    assert step == 2
    (b / "stopped.json").write_text(json.dumps({"stopped_at": 2, "rank": 0, "reference": str(r),
                                                "reason": "diverged from reference"}))
    for x, y, label in ((a, b, "b"), (b, a, "a")):
        result = samebits.diff(x, y)
        assert result.verdict is Verdict.INCOMPLETE, result.to_dict()
        text = json.dumps(result.to_dict())
        assert "has no step" not in text
        assert f"run {label} was stopped by its live check at step 2 on rank 0 (diverged from reference" in \
            result.incomplete[0]
        assert "steps from 3 on were not compared" in result.incomplete[0]
