"""The Recorder's shortcuts write the bytes of its record-by-record path.

Three shortcuts make a recorded step cheap (docs/stream.md is unchanged by them): a `tensors`
call that repeats the last call of its phase reuses that call's records (a *call plan*); a step
whose records equal the last step's reuses its encoding and only puts the new payloads in (a
*step template*); `tensors_and_global` digests an unsharded tensor once for its local and its
global record.  Each is checked here against the full path, against bytes written before the
shortcuts existed, and with a fault planted in it to show the check can fail.
"""

from __future__ import annotations

import hashlib
import os
import random
import zlib
from pathlib import Path

import pytest
import torch

import samebits
from samebits.errors import ConfigError
from samebits.fingerprint import global_body_sums
from samebits.fingerprint import _native
from samebits.stream import _encoder
from samebits.stream import _format as fmt
from samebits.stream.recorder import Recorder

# sha256 (first 16 hex digits) of each recording below after its header frame (see
# `_after_header`), as written by the record-by-record encoder before the shortcuts (the tree
# of commit 3abc9db), with two calls for the params (`tensors`, then `global_tensors`).
# Digest version 2: a new digest version changes them.
GOLDEN = {
    "exclude": "051ebb0e0bbc9a33",
    "filtered": "6a1aea6f01ebc9c6",
    "nocap": "66173e62713ddd78",
    "phases": "42477fb753c304ce",
    "plain": "1c850839dad12fc6",
    "steps": "19cfe112518760ec",
}
SETTINGS = {
    "plain": {}, "filtered": {"include": "grads/*,params/p,state/*,metrics/*"},
    "exclude": {"exclude": "params/q,grads/w*"}, "phases": {"phases": "grads,params"},
    "steps": {"steps": "1:4"}, "nocap": {"max_tensor_bytes": None},
}


def _after_header(path: Path) -> bytes:
    """The stream's frames after its header, with the file offsets in the index and close frames
    made relative to the header's end (the header's length varies with the environment)."""
    data = path.read_bytes()
    length, pos = fmt.decode_varint(data, 1)
    start = pos + length + 4
    out, pos = bytearray(), start
    while pos < len(data):
        kind = data[pos]
        length, body = fmt.decode_varint(data, pos + 1)
        payload, end = bytes(data[body : body + length]), body + length + 4
        if kind == fmt.FRAME_INDEX:
            count, at = fmt.decode_varint(payload, 0)
            entries = []
            for _ in range(count):
                step, at = fmt.decode_varint(payload, at)
                num, at = fmt.decode_varint(payload, at)
                root, at = fmt.unpack_u64(payload, at), at + 8
                offset, at = fmt.decode_varint(payload, at)
                entries.append((step, num, root, offset - start))
            payload = repr(entries).encode()
        elif kind == fmt.FRAME_CLOSE:
            payload = repr(fmt.unpack_u64(payload, 0) - start).encode() + payload[8:]
        out += bytes((kind,)) + payload
        pos = end
    return bytes(out)


def _grads(step: int) -> list:
    """Every kind of record: non-contiguous, bf16, int8, a lazy conjugate, absent, capped, 0-d,
    empty, a repeated name; at step 2 one tensor has another shape, at step 5 another dtype."""
    g = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (step + 1)
    return [
        ("w", g), ("w.t", g.t()), ("b16", g.to(torch.float16 if step == 5 else torch.bfloat16)),
        ("i8", torch.arange(8 if step == 2 else 7, dtype=torch.int8) + step),
        ("cplx", torch.complex(g, g).conj()), ("none", None), ("big", torch.ones(1000) * step),
        ("scalar", torch.tensor(3.0 + step)), ("empty", torch.empty(0, 3)), ("w", g + 1),
    ]


def _record(root: Path, *, one_call: bool = True, full_path: bool = False, **settings) -> str:
    """Six steps (one with an extra record, one with its params in another order); the sha256
    of the stream after its header.  ``full_path``: forget every plan and template before each
    call, so every record goes the record-by-record way."""
    settings.setdefault("max_tensor_bytes", 2000)
    rec = Recorder(root, rank=0, world_size=1, run_id="fixture", **settings)

    def forget():
        if full_path:
            rec._encoder._plans.clear()
            rec._encoder._template = None

    p = torch.nn.Parameter(torch.arange(10, dtype=torch.float32))
    q = torch.nn.Parameter(torch.ones(3, 5, dtype=torch.float64))
    for step in range(6):
        forget()
        rec.metrics(step, loss=torch.tensor(1.5 + step), lr=0.1 * step, tokens=step * 7)
        forget()
        rec.tensors(step, "state", [("rng", torch.arange(5, dtype=torch.int64) + step)])
        forget()
        rec.tensors(step, "grads", _grads(step))
        if step == 3:
            rec.tensors(step, "grads", [("extra", torch.zeros(2))])
        with torch.no_grad():
            p.add_(1.0)
            q.mul_(1.5)
        named = [("p", p), ("q", q), ("none", None)] if step != 4 else [("q", q), ("p", p)]
        forget()
        if one_call:
            rec.tensors_and_global(step, "params", named)
        else:
            rec.tensors(step, "params", [(n, t.detach() if t is not None else None) for n, t in named])
            rec.global_tensors(step, "params", named)
        forget()
        rec.metrics(step, "late", x=float(step))
        forget()
        rec.end_step(step)
    rec.close()
    return hashlib.sha256(_after_header(root / "rank-00000.sbs")).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_shortcuts_write_the_bytes_of_the_full_path(tmp_path, name):
    settings = SETTINGS[name]
    assert _record(tmp_path / "fast", **settings) == GOLDEN[name]
    assert _record(tmp_path / "full", full_path=True, **settings) == GOLDEN[name]
    assert _record(tmp_path / "two", one_call=False, **settings) == GOLDEN[name]


@pytest.mark.parametrize("name", ["plain", "exclude", "steps"])
def test_without_the_compiled_library_the_python_encoder_writes_the_same_bytes(tmp_path, monkeypatch, name):
    """With the library, step templates are filled and STEP frames built in C (finalize_into,
    step_frame); without it, in numpy and Python. The digests stay native here (only the
    encoder's view of the library is hidden), so this compares the two encoders."""
    monkeypatch.setattr(_encoder, "native_available", lambda: False)
    assert _record(tmp_path / "python", **SETTINGS[name]) == GOLDEN[name]


def test_a_template_that_leaves_a_payload_out_is_caught(tmp_path, monkeypatch):
    real = _encoder.StepEncoder._fill_template

    def stale_metrics(self, template, pending):
        template.metric_at, saved = [], template.metric_at  # the metrics keep the template's bytes
        try:
            return real(self, template, pending)
        finally:
            template.metric_at = saved

    monkeypatch.setattr(_encoder.StepEncoder, "_fill_template", stale_metrics)
    assert _record(tmp_path / "fast") != GOLDEN["plain"]


def test_a_plan_reused_for_other_tensors_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(_encoder, "_tensor_metas", lambda pairs: [None] * len(pairs))
    # every call of a phase now matches its plan by names alone: the grads of steps 2 and 5
    # (a shape, a dtype changed) would get the records of the call before
    fast = _record(tmp_path / "fast", max_tensor_bytes=None)
    assert fast != GOLDEN["nocap"]


def _present(named):
    return [(n, t) for n, t in named if t is not None]


NAMED = [("a", torch.arange(6.0)), ("b", None), ("c", torch.ones(3, dtype=torch.bfloat16)),
         ("d", torch.arange(10.0).reshape(2, 5).t()), ("e", torch.nn.Parameter(torch.full((4,), 0.5)))]


def test_reused_sums_equal_fresh_ones():
    present = _present(NAMED)
    _, fresh = global_body_sums(present)
    _, reused = global_body_sums(present, known=[True, False, True, True])
    assert fresh.reused == [False] * 4 and reused.reused == [True, False, True, True]
    assert reused.sums.tolist() == [0, fresh.sums[1].item(), 0, 0]  # only the unknown one computed
    assert reused.dtypes == fresh.dtypes and reused.shapes == fresh.shapes
    with pytest.raises(ConfigError, match="one bool per tensor"):
        global_body_sums(present, known=[True])


@pytest.mark.parametrize("settings", [{}, {"exclude": "params/c"}, {"max_tensor_bytes": 20}])
def test_tensors_and_global_records_what_the_two_calls_record(tmp_path, settings):
    """Unsharded tensors reuse their local sums; filtered-out and capped ones (no local digest)
    are digested for their global record."""
    with Recorder(tmp_path / "one", rank=0, world_size=1, **settings) as rec:
        for step in range(3):
            rec.tensors_and_global(step, "params", NAMED)
    records = [list(b.records()) for b in samebits.open_run(tmp_path / "one").stream(0).steps()]
    expected_global = samebits.global_digests(_present(NAMED))
    for step_records in records:
        local = {r.name: r.digest for r in step_records if r.phase == "params"}
        global_ = {r.name: r.digest for r in step_records if r.phase == "global:params"}
        assert {n: d for n, d in global_.items() if d is not None} == expected_global
        for name, tensor in _present(NAMED):
            if name in local and local[name] is not None:  # not capped
                assert local[name] == samebits.digest(tensor)
    with Recorder(tmp_path / "two", rank=0, world_size=1, **settings) as rec:
        for step in range(3):
            rec.tensors(step, "params", NAMED)
            rec.global_tensors(step, "params", NAMED)
    assert _after_header(tmp_path / "one" / "rank-00000.sbs") == _after_header(tmp_path / "two" / "rank-00000.sbs")


def test_global_records_pointing_at_the_wrong_local_sums_are_caught(tmp_path, monkeypatch):
    real = Recorder._tensors

    def shifted(self, *args):  # each global record reuses its neighbour's local digest
        slots = real(self, *args)
        return slots[1:] + slots[:1] if slots else slots

    monkeypatch.setattr(Recorder, "_tensors", shifted)
    with Recorder(tmp_path / "r", rank=0, world_size=1) as rec:
        rec.tensors_and_global(0, "params", NAMED)
    (block,) = samebits.open_run(tmp_path / "r").stream(0).steps()
    global_ = {r.name: r.digest for r in block.records() if r.phase == "global:params" and not r.absent}
    assert global_ != samebits.global_digests(_present(NAMED))


# -- the native step frame (csrc/step_frame.c) and the one-pass plan check -------------------

needs_library = pytest.mark.skipif(not _native.available(), reason="the compiled digest library is not built")


@needs_library
@pytest.mark.parametrize("portable", [0, 1])
def test_native_sha256_and_crc32_match_hashlib_and_zlib(portable):
    """Every length around the block and padding boundaries, and a long one; both SHA-256 codes
    (the CPU's SHA extensions when it has them, and the portable one)."""
    import ctypes

    for length in [*range(0, 200), 1000, 2079, 65537]:
        key, body = os.urandom(32), os.urandom(length)
        out = ctypes.create_string_buffer(32)
        _native.LIB.samebits_sha256_two(portable, key, 32, body, length, out)
        assert out.raw == hashlib.sha256(key + body).digest(), length
        assert _native.LIB.samebits_crc32(length, body, length) == zlib.crc32(body, length), length


@needs_library
def test_native_step_frames_equal_the_python_encoder():
    framer, rng = _native.StepFramer(), random.Random(5)
    for step, count, length in [(0, 0, 0), (1, 3, 50), (127, 128, 300), (2**63 - 1, 2**20, 5000),
                                *((rng.randrange(2**40), rng.randrange(1000), rng.randrange(9000)) for _ in range(50))]:
        key, body = os.urandom(32), os.urandom(length)
        frame, root = framer.frame(key, step, count, body, length)
        prefix = bytearray()
        fmt.encode_varint(step, prefix)
        fmt.encode_varint(count, prefix)
        assert root == fmt.step_root(key, body)
        assert bytes(frame) == fmt.frame(fmt.FRAME_STEP, bytes(prefix) + fmt.pack_u64(root) + body)
    with pytest.raises(ValueError, match="32"):
        framer.frame(b"short", 0, 0, b"", 0)


def _plain_calls(step: int) -> list:
    """Row-major tensors, but at step 2 the square one is transposed in place (same shape, other
    strides), at step 3 another is a lazily negated view, at step 4 one gets other storage."""
    m = torch.arange(16.0).reshape(4, 4) + step
    if step == 2:
        m.t_()
    v = torch.arange(5.0) * (step + 1)
    if step == 3:
        v = torch._neg_view(v)
    w = torch.full((3,), float(step), dtype=torch.bfloat16)
    if step == 4:
        w.data = torch.zeros(6, dtype=torch.bfloat16)[::2]  # same shape, strided storage
    return [("m", m), ("v", v), ("w", w), ("i", torch.arange(7, dtype=torch.int32) - step)]


def test_a_call_with_a_complex_tensor_gets_no_one_pass_check(tmp_path):
    """`_plain_key` leaves out the conjugate bit (only complex tensors carry it): such calls
    take the general plan path, whose digests see a lazy conjugate."""
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    with Recorder(tmp_path, rank=0, world_size=1) as rec:
        for step, t in enumerate([z, z.conj(), z]):
            rec.tensors(step, "p", [("z", t), ("x", torch.ones(2))])
            assert rec._encoder._plans["p"].plain_keys is None
    steps = list(samebits.open_run(tmp_path).stream(0).steps())
    assert [next(iter(b.records())).digest for b in steps] == [samebits.digest(t) for t in [z, z.conj(), z]]


def _plain_record(root: Path, *, forget: bool) -> bytes:
    with Recorder(root, rank=0, world_size=1, run_id="fixture") as rec:
        for step in range(6):
            if forget:
                rec._encoder._plans.clear()
                rec._encoder._template = None
            rec.tensors(step, "params", _plain_calls(step))
    return _after_header(root / "rank-00000.sbs")


@needs_library
def test_a_repeated_call_of_row_major_tensors_takes_the_one_pass_check(tmp_path, monkeypatch):
    """The one-pass check (`_plain_key`) is taken for such calls, and still sees a tensor that keeps
    its shape but not its layout (transposed in place, a negated view, other storage): the bytes
    equal the record-by-record path's, and the digests those of the tensors' values."""
    taken = []
    real = _native.body_sums_into
    monkeypatch.setattr(_encoder, "body_sums_into", lambda *a: taken.append(1) or real(*a))
    fast = _plain_record(tmp_path / "fast", forget=False)
    assert len(taken) == 2  # steps 1 and 5 (steps 2-4 fail the check and go the full path)
    assert fast == _plain_record(tmp_path / "full", forget=True)
    steps = list(samebits.open_run(tmp_path / "fast").stream(0).steps())
    for step, block in enumerate(steps):
        expected = {name: samebits.digest(t) for name, t in _plain_calls(step)}
        assert {r.name: r.digest for r in block.records()} == expected


@needs_library
def test_a_one_pass_check_blind_to_layout_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(_encoder, "_plain_key", lambda name, t: (name, t.__class__, t.dtype, t.shape, t.is_cpu,
                                                                 t.layout, True, False))
    assert _plain_record(tmp_path / "fast", forget=False) != _plain_record(tmp_path / "full", forget=True)
