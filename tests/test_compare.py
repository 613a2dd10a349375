"""The comparator on synthetic runs with divergences planted at known places."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import samebits
from samebits.cli import main
from samebits.errors import IncomparableRunsError, StreamError


def test_identical_runs(make_run):
    a, b = make_run(), make_run()
    result = samebits.diff(a, b)
    assert result.verdict == "identical" and result.first_divergence is None
    assert result.compared["ranks"] == 2 and result.compared["steps"] == 5
    assert result.compared["records"] == 2 * 5 * (2 + 2 * 4)
    assert result.compared["steps_identical_by_root"] == 10
    verified = samebits.diff(a, b, verify=True)
    assert verified.identical and verified.compared["steps_decoded"] == 10


@pytest.mark.parametrize("plant", [
    (3, 1, "grads", "layer2.weight"),
    (0, 0, "params", "layer0.weight"),
    (4, 1, "metrics", "loss"),
])
def test_planted_divergence_is_reported_exactly(make_run, plant):
    a, b = make_run(), make_run(plant=plant)
    result = samebits.diff(a, b)
    d = result.first_divergence
    assert result.verdict == "diverged"
    assert (d.step, d.rank, d.phase, d.name) == plant
    assert d.reason == "content" and d.records_differing == 1
    assert result.ranks_diverged_first == [plant[1]]
    payload = result.to_dict()
    assert payload["first_divergence"]["step"] == plant[0] and payload["first_divergence"]["rank"] == plant[1]


def test_earliest_rank_and_record_win(make_run):
    a = make_run()
    b = make_run(plant=(2, 1, "grads", "layer1.weight"))
    # rank 0 diverges later: the report names step 2, rank 1
    result = samebits.diff(a, b)
    assert (result.first_divergence.step, result.first_divergence.rank) == (2, 1)


def test_run_that_ends_early(make_run):
    a, b = make_run(), make_run(stop_after=(1, 2))
    result = samebits.diff(a, b)
    d = result.first_divergence
    assert result.verdict == "diverged" and (d.step, d.rank, d.reason) == (3, 1, "ended_b")
    assert "ends before it" in d.detail


def test_window_compares_only_selected_steps(make_run):
    a, b = make_run(), make_run(plant=(1, 0, "params", "layer0.weight"))
    assert samebits.diff(a, b, start_step=2).identical
    assert samebits.diff(a, b, stop_step=1).identical
    assert not samebits.diff(a, b, start_step=1).identical


def test_incomparable_runs(make_run):
    a = make_run()
    with pytest.raises(IncomparableRunsError, match=r"world size 2\).*\(world size 3"):
        samebits.diff(a, make_run(world_size=3))
    other_config = make_run(config={"lr": 0.2})
    with pytest.raises(IncomparableRunsError, match="config 'lr': a = 0.1, b = 0.2") as info:
        samebits.diff(a, other_config)
    assert "--allow-config-diff" in str(info.value)
    assert samebits.diff(a, other_config, allow_config_diff=True).identical
    with pytest.raises(IncomparableRunsError, match="record different names"):
        samebits.diff(a, make_run(num_tensors=3))


def test_cli_diff_exit_codes_and_json(make_run, capsys, tmp_path):
    a, b = make_run(), make_run(plant=(3, 1, "grads", "layer2.weight"))
    assert main(["diff", str(a), str(a)]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 3, rank 1: grads/layer2.weight" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["verdict"] == "diverged"
    assert {k: payload["first_divergence"][k] for k in ("step", "rank", "phase", "name")} == {
        "step": 3, "rank": 1, "phase": "grads", "name": "layer2.weight"}
    assert set(payload["compared"]) >= {"ranks", "steps", "records"}
    assert main(["diff", str(a), str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["diff", str(a), str(make_run(world_size=3)), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["verdict"] == "incomparable"


def test_cli_corrupt_and_truncated_streams(make_run, capsys):
    a, b = make_run(), make_run()
    path = b / "rank-00001.sbs"
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    assert main(["diff", str(a), str(b), "--verify"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    path.write_bytes(original[: len(original) * 2 // 3])
    code = main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    # a killed writer's stream: what it holds is compared, the rest is unknown (not different)
    assert code == 2 and "INCOMPLETE" in out and "truncated at byte" in out and "were not compared" in out


def test_cli_show_and_dump_subprocess(make_run):
    run = make_run()
    show = subprocess.run([sys.executable, "-m", "samebits", "show", str(run)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert "world size 2" in show.stdout and "rank" in show.stdout
    dump = subprocess.run([sys.executable, "-m", "samebits", "dump", str(run), "--rank", "1", "--step", "2"],
                          capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr
    assert "layer3.weight" in dump.stdout and "step 2  rank 1" in dump.stdout
    missing = subprocess.run([sys.executable, "-m", "samebits", "dump", str(run), "--step", "99"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no step 99" in missing.stderr


# -- digest versions: streams of different digest definitions are never compared -----------------

def as_digest_version_1(run_dir):
    """Make every stream of ``run_dir`` look written before digest version 2: its header loses
    the digest_version field (renamed to a key of the same length, so no offset moves), which
    is how a stream of digest version 1 reads; the frame's checksum is recomputed."""
    import zlib

    from samebits.stream import _format as fmt

    for path in run_dir.glob("rank-*.sbs"):
        data = bytearray(path.read_bytes())
        length, start = fmt.decode_varint(data, 1)
        payload = bytes(data[start : start + length])
        key = f'"{fmt.DIGEST_VERSION_KEY}"'.encode()
        assert key in payload
        payload = payload.replace(key, b'"' + b"written_by_v1".ljust(len(key) - 2, b"_") + b'"')
        data[start : start + length] = payload
        data[start + length : start + length + 4] = zlib.crc32(payload, zlib.crc32(data[:start])).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return run_dir


def test_runs_of_different_digest_versions_are_refused(make_run, capsys):
    from samebits.fingerprint import DIGEST_VERSION
    from samebits.stream import open_run

    a, old = make_run(), as_digest_version_1(make_run())
    assert open_run(a).digest_version == DIGEST_VERSION == 2
    assert open_run(old).digest_version == 1 and open_run(old).stream(0).digest_version == 1
    for first, second in ((a, old), (old, a)):
        with pytest.raises(IncomparableRunsError, match=r"digest version [12]\) with .* \(digest version [12]\)") as info:
            samebits.diff(first, second)
        message = str(info.value)
        assert str(a) in message and str(old) in message
        assert f"re-record {old} (digest version 1) with this samebits (digest version 2)" in message
        with pytest.raises(IncomparableRunsError, match="digest version"):
            samebits.diff(first, second, by="global")
        with pytest.raises(IncomparableRunsError, match="digest version"):
            list(samebits.compare.divergent_steps(first, second))
    # The CLI: no verdict of IDENTICAL or DIVERGED, the incomparable exit code and the reason.
    assert main(["diff", str(a), str(old), "--json"]) == 2
    payload = json.loads(capsys.readouterr().out)
    assert payload["verdict"] == "incomparable" and "digest version" in json.dumps(payload)
    assert main(["diff", str(old), str(a)]) == 2
    captured = capsys.readouterr()
    assert "digest version 1" in captured.out + captured.err
    assert "IDENTICAL" not in captured.out and "DIVERGED" not in captured.out
    # Two runs of the same (old) version still compare: their digests are the same function.
    assert samebits.diff(old, as_digest_version_1(make_run())).identical


def test_a_v1_stream_is_not_extended_or_used_as_a_live_reference(make_run, tmp_path):
    from samebits.errors import ConfigError

    old = as_digest_version_1(make_run(world_size=1))
    with pytest.raises(ConfigError, match=r"reference run .* digest version 1.*Re-record the reference"):
        samebits.Recorder(tmp_path / "live", rank=0, world_size=1, reference=old)
    assert not (tmp_path / "live" / "rank-00000.sbs").exists()
    with pytest.raises(StreamError, match=r"cannot append: the stream was recorded with digest version 1"):
        samebits.Recorder(old, rank=0, world_size=1, config={"lr": 0.1}, append=True)
