"""Golden streams: the Recorder writes, byte for byte, what it wrote before its split (issue 26).

A fixed small run (two ranks, metrics and tensors of several dtypes, a capped tensor, an absent
one, a phase that starts late, a resumed segment) is recorded with its options given as
arguments, as ``SAMEBITS_*`` variables, and as a `RecordingSpec`; the sha256 of each stream file,
and of each step-times file, must equal the constants below, computed on the tree of commit
118420b (before `samebits.stream.writer` became recorder + encoder + file layer).  Only what
depends on the machine or the clock is normalised away (see `_canonical`): the header's
``created``, ``environment``, ``samebits`` and ``determinism`` values, the step times'
seconds, and, since the header's length follows those values, file offsets (written as frame
numbers instead).  Digest version 2: a new digest version changes the constants.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from samebits.settings import RecordingSpec
from samebits.stream import Recorder, _encoder
from samebits.stream import _format as fmt

VOLATILE_HEADER_KEYS = ("created", "environment", "samebits", "determinism")

# sha256 (first 16 hex digits) of `_canonical` of each file, per case, on commit 118420b.
GOLDEN = {
    "plain": {
        "rank-00000.sbs": "fbf8063175772f9c", "rank-00000.steptimes": "bfee20187d9c3f39",
        "rank-00001.sbs": "2182d36d44c87be1", "rank-00001.steptimes": "79ad0317dbe44918",
    },
    "selected": {
        "rank-00000.sbs": "000813747f7c4c5d", "rank-00000.steptimes": "1834d48e14af72ee",
    },
}
# The same selection three ways: the recorder's keywords, the environment, and (after the split)
# a RecordingSpec.  Rank 1 is left out by the rank filter: it writes no file.
SELECTED_KWARGS = {"steps": "1:5", "ranks": "0", "phases": "metrics,grads,params", "include": ["grads/*", "params/*",
                   "metrics/*"], "exclude": "grads/skip*", "max_tensor_bytes": 64, "flush_every": 2}
SELECTED_ENV = {"SAMEBITS_STEPS": "1:5", "SAMEBITS_RANKS": "0", "SAMEBITS_PHASES": "metrics,grads,params",
                "SAMEBITS_INCLUDE": "grads/*,params/*,metrics/*", "SAMEBITS_EXCLUDE": "grads/skip*",
                "SAMEBITS_MAX_TENSOR_BYTES": "64", "SAMEBITS_FLUSH_STEPS": "2"}


def _canonical(path: Path) -> bytes:
    """A stream's frames (kind, payload), with the header's volatile values dropped and file
    offsets written as frame numbers; a step-times file's header lines and step numbers."""
    data = path.read_bytes()
    if path.suffix == ".steptimes":
        lines = data.decode().splitlines()
        return "\n".join(line if line.startswith("{") else line.split("\t")[0] for line in lines).encode()
    frames, pos, number_at = [], 0, {}
    while pos < len(data):
        kind = data[pos]
        length, body = fmt.decode_varint(data, pos + 1)
        number_at[pos] = len(frames)
        frames.append((kind, bytes(data[body : body + length])))
        pos = body + length + 4
    out = bytearray()
    for kind, payload in frames:
        if kind == fmt.FRAME_HEADER:
            header = json.loads(payload[len(fmt.MAGIC):])
            for key in VOLATILE_HEADER_KEYS:
                assert key in header, key
                header.pop(key)
            payload = json.dumps(header, sort_keys=True).encode()
        elif kind == fmt.FRAME_INDEX:
            count, at = fmt.decode_varint(payload, 0)
            entries = []
            for _ in range(count):
                step, at = fmt.decode_varint(payload, at)
                num, at = fmt.decode_varint(payload, at)
                root, at = fmt.unpack_u64(payload, at), at + 8
                offset, at = fmt.decode_varint(payload, at)
                entries.append((step, num, root, number_at[offset]))
            payload = repr(entries).encode()
        elif kind == fmt.FRAME_CLOSE:
            payload = repr(number_at[fmt.unpack_u64(payload, 0)]).encode() + payload[8:]
        out += bytes((kind,)) + len(payload).to_bytes(4, "little") + payload
    return bytes(out)


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(_canonical(p)).hexdigest()[:16]
            for p in sorted(directory.iterdir()) if p.suffix in (".sbs", ".steptimes")}


def _steps(recorders: list, steps: range) -> None:
    """Two ranks' records, interleaved as two processes would write them."""
    for step in steps:
        for rec in recorders:
            r = rec.rank
            base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (step + 1) + r
            rec.metrics(step, loss=torch.tensor(2.5 - step / 8), lr=1e-3 * (step + 1), tokens=4096 * step,
                        grad_norm=torch.tensor(0.5 + step, dtype=torch.bfloat16),
                        scale=torch.tensor(2**16, dtype=torch.int32), half=torch.tensor(1 / 3, dtype=torch.float16))
            rec.tensors(step, "grads", [("w", base), ("w.t", base.t()), ("b", base[0].to(torch.bfloat16)),
                                        ("h", base[1].to(torch.float16)), ("none", None),
                                        ("skip.me", torch.ones(2)), ("big", torch.ones(40) * step)])
            rec.tensors(step, "params", {"ids": torch.arange(6, dtype=torch.int64) + step, "mask": base > 5,
                                         "bytes": torch.arange(9, dtype=torch.uint8) * step,
                                         "f64": base.double()[1:, ::2]})
            if step >= 2:  # a phase, and names, that start later: a names frame after the first step
                rec.tensors(step, "optimizer", [("w.exp_avg", base * 0.1), ("w.step", torch.tensor(float(step)))])
            rec.metrics(step, "late", x=float(step), n=step)
            rec.end_step(step)


def _record_plain(directory: Path) -> None:
    """Ranks 0 and 1 of two, six steps; then rank 0 resumes (a second segment) for two more."""
    recorders = [Recorder(directory, rank=r, world_size=2, run_id="golden", config={"lr": 1e-3, "seed": 7},
                          coords={"dp": r}) for r in range(2)]
    _steps(recorders, range(6))
    for rec in recorders:
        rec.close()
    with Recorder(directory, rank=0, world_size=2, run_id="golden", append=True) as resumed:
        _steps([resumed], range(6, 8))


def _record_selected(directory: Path, **options) -> None:
    recorders = [Recorder(directory, rank=r, world_size=2, run_id="golden", **options) for r in range(2)]
    _steps(recorders, range(7))
    for rec in recorders:
        rec.close()


def test_a_plain_two_rank_run_with_a_resumed_segment_writes_the_golden_bytes(tmp_path):
    _record_plain(tmp_path)
    assert _hashes(tmp_path) == GOLDEN["plain"]


def test_a_selection_given_as_arguments_writes_the_golden_bytes(tmp_path):
    _record_selected(tmp_path, **SELECTED_KWARGS)
    assert _hashes(tmp_path) == GOLDEN["selected"]


def test_a_selection_given_as_variables_writes_the_golden_bytes(tmp_path, monkeypatch):
    for name, value in SELECTED_ENV.items():
        monkeypatch.setenv(name, value)
    _record_selected(tmp_path)
    assert _hashes(tmp_path) == GOLDEN["selected"]


def test_a_selection_given_as_a_spec_writes_the_golden_bytes(tmp_path, monkeypatch):
    """A `RecordingSpec` is the whole selection: the variables are not read beside it."""
    monkeypatch.setenv("SAMEBITS_PHASES", "state")  # would record nothing if it were read
    spec = RecordingSpec(**{k: v for k, v in SELECTED_KWARGS.items() if k != "flush_every"})
    _record_selected(tmp_path, spec=spec, flush_every=2)
    assert _hashes(tmp_path) == GOLDEN["selected"]


def test_the_python_encoder_writes_the_golden_bytes(tmp_path, monkeypatch):
    """Without the compiled library's step framer and finalizer (the digests stay native)."""
    monkeypatch.setattr(_encoder, "native_available", lambda: False)
    _record_plain(tmp_path)
    assert _hashes(tmp_path) == GOLDEN["plain"]


def test_the_canonical_form_sees_a_changed_byte(tmp_path):
    """The normalisation keeps what the golden hashes must guard: one payload byte changed in a
    step frame (its crc fixed up) changes the stream's hash."""
    _record_plain(tmp_path)
    path = tmp_path / "rank-00001.sbs"
    data = bytearray(path.read_bytes())
    length, body = fmt.decode_varint(data, 1)
    pos = body + length + 4  # the first frame after the header
    while data[pos] != fmt.FRAME_STEP:
        length, body = fmt.decode_varint(data, pos + 1)
        pos = body + length + 4
    length, body = fmt.decode_varint(data, pos + 1)
    data[body + length - 1] ^= 1  # the last byte of the step's last record
    path.write_bytes(bytes(data[:pos]) + fmt.frame(fmt.FRAME_STEP, data[body : body + length])
                     + bytes(data[body + length + 4 :]))
    assert _hashes(tmp_path)["rank-00001.sbs"] != GOLDEN["plain"]["rank-00001.sbs"]


@pytest.mark.parametrize("volatile", VOLATILE_HEADER_KEYS)
def test_the_canonical_form_drops_only_the_volatile_header_values(tmp_path, volatile):
    """Another value of a volatile key leaves the hash as it is; another run id changes it (each
    new value as long as the old one, so that no file offset moves)."""
    _record_plain(tmp_path)
    path = tmp_path / "rank-00001.sbs"
    data = path.read_bytes()
    length, body = fmt.decode_varint(data, 1)
    header = json.loads(data[body + len(fmt.MAGIC) : body + length])
    rest = data[body + length + 4 :]

    def with_header(changed: dict) -> str:
        path.write_bytes(fmt.frame(fmt.FRAME_HEADER, fmt.MAGIC + json.dumps(changed, sort_keys=True).encode()) + rest)
        return _hashes(tmp_path)["rank-00001.sbs"]

    other = "x" * (len(json.dumps(header[volatile])) - 2)  # a JSON string as long as the value
    assert with_header({**header, volatile: other}) == GOLDEN["plain"]["rank-00001.sbs"]
    assert with_header({**header, "run_id": "goldeN"}) != GOLDEN["plain"]["rank-00001.sbs"]
