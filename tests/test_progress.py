"""Live progress of long work (issue 27): each run's steps read from its streams as they land.

Unit tests drive `StreamTail` and `StepWatcher` by hand (a fake clock, a stream written a
step at a time) for the line format, the rate limit of plain lines, the stall report and
``-q``; `run_logged` follows a child that writes a stream step by step; and the issue's check,
`samebits verify` and `samebits bisect` on a slow training command, reads the CLI's stderr as
it comes and wants each step's line within 2 s of the step being written.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.cli import verify as cli_verify
from samebits.errors import ConfigError
from samebits.runners._launch import run_logged
from samebits.runners.progress import MIN_STALL_S, STALL_FACTOR, Progress, StepWatcher, indented, watching
from samebits.stream import StreamReader
from samebits.stream.follow import StreamTail
from samebits.verdicts import EXIT_CANNOT_RUN


def _record(directory: Path, steps: int, *, rank: int = 0, world_size: int = 1) -> Path:
    """A finished one-rank stream of ``steps`` steps (a metric, then two tensors per step)."""
    rec = samebits.Recorder(directory, rank=rank, world_size=world_size)
    for step in range(steps):
        rec.metrics(step, loss=float(step))
        rec.tensors(step, "params", [("fc.weight", torch.full((3,), float(step))), ("fc.bias", torch.ones(2))])
        rec.end_step(step)
    rec.close()
    return directory / f"rank-{rank:05d}.sbs"


def _step_cuts(path: Path) -> list[int]:
    """Byte offsets at which the stream holds 1, 2, ... complete steps (each just before the
    next step's frame, and the file's end for the last)."""
    reader = StreamReader(path)
    starts = [offset for _, _, _, offset in reader.step_index()]
    reader.close()
    return starts[1:] + [path.stat().st_size]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Growing:
    """A copy of a finished stream, grown a step at a time, as its writer would."""

    def __init__(self, source: Path, run_dir: Path, rank: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.data = source.read_bytes()
        self.cuts = _step_cuts(source)
        self.path = run_dir / f"rank-{rank:05d}.sbs"
        self.written = 0

    def to_step(self, steps: int, extra: int = 0) -> None:
        """Hold ``steps`` complete steps (and ``extra`` bytes of the next frame)."""
        end = self.cuts[steps - 1] + extra if steps else extra
        with open(self.path, "ab") as file:
            file.write(self.data[self.written:end])
        self.written = end


# -- following a stream ------------------------------------------------------------------------

def test_a_tail_sees_each_step_once_as_it_lands_torn_frames_included(tmp_path, monkeypatch):
    stream = Growing(_record(tmp_path / "done", 4), tmp_path / "run")
    tail = StreamTail(stream.path)
    assert tail.poll() == []  # no file yet
    stream.to_step(0, extra=10)  # a header frame, cut
    assert tail.poll() == []
    stream.to_step(1, extra=5)  # step 0, and 5 bytes of what follows
    seen = tail.poll()
    assert [(s.step, s.records) for s in seen] == [(0, 3)] and seen[0].last == ("params", "fc.bias")
    assert tail.rank == 0
    stream.to_step(3)
    assert [s.step for s in tail.poll()] == [1, 2]
    # a file that did not grow is not opened again; a grown one is read from where the last read ended
    opened = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):
        opened.append(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("samebits.stream.follow.open", counting_open, raising=False)
    assert tail.poll() == [] and opened == []
    stream.to_step(4)
    assert [s.step for s in tail.poll()] == [3] and len(opened) == 1
    assert tail._offset == stream.path.stat().st_size and tail.broken is None


def test_a_tail_stops_quietly_at_a_damaged_frame(tmp_path):
    source = _record(tmp_path / "done", 3)
    damaged = bytearray(source.read_bytes())
    cut = _step_cuts(source)[0]
    damaged[cut - 3] ^= 0xFF  # inside step 0's checksum
    path = tmp_path / "run" / "rank-00000.sbs"
    path.parent.mkdir()
    path.write_bytes(bytes(damaged))
    tail = StreamTail(path)
    assert tail.poll() == [] and "checksum" in tail.broken
    assert tail.poll() == []


# -- the watcher: lines, rate limit, stall ---------------------------------------------------------

def _watcher(tmp_path, clock, **kwargs):
    shown, warned = [], []
    watcher = StepWatcher(tmp_path / "run", "B", show=shown.append, warn=warned.append, clock=clock, **kwargs)
    return watcher, shown, warned


def test_plain_lines_name_the_step_rate_elapsed_and_last_record(tmp_path):
    clock = Clock()
    stream = Growing(_record(tmp_path / "done", 6), tmp_path / "run")
    watcher, shown, warned = _watcher(tmp_path, clock, steps=6, log="logs/b.log")
    watcher.poll()
    assert shown == []  # nothing written yet
    for step in range(1, 4):
        clock.now += 2.0
        stream.to_step(step)
        watcher.poll()
    assert len(shown) == 3 and warned == []
    assert shown[0] == "B: step 0 done (1/6)  run 2.0s  last: params/fc.bias"
    assert shown[2] == "B: step 2 done (3/6)  2.0 s/step  run 6.0s  last: params/fc.bias"


def test_plain_lines_are_rate_limited_but_the_newest_step_is_shown(tmp_path):
    clock = Clock()
    stream = Growing(_record(tmp_path / "done", 6), tmp_path / "run")
    watcher, shown, _ = _watcher(tmp_path, clock, interval_s=1.0)
    for step in range(1, 6):  # a step every 0.25 s: at most one line a second
        clock.now += 0.25
        stream.to_step(step)
        watcher.poll()
    assert [line.split("  ")[0] for line in shown] == ["B: step 0 done (1)", "B: step 4 done (5)"]
    clock.now += 1.0
    watcher.poll()
    assert len(shown) == 2  # nothing new: no line
    stream.to_step(6)
    watcher.poll()
    assert shown[-1].startswith("B: step 5 done (6)  2.5 steps/s")  # 5 steps in 2 s


def test_a_terminal_status_line_moves_on_every_look_that_saw_a_step(tmp_path):
    clock = Clock()
    stream = Growing(_record(tmp_path / "done", 3), tmp_path / "run")
    watcher, shown, _ = _watcher(tmp_path, clock, interval_s=1.0, every_change=True)
    for step in (1, 2, 3):
        clock.now += 0.25
        stream.to_step(step)
        watcher.poll()
    assert [line.split("  ")[0] for line in shown] == [f"B: step {s} done ({s + 1})" for s in range(3)]
    clock.now += 1.0
    watcher.poll()  # no new step, but its elapsed time moves
    assert len(shown) == 4 and "run 1.75s" not in shown[-1] and "run 1.8s" in shown[-1]


def test_a_stalled_run_is_reported_once_then_its_next_step(tmp_path):
    clock = Clock()
    stream = Growing(_record(tmp_path / "done", 5), tmp_path / "run")
    watcher, shown, warned = _watcher(tmp_path, clock, log="out/logs/b.log", stall_factor=10, min_stall_s=5)
    for step in (1, 2, 3):  # a step every 2 s: median 2 s, a stall after 20 s
        clock.now += 2.0
        stream.to_step(step)
        watcher.poll()
    clock.now += 19.5
    watcher.poll()
    assert warned == []
    clock.now += 1.0
    watcher.poll()
    assert warned == ["B: no step for 20 s (median step 2.0 s): still running, see out/logs/b.log"]
    clock.now += 60.2
    watcher.poll()
    assert len(warned) == 1  # once per stall
    stream.to_step(4)
    watcher.poll()
    assert warned[1] == "B: step 3 done after 81 s without a step"
    assert shown[-1].startswith("B: step 3 done (4)")


def test_a_stall_needs_at_least_min_stall_s_and_two_steps(tmp_path):
    clock = Clock()
    stream = Growing(_record(tmp_path / "done", 3), tmp_path / "run")
    watcher, _, warned = _watcher(tmp_path, clock, stall_factor=10, min_stall_s=30)
    clock.now += 0.1
    stream.to_step(1)
    watcher.poll()
    clock.now += 1000
    watcher.poll()
    assert warned == []  # one step: no step time known yet
    stream.to_step(2)
    watcher.poll()  # a step time of 1000 s
    clock.now += 200
    watcher.poll()
    assert warned == []
    watcher2, _, warned2 = _watcher(tmp_path / "x", clock, stall_factor=10, min_stall_s=30)
    fast = Growing(_record(tmp_path / "done2", 3), tmp_path / "x" / "run")
    for step in (1, 2, 3):  # 0.1 s steps: 10 x median is 1 s, but the floor is 30 s
        clock.now += 0.1
        fast.to_step(step)
        watcher2.poll()
    clock.now += 29
    watcher2.poll()
    assert warned2 == []
    clock.now += 2
    watcher2.poll()
    assert len(warned2) == 1 and "no step for 31 s" in warned2[0]


def test_ranks_behind_the_lead_are_named(tmp_path):
    clock = Clock()
    ranks = [Growing(_record(tmp_path / f"done{r}", 3, rank=r, world_size=2), tmp_path / "run", rank=r)
             for r in (0, 1)]
    watcher, shown, _ = _watcher(tmp_path, clock)
    ranks[0].to_step(2)
    ranks[1].to_step(1)
    clock.now += 1
    watcher.poll()
    assert shown[-1].startswith("B: step 1 done (2) rank 1 at step 0  ")


# -- Progress: stamps, terminal, -q -----------------------------------------------------------------

def test_progress_stamps_every_line_and_cleans_it():
    clock, out = Clock(), io.StringIO()
    progress = Progress(out, tty=False, clean=lambda text: text.replace("\x1b", "\\x1b"), clock=clock)
    clock.now += 12.34
    progress("[1/3] run A\nsecond line")
    progress.status("A: step 3 done (4)\x1b[2J")
    progress.warn("A: no step for 95 s")
    lines = out.getvalue().splitlines()
    assert lines == ["[  12.3s] [1/3] run A", " " * 10 + "second line", "[  12.3s] A: step 3 done (4)\\x1b[2J",
                     "[  12.3s] A: no step for 95 s"]


def test_on_a_terminal_the_step_line_is_rewritten_in_place_and_other_lines_go_above_it():
    clock, out = Clock(), io.StringIO()
    progress = Progress(out, tty=True, clock=clock)
    progress.status("A: step 0 done (1)")
    progress.status("A: step 1 done (2)")
    progress("      done in 2.0 s")
    progress.end_status()
    assert out.getvalue() == ("\r\x1b[K[   0.0s] A: step 0 done (1)" "\r\x1b[K[   0.0s] A: step 1 done (2)"
                              "\r\x1b[K[   0.0s]       done in 2.0 s\n[   0.0s] A: step 1 done (2)" "\r\x1b[K")


def test_a_status_line_wider_than_the_terminal_is_cut_so_that_it_can_be_rewritten():
    out = io.StringIO()  # no terminal size to ask: 100 columns
    Progress(out, tty=True).status("A: step 0 done (1)  last: " + "x" * 200)
    assert len(out.getvalue()) == len("\r\x1b[K") + 99


def test_quiet_silences_progress_but_not_a_stall():
    out = io.StringIO()
    progress = Progress(out, tty=True, quiet=True)
    progress("[1/3] run A")
    progress.status("A: step 0 done (1)")
    progress.indented("   ")("nested")
    assert out.getvalue() == ""
    progress.warn("A: no step for 95 s")
    assert out.getvalue().endswith("A: no step for 95 s\n")


def test_an_indented_view_shares_the_status_line():
    out = io.StringIO()
    progress = Progress(out, tty=True)
    view = indented(progress, "      ")
    assert isinstance(view, Progress)
    view.status("A: step 0 done (1)")
    progress("cell done")  # drawn above the status line the view put up
    assert out.getvalue().endswith("cell done\n[   0.0s]       A: step 0 done (1)")
    said = []
    plain = indented(said.append, "  ")
    plain("  text ")
    assert said == ["  text"]


def test_watching_needs_a_callback_and_a_folder(tmp_path):
    for progress, streams in ((None, tmp_path), (print, None)):
        with watching(progress, streams, "A") as watcher:
            assert watcher is None


def test_progress_defaults_match_the_cli_help():
    from samebits.cli._options import MIN_STALL_HELP, STALL_FACTOR_HELP
    assert float(STALL_FACTOR_HELP) == STALL_FACTOR and float(MIN_STALL_HELP) == MIN_STALL_S


# -- run_logged follows a child's stream ------------------------------------------------------------

WRITER = textwrap.dedent('''
    import sys, time
    data, cuts, target, times = open(sys.argv[1], "rb").read(), [int(c) for c in sys.argv[2].split(",")], sys.argv[3], sys.argv[4]
    done = 0
    for cut in cuts:  # as a recorder writes: one step's frames per write, then the step's wall time
        time.sleep(float(sys.argv[5]))
        with open(target, "ab") as file:
            file.write(data[done:cut])
        done = cut
        with open(times, "a") as file:
            file.write(f"{time.time()}\\n")
''')


def _arrivals_within(lines: list[tuple[float, str]], times: list[float], label: str, window: float) -> list[str]:
    """What went wrong: each step k (written at times[k]) needs a line "LABEL: step k done"
    that arrived within ``window`` seconds after it."""
    problems = []
    for step, written in enumerate(times):
        arrived = [when for when, text in lines if re.search(rf"\b{re.escape(label)}: step {step} done", text)]
        if not any(written - 0.5 <= when <= written + window for when in arrived):
            problems.append(f"step {step} written at {written:.2f}: lines at {[round(w, 2) for w in arrived]}")
    return problems


def test_run_logged_reports_each_step_of_the_child_as_it_lands(tmp_path):
    source = _record(tmp_path / "done", 3)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    run_dir, times = tmp_path / "run", tmp_path / "times.txt"
    run_dir.mkdir()
    said: list[tuple[float, str]] = []
    argv = [sys.executable, str(script), str(source), ",".join(map(str, _step_cuts(source))),
            str(run_dir / "rank-00000.sbs"), str(times), "1.05"]  # a step a second
    code, _ = run_logged(argv, tmp_path / "logs" / "w.log", label="W", steps=3, streams=run_dir,
                         progress=lambda message: said.append((time.time(), message)))
    assert code == 0
    written = [float(line) for line in times.read_text().split()]
    assert _arrivals_within(said, written, "W", 2.0) == [], said
    assert said[-1][1].startswith("W: step 2 done (3/3)")


def test_quiet_cli_prints_no_progress(monkeypatch, capsys):
    def fake(*args, progress, **kwargs):
        progress("[1/3] run A: python train.py")
        raise ConfigError("stopped here by the test")

    monkeypatch.setattr(cli_verify, "verify", fake)
    assert main(["verify", "-q", "--", "python", "train.py"]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "run A" not in err and "stopped here by the test" in err
    assert main(["verify", "--", "python", "train.py"]) == EXIT_CANNOT_RUN
    assert re.search(r"^\[\s*\d+\.\ds\] \[1/3\] run A: python train.py$", capsys.readouterr().err, re.M)


def test_the_commands_that_launch_runs_take_q_and_a_stall_factor(capsys):
    for command in ("verify", "bisect", "matrix", "tax", "run"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "-q, --quiet" in text and "--stall-factor N" in text, command
    with pytest.raises(SystemExit):
        main(["verify", "--stall-factor", "0", "--", "python", "x.py"])
    assert "--stall-factor: give a positive number" in capsys.readouterr().err


# -- the check: verify and bisect on a slow training command --------------------------------
# (verify's, about 15 s, is the fast suite's one end-to-end check of live progress; bisect's runs
# the command four times and more, and is slow)

SLOW_TRAINING = textwrap.dedent('''
    """A training command whose steps take about a second: after each optimizer step (where
    zero-code recording writes the step), the wall time goes to $PROGRESS_TIMES."""
    import os, time, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(int(os.environ["PROGRESS_STEPS"])):
        loss = model(torch.ones(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with open(os.environ["PROGRESS_TIMES"], "a") as file:
            file.write(f"{os.getpid()} {step} {time.time()}\\n")
        time.sleep(1.0)
''')


def _run_cli(argv: list[str], env: dict) -> tuple[int, str, list[tuple[float, str]]]:
    """Run ``python -m samebits ARGV``; its stdout, and each stderr line with when it arrived."""
    process = subprocess.Popen([sys.executable, "-m", "samebits", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in process.stderr:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    out = process.stdout.read()
    code = process.wait(timeout=600)
    reader.join()
    return code, out, lines


def _step_times(path: Path) -> list[list[float]]:
    """Per run (in the order they ran), the wall time of each step."""
    runs: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        pid, _, written = line.split()
        runs.setdefault(pid, []).append(float(written))
    return list(runs.values())


@pytest.fixture
def slow_command(tmp_path):
    script = tmp_path / "slow_train.py"
    script.write_text(SLOW_TRAINING)
    env = dict(os.environ, PROGRESS_TIMES=str(tmp_path / "times.txt"), PROGRESS_STEPS="3")
    return [sys.executable, str(script)], env


def test_verify_shows_each_step_of_a_slow_command_within_2_s(tmp_path, slow_command):
    cmd, env = slow_command
    code, out, lines = _run_cli(["verify", "--json", "--out", str(tmp_path / "v"), "--", *cmd], env)
    assert code == 0, (out, lines)
    assert json.loads(out)["verdict"] == "pass"  # --json: stdout is the JSON alone, progress on stderr
    runs = _step_times(tmp_path / "times.txt")
    assert len(runs) == 2
    for label, times in zip("AB", runs):
        assert _arrivals_within(lines, times, label, 2.0) == [], lines
    assert all(re.match(r"\[\s*\d+\.\ds\] ", text) for _, text in lines), lines  # every line stamped


@pytest.mark.slow
def test_bisect_shows_each_step_of_a_slow_command_within_2_s(tmp_path, slow_command):
    cmd, env = slow_command
    code, out, lines = _run_cli(["bisect", "--out", str(tmp_path / "b"), "--", *cmd], env)
    assert code == 0, (out, lines)
    runs = _step_times(tmp_path / "times.txt")
    assert len(runs) >= 2
    labels = [m.group(1) for _, text in lines for m in [re.search(r"\] (\w+): step 0 done", text)] if m]
    assert len(labels) == len(runs), lines
    for label, times in zip(labels, runs):
        assert _arrivals_within(lines, times, label, 2.0) == [], lines
    # and -q silences it: no stage lines, no step lines
    code, _, quiet = _run_cli(["bisect", "-q", "--out", str(tmp_path / "q"), "--", *cmd],
                              dict(env, PROGRESS_STEPS="2"))
    assert code == 0 and [text for _, text in quiet if re.match(r"\[\s*\d", text)] == [], quiet
