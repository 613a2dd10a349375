"""What every command takes in: files, paths, values, and the processes it starts.

* only regular files are read as streams, configs and summaries: a FIFO, a device or a directory
  in their place is a one-line error naming the path (a FIFO used to block the reader forever);
* a path that is not UTF-8 is printed (its bytes as ``\\xNN``), never a UnicodeEncodeError;
* a malformed ``summary.json`` is one error naming the file and the field, never a traceback;
* every value is checked, with its valid range, before any process starts;
* killing samebits ends every process its run started (torchrun's agent and its workers, which
  torchrun starts in sessions of their own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import pytest

from conftest import write_run
from samebits.cli import main
from samebits.compare import DiffResult, Divergence
from samebits.runners.bisect import BisectResult, Elements, Origin, Stage
from samebits.runners.matrix import CellResult, MatrixResult
from samebits.runners.verify import VerifyResult
from samebits.verdicts import Verdict


# ---------------------------------------------------------------------------------------------
# only regular files are read


@contextlib.contextmanager
def _unblocking(fifo: Path, after: float = 4.0):
    """If the command opens ``fifo`` for reading and blocks (what samebits did), open it for
    writing after ``after`` seconds, so that the test fails instead of hanging; yields a list
    that holds True once that happened."""
    stop, fired = threading.Event(), []

    def unblock():
        if stop.wait(after):
            return
        fired.append(True)
        while not stop.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees end of file
            except OSError:  # no reader (yet)
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield fired
    finally:
        stop.set()
        thread.join()


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to(os.devnull)
    else:
        path.mkdir()


_WHAT = {"fifo": "a FIFO (named pipe), not a regular file", "device": "a character device, not a regular file",
         "directory": "a directory, not a regular file"}


def _one_line_error(capsys, path: Path, kind: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{path}: {_WHAT[kind]}" in err, err
    return err


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("command", ["diff", "show", "dump", "report", "trace"])
def test_a_stream_must_be_a_regular_file(command, kind, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, world_size=2, num_steps=2)
    write_run(b, world_size=2, num_steps=2)
    stream = b / "rank-00001.sbs"
    _replace(stream, kind)
    argv = {"diff": ["diff", str(a), str(b)], "show": ["show", str(b)], "dump": ["dump", str(b), "--rank", "1"],
            "report": ["report", str(a), str(b), "-o", str(tmp_path / "r.html")],
            "trace": ["trace", str(a), str(b)]}[command]
    began = time.perf_counter()
    with _unblocking(stream) as fired:
        code = main(argv)
    assert not fired and time.perf_counter() - began < 3.0
    assert code == 2
    err = _one_line_error(capsys, stream, kind)
    assert "expected a fingerprint stream" in err


def test_an_output_directory_is_checked_down_to_its_runs(tmp_path, capsys):
    out = tmp_path / "out"
    for run in ("a", "b"):
        write_run(out / run, world_size=1, num_steps=2)
    (out / "summary.json").write_text(json.dumps({"verdict": "pass", "checks": {"independent": {"verdict": "identical"},
                                                                                 "resume": None}}))
    stream = out / "b" / "rank-00000.sbs"
    _replace(stream, "fifo")
    with _unblocking(stream) as fired:
        code = main(["report", str(out), "-o", str(tmp_path / "r.html")])
    assert not fired and code == 2
    _one_line_error(capsys, stream, "fifo")


def test_a_stop_marker_must_be_a_regular_file(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, world_size=1, num_steps=3)
    write_run(b, world_size=1, num_steps=3, stop_after=(0, 1))
    os.mkfifo(b / "stopped.json")
    with _unblocking(b / "stopped.json") as fired:
        code = main(["diff", str(a), str(b)])
    assert not fired and code == 2
    _one_line_error(capsys, b / "stopped.json", "fifo")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_summary_must_be_a_regular_file(kind, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    summary = out / "summary.json"
    summary.write_text("{}")
    _replace(summary, kind)
    with _unblocking(summary) as fired:
        code = main(["report", str(out), "-o", str(tmp_path / "r.html")])
    assert not fired and code == 2
    _one_line_error(capsys, summary, kind)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_config_must_be_a_regular_file(kind, tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text("{}")
    _replace(config, kind)
    began = time.perf_counter()
    with _unblocking(config) as fired:
        code = main(["check", "--config", str(config)])
    assert not fired and time.perf_counter() - began < 3.0
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config {config}: {_WHAT[kind]}" in err, err


# ---------------------------------------------------------------------------------------------
# a path that is not UTF-8 is printed


def test_a_path_that_is_not_utf8_is_printed_with_its_bytes_escaped(tmp_path, capsys):
    base = os.fsencode(tmp_path)
    a, b = os.fsdecode(base + b"/run-\xff-a"), os.fsdecode(base + b"/run-\xfe-b")
    write_run(a, world_size=1, num_steps=2)
    write_run(b, world_size=1, num_steps=2)
    assert main(["diff", a, b]) == 0
    out = capsys.readouterr().out
    assert "run-\\xff-a" in out and "run-\\xfe-b" in out and "IDENTICAL" in out
    assert main(["show", a]) == 0
    assert "run-\\xff-a" in capsys.readouterr().out
    page = tmp_path / "r.html"
    assert main(["report", a, b, "-o", str(page)]) == 0
    captured = capsys.readouterr()
    assert "run-\\xff-a" in captured.out + captured.err
    assert "run-\\xff-a" in page.read_text(encoding="utf-8")
    assert main(["diff", a, os.fsdecode(base + b"/gone-\xff")]) == 2  # the error names it too
    assert "gone-\\xff" in capsys.readouterr().err


def test_escape_writes_a_non_utf8_byte_as_itself():
    from samebits.cli._format import escape

    assert escape(os.fsdecode(b"run-\xff")) == "run-\\xff"
    assert escape(os.fsdecode(b"run-\xff")).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# a malformed summary.json is one error naming the file and the field

# Well-formed summaries, as each command writes them (its result's to_dict); each case damages one field.
_FIRST = Divergence(step=3, rank=0, reason="content", phase="params", name="w")
_CHECK = DiffResult(a="a", b="b", verdict=Verdict.DIVERGED, first_divergence=_FIRST, ranks_diverged_first=[0],
                    divergences={0: _FIRST}, compared={"steps": 4, "records": 8}).to_dict()
_VERIFY = VerifyResult("out", {"independent": DiffResult.from_dict(_CHECK), "resume": None}, {"A": 1.0}, None,
                       explanations={"independent": ["rng.torch_cpu differs"]}).to_dict()
_ELEMENTS = Elements(detail={"differing": 1, "total": 4, "max_ulp": 1, "first_indices": [[2]],
                             "values": [{"index": [2], "a": 1.0, "b": 1.0000001, "ulp": 1}],
                             "shape": [4], "dtype": "float32"},
                     output="0", pair=["a1", "b1"], dumps=["a.pt", "b.pt"], same_values=False,
                     inputs_identical=True).to_dict()
_ORIGIN = Origin(kind="op", conclusion="origin: aten::mm", step=3, rank=0, phase="forward", module="m", op="aten::mm",
                 event_id="m/aten::mm:0", category="op", classification="origin", call_site="t.py:1", elements=None,
                 catalog=None, detail="", state_differs=[], state_differs_all=[]).to_dict()
_STAGE = Stage("steps", "phases", "all steps, every rank", {"a": 1.0}, "diverged", None, "origin").to_dict()
_BISECT = BisectResult(verdict=Verdict.DIVERGED, origin=Origin.from_dict(_ORIGIN), stages=[Stage.from_dict(_STAGE)],
                       out="out", compared="a vs b", conclusion="origin: aten::mm").to_dict()
_CELL = CellResult(cell="single", precision="fp32", world_size=1, required=True, out="out/single-fp32",
                   verify=VerifyResult.from_dict(_VERIFY)).to_dict()
_MATRIX = MatrixResult(out="out", baseline="single fp32", cells=[CellResult.from_dict(_CELL)]).to_dict()


@pytest.mark.parametrize("summary, field", [
    ({**_VERIFY, "checks": ["independent"]}, "'checks' must be an object, found a list"),
    ({**_VERIFY, "checks": {"independent": "identical"}}, "'checks.independent' must be an object (DiffResult), "
                                                          "found a string"),
    ({**_VERIFY, "checks": {"independent": {**_CHECK, "first_divergence": [3, 1]}}},
     "'checks.independent.first_divergence' must be an object"),
    ({**_VERIFY, "checks": {"independent": {**_CHECK, "compared": 5}}},
     "'checks.independent.compared' must be an object, found a number"),
    ({**_VERIFY, "runs": {"a": 0}}, "'runs' must be a list"),
    ({**_VERIFY, "runs": ["a"]}, "'runs[0]' must be an object"),
    ({**_VERIFY, "explanations": ["x"]}, "'explanations' must be an object"),
    ({**_VERIFY, "explanations": {"independent": 3}}, "'explanations.independent' must be a list"),
    ({**_VERIFY, "notes": 5}, "'notes' must be a list, found a number"),
    ({**_VERIFY, "resume_at": "4"}, "'resume_at' must be an integer, found a string"),
    ({key: value for key, value in _VERIFY.items() if key != "verdict"}, "field 'verdict' is missing"),
    ({**_VERIFY, "verdict": ["pass"]}, "'verdict' must be a string, found a list"),
    ({**_BISECT, "stages": {"1": "rung"}}, "'stages' must be a list"),
    ({**_BISECT, "stages": [1]}, "'stages[0]' must be an object"),
    ({**_BISECT, "stages": [{**_STAGE, "runs_s": [1.0]}]}, "'stages[0].runs_s' must be an object"),
    ({**_BISECT, "control_flow": "rank 0"}, "'control_flow' must be an object"),
    ({**_BISECT, "origin": ["op"]}, "'origin' must be an object"),
    ({**_BISECT, "origin": {**_ORIGIN, "elements": "many"}}, "'origin.elements' must be an object"),
    ({**_BISECT, "origin": {**_ORIGIN, "elements": {**_ELEMENTS, "values": [1]}}},
     "'origin.elements.values[0]' must be an object"),
    ({**_BISECT, "origin": {**_ORIGIN, "state_differs": 3}}, "'origin.state_differs' must be a list"),
    ({**_MATRIX, "cells": {"single": {}}}, "'cells' must be a list"),
    ({**_MATRIX, "cells": ["single"]}, "'cells[0]' must be an object"),
    ({**_MATRIX, "cells": [{**_CELL, "agreement": ["identical"]}]}, "'cells[0].agreement' must be an object"),
    ({**_MATRIX, "failures": 2}, "'failures' must be a list"),
    ("[" * 100_000, "nested too deeply"),
    ("{\"verdict\": ", "cannot be read as JSON"),
    (b"\xff\xfe", "cannot be read as JSON"),
    ([1, 2], "a JSON object was expected, found a list"),
])
def test_a_malformed_summary_is_one_error_naming_the_field(summary, field, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    file = out / "summary.json"
    if isinstance(summary, bytes):
        file.write_bytes(summary)
    else:
        file.write_text(summary if isinstance(summary, str) else json.dumps(summary))
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("[")]  # not the progress line
    assert len(errors) == 1 and errors[0].startswith(f"samebits report: error: {file}: "), err
    assert field in errors[0], err
    assert not (tmp_path / "r.html").exists()


def test_a_matrix_cell_summary_is_checked_too(tmp_path, capsys):
    out, cell = tmp_path / "out", tmp_path / "out" / "single-fp32"
    cell.mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps({**_MATRIX, "cells": [{**_CELL, "out": str(cell)}]}))
    (cell / "summary.json").write_text(json.dumps({**_VERIFY, "checks": {"independent": [1]}}))
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert f"{cell / 'summary.json'}: field 'checks.independent' must be an object" in err, err


# ---------------------------------------------------------------------------------------------
# every value is checked before any process starts


@pytest.fixture
def no_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("argv, option, says", [
    (["verify", "--steps", "1000000000000"], "--steps", "give a positive integer up to 1,000,000,000"),
    (["verify", "--steps", "1e30"], "--steps", "give a positive integer up to 1,000,000,000"),
    (["verify", "--steps", "2.5"], "--steps", "give a positive integer"),
    (["verify", "--nproc", "100000"], "--nproc", "give a positive integer up to 1,024"),
    (["verify", "--nproc", "-1"], "--nproc", "give a positive integer up to 1,024"),
    (["verify", "--resume-at", "-1", "--", "true"], "--resume-at", "give a non-negative integer"),
    (["verify", "--run-timeout", "inf"], "--run-timeout", "give a positive number"),
    (["bisect", "--stop-after", "-1"], "--stop-after", "give a non-negative integer up to 1,000,000,000"),
    (["bisect", "--b-step-offset", "-3", "--a", "true", "--b", "true"], "--b-step-offset", "non-negative"),
    (["bisect", "--resume-at", "-1"], "--resume-at", "give a non-negative integer"),
    (["tax", "--confidence", "2"], "--confidence", "give a number strictly between 0 and 1"),
    (["tax", "--confidence", "0"], "--confidence", "strictly between 0 and 1"),
    (["tax", "--confidence", "nan"], "--confidence", "strictly between 0 and 1"),
    (["tax", "--budget", "-1"], "--budget", "give a non-negative integer up to 604,800"),
    (["tax", "--budget", "1e30"], "--budget", "give a non-negative integer"),
    (["tax", "--pairs", "0"], "--pairs", "give a positive integer"),
    (["tax", "--warmup", "-1"], "--warmup", "give a non-negative integer"),
    (["matrix", "--max-world-size", "0"], "--max-world-size", "give a positive integer up to 1,024"),
    (["matrix", "--global-batch", "-8"], "--global-batch", "give a non-negative integer"),
    (["replay", "RUN", "--step", "-1"], "--step", "give a non-negative integer"),
    (["replay", "RUN", "--step", "1", "--nproc", "5000"], "--nproc", "up to 1,024"),
    (["run", "--out", "o", "--step-offset", "-1", "--", "true"], "--step-offset", "non-negative"),
    (["dump", "RUN", "--rank", "-1"], "--rank", "give a non-negative integer"),
    (["show", "RUN", "--records", "--step", "-1"], "--step", "give a non-negative integer"),
    (["trace", "A", "B", "--step", "-2"], "--step", "give a non-negative integer"),
])
def test_a_value_out_of_range_is_refused_before_any_work(argv, option, says, no_process, capsys, tmp_path,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and says in err, err
    assert not list(tmp_path.iterdir())  # no output directory either


@pytest.mark.parametrize("argv, says", [
    (["matrix", "--precisions", "fp32,nope"], "--precisions: 'nope' is not a precision; give a comma-separated list "
                                              "of fp32, bf16, bf16_params, fp8_tensorwise, fp8_delayed, mxfp8, nvfp4"),
    (["tax", "--gate", "nan"], "--gate nan: a ratio gate is a positive finite number"),
    (["tax", "--gate", "inf"], "--gate inf: a ratio gate is a positive finite number"),
    (["verify", "--across", "dp=1,100000"], "dp100000 needs 100000 ranks; a run is at most 1024 ranks"),
])
def test_a_value_the_command_checks_is_refused_before_any_work(argv, says, no_process, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_the_matrix_knows_the_recipe_s_precisions():
    from samebits.cli.matrix import PRECISIONS
    from samebits.recipes.precision import PrecisionName

    assert PRECISIONS == typing.get_args(PrecisionName)


# ---------------------------------------------------------------------------------------------
# killing samebits ends its whole process tree

_TREE = """
import os, subprocess, sys, time
# a child in this process group, and one in a session of its own (as torchrun starts its workers)
group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {group.pid} {session.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_for(path: Path, seconds: float = 240) -> list[int]:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


@contextlib.contextmanager
def _reaping(pids: list[int]):
    """Whatever the test finds, kill what is left (on a broken launcher: the whole tree)."""
    try:
        yield
    finally:
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


pytestmark_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytestmark_linux
def test_a_timed_out_run_ends_with_every_process_it_started(tmp_path):
    from samebits.errors import SamebitsError
    from samebits.runners._launch import run_logged

    script, pids_file = tmp_path / "tree.py", tmp_path / "pids"
    script.write_text(_TREE)
    pids: list[int] = []
    with _reaping(pids):
        with pytest.raises(SamebitsError, match="did not finish within 5 s"):
            run_logged([sys.executable, str(script), str(pids_file)], tmp_path / "log", timeout=5, label="A")
        pids.extend(_wait_for(pids_file, 0))  # written well within the 5 s
        assert len(pids) == 3
        assert _gone_within(pids, 3.0) == []


@pytestmark_linux
def test_ctrl_c_while_a_run_goes_ends_its_processes(tmp_path):
    from samebits.runners._launch import run_logged

    script, pids_file = tmp_path / "tree.py", tmp_path / "pids"
    script.write_text(_TREE)
    pids: list[int] = []
    main_thread = threading.main_thread().ident

    def interrupt():
        pids.extend(_wait_for(pids_file))
        signal.pthread_kill(main_thread, signal.SIGINT)

    # Ctrl-C as a terminal delivers it: a shell that started the tests in the background without
    # job control has SIGINT ignored, and samebits rightly leaves an ignored signal alone.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with _reaping(pids):
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            with pytest.raises(KeyboardInterrupt):
                run_logged([sys.executable, str(script), str(pids_file)], tmp_path / "log", timeout=300, label="A")
        finally:
            signal.signal(signal.SIGINT, previous)
        assert len(pids) == 3
        assert _gone_within(pids, 3.0) == []


@pytestmark_linux
def test_sigterm_to_samebits_verify_ends_the_run_s_whole_tree(tmp_path):
    script, pids_file = tmp_path / "tree.py", tmp_path / "pids"
    script.write_text(_TREE)
    samebits = subprocess.Popen([sys.executable, "-m", "samebits", "verify", "--out", str(tmp_path / "out"), "--",
                                 sys.executable, str(script), str(pids_file)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    with _reaping(pids):
        try:
            pids.extend(_wait_for(pids_file))
        finally:
            samebits.send_signal(signal.SIGTERM)
            _, err = samebits.communicate(timeout=30)
        assert _gone_within(pids, 5.0) == [], err
        assert samebits.returncode == 128 + signal.SIGTERM
        assert "samebits verify: terminated (SIGTERM)" in err


@pytestmark_linux
def test_sigterm_to_samebits_run_ends_the_command_s_whole_tree(tmp_path):
    """`samebits run -- CMD` keeps CMD on our terminal, and still leaves no process behind."""
    script, pids_file = tmp_path / "tree.py", tmp_path / "pids"
    script.write_text(_TREE)
    samebits = subprocess.Popen([sys.executable, "-m", "samebits", "run", "--out", str(tmp_path / "out"), "--",
                                 sys.executable, str(script), str(pids_file)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    with _reaping(pids):
        try:
            pids.extend(_wait_for(pids_file))
        finally:
            samebits.send_signal(signal.SIGTERM)
            _, err = samebits.communicate(timeout=30)
        assert _gone_within(pids, 5.0) == [], err
        assert samebits.returncode == 128 + signal.SIGTERM, err


@pytest.mark.parametrize("command", [["verify"], ["bisect"], ["tax"]])
def test_a_recipe_config_the_recipe_refuses_is_refused_before_any_run(tmp_path, capsys, command):
    """`--set` is the recipe's: checked by the recipe itself (`--check`, one process that trains
    nothing) before any run starts and before the output folder exists."""
    from samebits.cli import main

    out = tmp_path / "out"
    code = main([*command, "--out", str(out), "--set", "no_such_key=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the recipe refuses these options, before any run" in err and "no_such_key" in err
    assert not out.exists()
