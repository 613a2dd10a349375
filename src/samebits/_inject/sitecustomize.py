"""Injected by samebits (see samebits._inject): run the sitecustomize this one shadows, then
start what the environment asks for.  Never breaks the user's program: a failure is reported
and the program runs on without that feature."""

import os
import sys


def _run_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    _run_shadowed_sitecustomize()
except Exception as err:  # the environment's own sitecustomize failed: say so, carry on
    print(f"samebits: the shadowed sitecustomize failed in pid {os.getpid()}: {err!r}", file=sys.stderr)


# SAMEBITS_AUTORECORD and SAMEBITS_PROBE_DIR, parsed by `samebits.settings`.  Every Python
# process of the command runs this file, so samebits (and torch with it) is imported only
# when one of the two names is present at all.
_record, _probe_dir = False, None
if any(os.environ.get(name, "").strip() for name in ("SAMEBITS_AUTORECORD", "SAMEBITS_PROBE_DIR")):
    try:
        from samebits import settings as _settings

        _record = bool(_settings.read("SAMEBITS_AUTORECORD"))
        _probe_dir = _settings.read("SAMEBITS_PROBE_DIR")
    except Exception as err:  # a bad value: say so, and run the program untouched
        print(f"samebits: disabled in pid {os.getpid()}: {err}", file=sys.stderr)

if _record:
    try:
        import samebits.autorecord

        samebits.autorecord.install()
    except Exception as err:  # a gap for the whole process: its verdict is INCOMPLETE, never PASS
        try:
            from samebits.autorecord import record_gap

            record_gap("startup", err, records="everything (recording could not start)")
        except Exception:  # noqa: BLE001 - a line on stderr is all that can be said
            print(f"samebits: zero-code recording disabled in pid {os.getpid()}: {err}", file=sys.stderr)

if _probe_dir:
    try:
        import samebits.determinism

        samebits.determinism.start_command_probe()  # the probe's half inside a process `samebits probe` runs
    except BaseException as err:  # the parent reads this file and reports it
        with open(os.path.join(_probe_dir, f"boot-error-{os.getpid()}.txt"), "w") as f:
            f.write(f"{type(err).__name__}: {err}")
