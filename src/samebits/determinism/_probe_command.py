"""`samebits probe -- CMD`: run a command with the probe started in its Python processes.

A subprocess with an injected ``sitecustomize`` (not ``runpy``) runs the command as written
(launchers, ``-m``, its exit code), probes every Python process it starts and never imports
the user's code into the CLI.  Parent (`probe_command`): sets ``SAMEBITS_PROBE_DIR``, then
merges one ``process-PID.json`` per probed process.  Child (`start`): enters a `Probe` for the
rest of the process and saves findings as they appear (a crash keeps them).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from samebits._inject import with_injection
from samebits._torchutil import process_rank
from samebits.determinism._probe import (DEFAULT_COMPARISONS, DEFAULT_NAMESPACES, MIN_COMPARISONS,
                                         Probe, miss_bound)
from samebits.errors import SamebitsError
from samebits.verdicts import ToDict

ENV_DIR = "SAMEBITS_PROBE_DIR"
ENV_STEPS = "SAMEBITS_PROBE_STEPS"
ENV_NAMESPACES = "SAMEBITS_PROBE_NAMESPACES"
OPTIONS_FILE = "options.json"  # in ENV_DIR: options that have no variable of their own


class _StepLimitReached(SystemExit):
    """Ends the probed program after the requested number of optimizer steps (exit 0)."""


# -- child side ------------------------------------------------------------------------

_child: dict[str, Any] = {}


def start() -> None:
    """Start probing this process until it exits (called by the injected sitecustomize)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    namespaces = tuple(filter(None, os.environ.get(ENV_NAMESPACES, "").split(","))) \
        or DEFAULT_NAMESPACES
    steps = int(os.environ.get(ENV_STEPS) or 0) or None
    options = {}
    options_path = os.path.join(os.environ[ENV_DIR], OPTIONS_FILE)
    if os.path.exists(options_path):
        with open(options_path) as f:
            options = json.load(f)
    probe = Probe(namespaces=namespaces, comparisons=options.get("comparisons", DEFAULT_COMPARISONS),
                  on_finding=lambda finding: _save(complete=False))
    _child.update(probe=probe, dir=os.environ[ENV_DIR], steps_limit=steps, steps=0,
                  limit_reached=False, pid=os.getpid(), saved_final=False)
    _save(complete=False)
    probe.__enter__()
    atexit.register(_finish)
    if steps:
        register_optimizer_step_post_hook(_after_step)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_stop_in_forked_child)


def _after_step(optimizer, args, kwargs) -> None:
    _child["steps"] += 1
    if _child["steps"] >= _child["steps_limit"] and not _child["limit_reached"]:
        _child["limit_reached"] = True
        _finish()
        raise _StepLimitReached(0)


def _finish() -> None:
    if _child.get("saved_final") or _child.get("pid") != os.getpid():
        return
    probe = _child["probe"]
    try:
        probe.__exit__(None, None, None)
    finally:
        _save(complete=True)
        _child["saved_final"] = True


def _stop_in_forked_child() -> None:
    probe = _child.get("probe")
    _child["pid"] = None  # never write the parent's file from the child
    if probe is not None and probe._mode is not None:
        try:
            probe.__exit__(None, None, None)
        except Exception:  # forked from a thread without the mode: nothing to undo there
            pass


def _save(*, complete: bool) -> None:
    if _child.get("pid") != os.getpid():
        return
    probe = _child["probe"]
    payload = {"pid": os.getpid(), "rank": process_rank(), "argv": sys.argv,
               "complete": complete, "steps": _child["steps"],
               "step_limit_reached": _child["limit_reached"], "report": probe.report().to_dict()}
    path = os.path.join(_child["dir"], f"process-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, default=str)
    os.replace(path + ".tmp", path)


# -- parent side -----------------------------------------------------------------------


@dataclass
class CommandProbeResult(ToDict):
    """What `samebits probe -- CMD` found across every probed process of the command."""

    dict_keys = ("command", "returncode", "clean", "problems", "comparisons", "bound", "processes",
                 "findings", "not_compared")

    command: list[str]
    returncode: int
    processes: list[dict]
    findings: list[dict]
    problems: list[str] = field(default_factory=list)  # reasons the verdict is incomplete
    comparisons: int = DEFAULT_COMPARISONS  # the target per op signature
    # The fewest comparisons of any op signature that never differed, over all processes
    # (None: no op was compared); the bound of a clean verdict rests on it.
    min_comparisons: int | None = None
    # {"op", "reason", "calls", "calls_compared", "computes_nothing"}, merged over processes:
    # the ops that ran once, uncompared, in some of their calls.
    not_compared: list[dict] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return not self.problems

    @property
    def clean(self) -> bool:
        """Ran, compared something, found nothing: the verdict that states `bound`."""
        return self.ran and not self.findings and self.min_comparisons is not None

    @property
    def bound(self) -> dict | None:
        return miss_bound(self.min_comparisons) if self.min_comparisons else None

    def dict_extras(self) -> dict:
        return {"clean": self.clean, "bound": self.bound}


def probe_command(command: list[str], *, steps: int | None = None,
                  namespaces: tuple[str, ...] | None = None,
                  comparisons: int = DEFAULT_COMPARISONS,
                  stdout: Any = None) -> CommandProbeResult:
    """Run `command` with the probe in each of its Python processes and collect the findings;
    ``stdout``: where the command's output goes (None: inherited)."""
    if not command:
        raise SamebitsError("no command to probe: write it after '--', e.g. "
                            "samebits probe -- python train.py --steps 1")
    if not isinstance(comparisons, int) or comparisons < MIN_COMPARISONS:
        raise ValueError(f"probe_command(comparisons={comparisons!r}): give an integer of at least "
                         f"{MIN_COMPARISONS}; one comparison cannot tell a rare race from none")
    workdir = tempfile.mkdtemp(prefix="samebits-probe-")
    try:
        with open(os.path.join(workdir, OPTIONS_FILE), "w") as f:
            json.dump({"comparisons": comparisons}, f)
        env = with_injection(os.environ)
        env[ENV_DIR] = workdir
        env[ENV_STEPS] = str(steps or "")
        env[ENV_NAMESPACES] = ",".join(namespaces or ())
        forward = stdout is not None and not _has_fileno(stdout)
        try:
            completed = subprocess.run(command, env=env,
                                       stdout=subprocess.PIPE if forward else stdout,
                                       text=forward or None)
        except OSError as err:
            raise SamebitsError(f"cannot run {command[0]!r}: {err.strerror or err}; check the "
                                "command after '--'") from err
        if forward:
            stdout.write(completed.stdout)
        result = _collect(command, completed.returncode, workdir)
        result.comparisons = comparisons
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    return True


def _collect(command: list[str], returncode: int, workdir: str) -> CommandProbeResult:
    processes, findings, problems = [], [], []
    min_comparisons: list[int] = []
    not_compared: dict[tuple[str, str], dict] = {}
    for name in sorted(os.listdir(workdir)):
        path = os.path.join(workdir, name)
        if name.startswith("boot-error-"):
            with open(path) as f:
                problems.append(f"the probe failed to start in process {name[11:-4]}: {f.read()}")
        if not (name.startswith("process-") and name.endswith(".json")):
            continue
        with open(path) as f:
            data = json.load(f)
        report = data.pop("report")
        data.update(num_ops=report["num_ops"], num_ops_compared=report["num_ops_compared"],
                    num_signatures=report.get("num_signatures", 0),
                    min_comparisons=report.get("min_comparisons"), seconds=report["seconds"])
        processes.append(data)
        if data["min_comparisons"] is not None:
            min_comparisons.append(data["min_comparisons"])
        for entry in report.get("not_compared", []):
            merged = not_compared.setdefault((entry["op"], entry["reason"]), {**entry, "calls": 0,
                                                                              "calls_compared": 0})
            merged["calls"] += entry["calls"]
            merged["calls_compared"] += entry["calls_compared"]
        for finding in report["findings"]:
            findings.append({**finding, "pid": data["pid"], "rank": data["rank"]})
        if not data["complete"]:
            problems.append(f"process {data['pid']} ({' '.join(data['argv'])}) ended before the "
                            "probe finished (killed or os._exit): its findings may be incomplete")
    limit_reached = any(p["step_limit_reached"] for p in processes)
    if not processes and not problems:
        problems.append("the probe did not start in any process: the command must run Python "
                        "without -I or -S (they skip sitecustomize), with torch importable")
    if returncode != 0 and not limit_reached:
        problems.append(f"the command exited with code {returncode}")
    if processes and not problems and not any(p["num_ops_compared"] for p in processes):
        problems.append("no op was compared: the command ran no torch op in a probed namespace, so "
                        "there is nothing to conclude (see the ops not compared)")
    # Ops that may compute something first, the busiest first.
    ordered = sorted(not_compared.values(), key=lambda e: (e["computes_nothing"], -e["calls"], e["op"]))
    return CommandProbeResult(command=command, returncode=returncode, processes=processes,
                              findings=findings, problems=problems,
                              min_comparisons=min(min_comparisons) if min_comparisons else None,
                              not_compared=ordered)
