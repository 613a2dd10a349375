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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


# -- every verdict is the same in both argument orders (a property) ---------------------------

NAMES = ("w0", "w1", "w2", "w3")
_RUN_SPEC = st.fixed_dictionaries({
    "steps": st.integers(1, 4),
    "bump": st.none() | st.tuples(st.integers(0, 3), st.sampled_from(NAMES)),
    "order": st.none() | st.tuples(st.integers(0, 3), st.permutations(NAMES)),
    "skip": st.none() | st.integers(0, 3),
    "extra": st.none() | st.integers(0, 3),
    "window": st.none() | st.integers(1, 2),
    "cap": st.booleans(),
    "ending": st.sampled_from(["closed", "closed", "killed", "torn"]),
})


def _write_spec(directory, spec) -> list:
    """Write one run as ``spec`` says; returns what it recorded: per step (step, records)."""
    gen = torch.Generator().manual_seed(0)
    values = {name: torch.randn(2, 3, generator=gen) for name in NAMES}
    start = spec["window"] or 0
    content = []
    with samebits.Recorder(directory, rank=0, world_size=1, config={"lr": 0.1},
                           max_tensor_bytes=8 if spec["cap"] else None,
                           steps=f"{spec['window']}:" if spec["window"] else None) as rec:
        for step in range(spec["steps"]):
            if step == spec["skip"]:
                continue
            now = {n: v + 1.0 if spec["bump"] and step >= spec["bump"][0] and n == spec["bump"][1] else v
                   for n, v in values.items()}
            order = spec["order"][1] if spec["order"] and spec["order"][0] == step else NAMES
            named = [(n, now[n]) for n in order] + ([("extra", torch.zeros(2))] if step == spec["extra"] else [])
            rec.tensors(step, "params", named)
            if step >= start:
                content.append((step, [(n, t.view(-1).tolist()) for n, t in named]))
            values = {n: v * 0.5 for n, v in values.items()}
    path = directory / fmt.stream_filename(0)
    data = path.read_bytes()
    if spec["ending"] != "closed":  # a killed writer: no footer (and, torn, half a last frame)
        frames = _frames(data)
        index = next(f for f in frames if f[0] == fmt.FRAME_INDEX)
        cut = index[1]
        steps = [f for f in frames if f[0] == fmt.FRAME_STEP]
        if spec["ending"] == "torn" and steps:
            cut = steps[-1][1] + (steps[-1][3] + 4 - steps[-1][1]) // 2
            content = content[:-1]
        path.write_bytes(data[:cut])
    return content


def _outcome(a, b):
    try:
        result = samebits.diff(a, b)
    except SamebitsError as err:
        return type(err).__name__, None, None, None
    first = result.first_divergence
    return str(result.verdict), result.verdict.exit_code, None if first is None else first.step, \
        tuple(result.ranks_diverged_first)


def _check_symmetry(spec_a, spec_b) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as scratch:
        a, b = Path(scratch) / "a", Path(scratch) / "b"
        content_a, content_b = _write_spec(a, spec_a), _write_spec(b, spec_b)
        forward, backward = _outcome(a, b), _outcome(b, a)
        assert forward == backward, (spec_a, spec_b, forward, backward)
        # and the verdict is the truth: IDENTICAL exactly when both recorded the same values, in
        # the same order, completely, and every value was compared
        complete = all(s["ending"] == "closed" and not s["cap"] for s in (spec_a, spec_b))
        same = content_a == content_b and bool(content_a)
        assert (forward[0] == "identical") == (same and complete), (spec_a, spec_b, forward)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_a=_RUN_SPEC, spec_b=_RUN_SPEC)
def test_every_verdict_is_the_same_in_both_argument_orders(spec_a, spec_b):
    _check_symmetry(spec_a, spec_b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_RUN_SPEC)
def test_a_run_against_a_twin_with_one_change_is_symmetric(spec):
    """The near misses: b differs from a in one respect only."""
    for key, other in (("bump", (0, "w1")), ("order", (0, ("w1", "w0", "w2", "w3"))), ("cap", True),
                       ("ending", "killed"), ("window", 1), ("skip", 1)):
        if spec[key] != other:
            _check_symmetry(spec, {**spec, key: other})


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_a=_RUN_SPEC, spec_b=_RUN_SPEC)
def test_every_verdict_is_the_same_in_both_argument_orders_at_length(spec_a, spec_b):
    _check_symmetry(spec_a, spec_b)


# -- forgeries: structurally valid streams (checksums, roots, footer recomputed) ---------------


def _split_records(body: bytes) -> list[bytes]:
    records, pos = [], 0
    while pos < len(body):
        length, start = fmt.decode_varint(body, pos + 1)
        records.append(body[pos : start + length])
        pos = start + length
    return records


def _reencode(data: bytes, edit) -> bytes:
    """``data`` with ``edit(index, step, records) -> records | None`` applied to its step frames,
    every checksum, root, the footer and the close frame recomputed (a forgery only the reader's
    structural checks can tell)."""
    out = bytearray()
    names_hasher = fmt.new_names_hasher()
    index, index_at = [], 0
    steps_seen = 0
    for kind, offset, start, end in _frames(data):
        payload = data[start:end]
        if kind == fmt.FRAME_NAMES:
            _, pos = fmt.decode_varint(payload, 0)
            _, pos = fmt.decode_varint(payload, pos)
            names_hasher.update(payload[pos:])
        elif kind == fmt.FRAME_STEP:
            step, pos = fmt.decode_varint(payload, 0)
            _, pos = fmt.decode_varint(payload, pos)
            records = edit(steps_seen, step, _split_records(payload[pos + 8 :]))
            steps_seen += 1
            if records is None:
                continue
            if isinstance(records, tuple):  # (new step number, records)
                step, records = records
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
            index_at, payload = len(out), bytes(entries)
        elif kind == fmt.FRAME_CLOSE:
            payload = fmt.pack_u64(index_at) + fmt.CLOSE_MAGIC
        out += fmt.frame(kind, payload)
    return bytes(out)


def _forgeries(pristine: bytes, rng: random.Random):
    """Structurally valid edits of a closed stream: each changes what the stream says."""
    num_steps = sum(1 for f in _frames(pristine) if f[0] == fmt.FRAME_STEP)
    for _ in range(NUM_FORGERIES):
        which = rng.randrange(num_steps)
        kind = rng.choice(["duplicate", "unknown-kind", "reorder", "drop-record", "drop-step", "renumber",
                           "cap-flag"])

        def edit(index, step, records, kind=kind, which=which):
            if index != which:
                return records
            records = list(records)
            if kind == "duplicate":
                return records + [records[rng.randrange(len(records))]]
            if kind == "unknown-kind":
                return records + [bytes((rng.randrange(3, 256), 2)) + bytes(rng.randrange(256) for _ in range(2))]
            if kind == "reorder":
                i, j = rng.sample(range(len(records)), 2)
                records[i], records[j] = records[j], records[i]
                return records
            if kind == "drop-record":
                del records[rng.randrange(len(records))]
                return records
            if kind == "drop-step":
                return None
            if kind == "renumber":
                return step + rng.choice([1, 2, 100]), records
            tensors = [i for i, r in enumerate(records) if r[0] == fmt.RECORD_TENSOR and len(r) > 10]
            i = rng.choice(tensors)  # cap-flag: a digested tensor re-flagged as capped (no digest)
            record = bytearray(records[i])
            length, body = fmt.decode_varint(record, 1)
            flags_at = body + 3 + (1 if record[body + 2] else 0)  # phase, name, occurrence (1-byte ids)
            record[flags_at] |= fmt.FLAG_CAPPED
            ndim = record[flags_at + 1]
            new_body = bytes(record[body : flags_at + 2 + ndim])
            head = bytearray((fmt.RECORD_TENSOR,))
            fmt.encode_varint(len(new_body), head)
            records[i] = bytes(head) + new_body
            return records

        yield kind, _reencode(pristine, edit)


NUM_FORGERIES = 140


def test_forged_streams_never_compare_identical_in_either_order(tmp_path):
    """Forgeries keep every checksum and root valid: only the structural checks (identities,
    kinds, steps, footer, cap flags) and the record-by-record comparison can tell.  None may be
    IDENTICAL, none a traceback, and both argument orders agree."""
    pristine_dir, forged_dir = tmp_path / "pristine", tmp_path / "forged"
    _write_small_run(pristine_dir)
    path = fmt.stream_filename(0)
    pristine = (pristine_dir / path).read_bytes()
    assert _reencode(pristine, lambda i, s, r: r) == pristine  # the re-encoder is exact
    rng = random.Random(20261202)
    outcomes: dict[str, dict[str, int]] = {}
    bad = []
    for kind, data in _forgeries(pristine, rng):
        shutil.rmtree(forged_dir, ignore_errors=True)
        forged_dir.mkdir()
        (forged_dir / path).write_bytes(data)
        forward, backward = _outcome(pristine_dir, forged_dir), _outcome(forged_dir, pristine_dir)
        outcomes.setdefault(kind, {}).setdefault(forward[0], 0)
        outcomes[kind][forward[0]] += 1
        if forward[0] == "identical" or forward != backward:
            bad.append((kind, forward, backward))
    assert bad == [], f"{bad[:5]} (outcomes: {outcomes})"
    assert len(outcomes) == 7


# -- the reliability table (python tests/test_fuzz_streams.py [PAIRS]) -------------------------


def reliability_table(num_pairs: int = 300) -> str:
    """Every mutant and forgery above, crafted torn tails and ``num_pairs`` run pairs of the
    property's generator, each compared in both argument orders: how many were tried, called
    IDENTICAL although damaged or different, raised something other than a samebits error,
    took over 20 s, or got another verdict in the other order (and, for equal complete pairs,
    were not IDENTICAL)."""
    import collections
    import signal
    import tempfile
    from pathlib import Path

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)

    def outcome(a, b):
        signal.alarm(20)
        try:
            r = samebits.diff(a, b)
            return str(r.verdict), None if r.first_divergence is None else r.first_divergence.step
        except SamebitsError as err:
            return type(err).__name__, None
        except Hang:
            return "HANG", None
        except Exception as err:  # noqa: BLE001 - a traceback is what is counted
            return "TRACEBACK " + type(err).__name__, None
        finally:
            signal.alarm(0)

    rows: dict = {}

    def tally(group, fwd, bwd, must_not_be_identical=True):
        row = rows.setdefault(group, collections.Counter())
        row["tried"] += 1
        if must_not_be_identical and "identical" in (fwd[0], bwd[0]):
            row["false IDENTICAL"] += 1
        row["tracebacks"] += sum(x[0].startswith("TRACEBACK") for x in (fwd, bwd))
        row["hangs"] += sum(x[0] == "HANG" for x in (fwd, bwd))
        row["asymmetric"] += fwd != bwd

    scratch = Path(tempfile.mkdtemp())
    pristine_dir, damaged = scratch / "pristine", scratch / "damaged"
    _write_small_run(pristine_dir)
    name = fmt.stream_filename(0)
    pristine = (pristine_dir / name).read_bytes()

    def place(data):
        shutil.rmtree(damaged, ignore_errors=True)
        damaged.mkdir()
        (damaged / name).write_bytes(data)

    for kind, data in _mutants(pristine, random.Random(20261201)):
        if data != pristine:
            place(data)
            tally(f"random mutants ({kind})", outcome(pristine_dir, damaged), outcome(damaged, pristine_dir))
    for kind, data in _forgeries(pristine, random.Random(20261202)):
        place(data)
        tally(f"forgeries ({kind})", outcome(pristine_dir, damaged), outcome(damaged, pristine_dir))
    head = pristine[: _frames(pristine)[0][3] + 4]
    for period, length in ((4, 1 << 20), (5, 1 << 19), (4, 1 << 14), (6, 1 << 20)):
        varint = bytearray()
        fmt.encode_varint(length, varint)
        unit = bytes((fmt.FRAME_STEP,)) + bytes(varint)
        unit += bytes(max(0, period - len(unit)))
        place(head + bytes((fmt.FRAME_STEP, 0xFF, 0xFF, 0xFF, 0x0F)) + unit * ((2 << 20) // len(unit)))
        tally("crafted torn tails (2 MiB)", outcome(pristine_dir, damaged), outcome(damaged, pristine_dir))

    @settings(max_examples=num_pairs, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(a=_RUN_SPEC, b=_RUN_SPEC)
    def pairs(a, b):
        with tempfile.TemporaryDirectory() as d:
            pa, pb = Path(d) / "a", Path(d) / "b"
            ca, cb = _write_spec(pa, a), _write_spec(pb, b)
            fwd, bwd = outcome(pa, pb), outcome(pb, pa)
            equal = ca == cb and bool(ca) and all(s["ending"] == "closed" and not s["cap"] for s in (a, b))
            tally("run pairs (the property's generator)", fwd, bwd, must_not_be_identical=not equal)
            if equal and fwd[0] != "identical":
                rows["run pairs (the property's generator)"]["false alarm"] += 1

    pairs()
    shutil.rmtree(scratch, ignore_errors=True)
    cols = ["tried", "false IDENTICAL", "tracebacks", "hangs", "asymmetric", "false alarm"]
    lines = ["| group | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    total: collections.Counter = collections.Counter()
    for group, row in rows.items():
        total.update(row)
        lines.append(f"| {group} | " + " | ".join(str(row[c]) for c in cols) + " |")
    lines.append("| **all** | " + " | ".join(str(total[c]) for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(reliability_table(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
