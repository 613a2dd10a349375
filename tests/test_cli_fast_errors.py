"""Mistakes on the command line are refused at once (issue 35, items 5 and 8).

* A program given without ``--`` before it (``samebits verify python mygpt.py --out x``) is
  refused before anything runs, with the command line that has ``--`` in place: samebits took
  ``--out x`` as its own option, and the program failed seconds later in its own words.
* Argument and path errors (a run folder that does not exist, an output folder in use,
  ``--resume-with`` without ``--resume-at``) are found before the library, and torch with it,
  is loaded: each took 9-12 s on a loaded machine, most of it importing torch.  The tests check
  that torch is not imported on these paths (`sys.modules` in a fresh interpreter), not the
  time; the times are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import write_run
from samebits.cli import build_parser, forgotten_separator

# (argv, what the error says); RUNS, USED, NEW and MISSING are filled in by `_argv`.
CASES = [
    (["show", "MISSING"], "MISSING: no such run directory; give the folder a run was recorded into"),
    (["show", "RUNS"], "RUNS: no fingerprint streams (rank-NNNNN.sbs) in this directory. It holds the runs a, b"),
    (["show", "RUNS/a/rank-00000.sbs"], "RUNS/a/rank-00000.sbs: a file, not a directory"),
    (["dump", "MISSING", "--step", "1"], "MISSING: no such run directory"),
    (["diff", "RUNS/a", "MISSING"], "MISSING: no such run directory"),
    (["trace", "MISSING", "RUNS/a"], "MISSING: no such run directory"),
    (["replay", "MISSING", "--step", "1"], "MISSING: no such run directory"),
    (["report", "MISSING"], "MISSING: no such directory; give the output directory of samebits verify"),
    (["run", "--out", "USED", "--", "python", "train.py"], "--out USED exists and is not an empty directory"),
    (["run", "--out", "NEW", "--reference", "MISSING", "--", "python", "train.py"], "MISSING: no such run directory"),
    (["verify", "--resume-with", "python train.py --resume {from}", "--", "python", "train.py"],
     "--resume-with needs --resume-at K"),
    (["verify", "--resume-at", "2", "--", "python", "train.py"], "--resume-at without --resume-with"),
    (["verify", "--require-resume", "--", "python", "train.py"], "--require-resume: no resume check asked for"),
    (["verify", "--", "python", "train.py", "--resume", "{from}"], "the command holds {from}"),
    (["verify", "--out", "USED"], "--out USED exists and is not an empty directory"),
    (["verify", "--steps", "4", "--resume-at", "4"], "--resume-at 4 must be between 1 and 3"),
    (["verify", "--resume-with", "python train.py"], "--resume-with needs a command of yours"),
    (["verify", "--resume-across"], "--resume-across needs --across LAYOUTS"),
    (["bisect", "--resume-at", "9"], "--resume-at 9 must be between 1 and 3"),
    (["bisect", "--out", "USED"], "--out USED exists and is not an empty directory"),
    (["bisect", "--b-step-offset", "2", "--", "python", "train.py"], "--b-step-offset needs --a and --b"),
    (["verify", "--across", "xp=1,2"], "--across 'xp=1,2': 'xp=1,2' is not KEY=N,N,..."),
    (["verify", "--across", "dp=1,100000"], "dp100000 needs 100000 ranks; a run is at most 1024 ranks"),
    (["matrix", "--cells", "single,nope"], "cell 'nope': 'nope' is not one of dpN"),
    (["matrix", "--precisions", "fp32,nope"], "--precisions: 'nope' is not a precision"),
    (["matrix", "--cells", "single,dp2", "--baseline", "tp2"], "--baseline 'tp2' is not one of the cells (single, dp2)"),
    (["matrix", "--out", "USED"], "--out USED exists and is not an empty directory"),
    (["verify", "python", "mygpt.py", "--out", "x"], "did you forget `--`?"),
    (["run", "--out", "NEW", "python", "train.py"], "did you forget `--`?"),
    (["bisect", "python", "train.py"], "did you forget `--`?"),
    (["tax", "python", "train.py", "{deterministic}"], "did you forget `--`?"),
    (["probe", "python", "train.py"], "did you forget `--`?"),
    (["probe"], "no command to probe"),
    (["tax", "--a", "python a.py"], "--a and --b go together"),
    (["tax", "--a", "python a.py", "--b", "python b.py", "--", "python", "t.py"], "not both"),
    (["tax", "--", "python", "train.py"], "the command has no {deterministic}"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-errors")
    for name in ("a", "b"):
        write_run(root / "runs" / name, world_size=1, num_steps=2)
    (root / "used").mkdir()
    (root / "used" / "earlier.log").write_text("an earlier run's\n")
    return {"RUNS": str(root / "runs"), "USED": str(root / "used"), "NEW": str(root / "new"),
            "MISSING": str(root / "no-such-run")}


def _argv(argv: list[str], paths: dict) -> list[str]:
    return [re.sub(r"\b(RUNS|USED|NEW|MISSING)\b", lambda found: paths[found.group()], word) for word in argv]


@pytest.fixture(scope="module")
def outcomes(paths):
    """Every case through `samebits.cli.main` in one fresh interpreter: its exit code, its
    stderr, and whether torch was imported by then (once imported it stays: the first case that
    imports it is the one named)."""
    script = """
import contextlib, io, json, sys
from samebits.cli import main
found = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    found.append({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(found))
"""
    cases = [_argv(argv, paths) for argv, _ in CASES]
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=paths["NEW"].rsplit("/", 1)[0])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("number", range(len(CASES)), ids=lambda n: " ".join(CASES[n][0]))
def test_a_mistake_is_refused_before_torch_is_imported(number, outcomes, paths):
    argv, says = CASES[number]
    found = outcomes[number]
    assert found["code"] == 2, found
    assert _argv([says], paths)[0] in found["err"], found["err"]
    assert "Traceback" not in found["err"]
    assert not found["torch"], f"samebits {' '.join(argv)}: torch was imported before the error"
    assert not os.path.exists(paths["NEW"])  # nothing was written


@pytest.mark.parametrize("argv, program, options", [
    (["verify", "python", "mygpt.py", "--out", "x"], ["python", "mygpt.py", "--out", "x"], "--out"),
    (["run", "--out", "r", "python", "t.py", "--record-steps", "3", "-q"],
     ["python", "t.py", "--record-steps", "3", "-q"], "--record-steps, -q"),
    (["bisect", "--stop-after", "3", "torchrun", "--nproc-per-node", "2", "t.py"],
     ["torchrun", "--nproc-per-node", "2", "t.py"], None),
    (["verify", "--out", "o", "--json", "python", "t.py"], ["python", "t.py"], None),
    (["verify", "--across", "dp=1,2", "python", "t.py", "{nproc}", "{out}"], ["python", "t.py", "{nproc}", "{out}"],
     None),  # argparse would read the program as more layouts
])
def test_a_command_without_double_dash_gets_the_command_line_that_has_it(argv, program, options):
    parser = build_parser()
    said = forgotten_separator(argv, parser)
    assert said is not None and said.startswith(f"`{program[0]}` starts a command with no `--` before it: did you "
                                                "forget `--`?")
    if options is not None:
        assert f"samebits takes {options} as its own option" in said
    fixed = shlex.split(said.splitlines()[-1])
    assert fixed[0] == "samebits" and fixed[fixed.index("--") + 1:] == program
    args = parser.parse_args(fixed[1:])  # the command line shown parses, the program whole after `--`
    assert args.cmd == program
    assert forgotten_separator(fixed[1:], parser) is None


@pytest.mark.parametrize("argv", [
    ["verify", "--", "python", "train.py", "--out", "x"],
    ["verify", "--out", "o", "--resume-with", "python t.py --resume {from}", "--resume-at", "2", "--", "python",
     "t.py"],
    ["verify"],
    ["verify", "--across", "dp=1,2", "--", "python", "t.py", "{nproc}", "{out}"],
    ["verify", "--across", "dp=1,2", "tp=1,2"],
    ["verify", "--across", "single,dp2,tp2"],
    ["run", "--out=o", "--", "python", "t.py"],
    ["diff", "runs/a", "runs/b"],  # positionals that are runs, not a program
    ["show", "runs/a", "--records"],
    ["coverage", "mypackage.kernels"],
    ["verify", "--outt", "o", "python", "t.py"],  # an unknown option: argparse names it (did you mean --out?)
])
def test_a_command_line_with_double_dash_or_without_a_program_passes(argv):
    assert forgotten_separator(argv, build_parser()) is None
