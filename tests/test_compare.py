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
    assert code == 1 and "truncated at byte" in out


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
