"""Injected by `samebits run`: turn on zero-code recording in this Python process.

Then load the environment's own sitecustomize, if any, so that injecting ours hides nothing.
"""

import importlib.util
import os
import sys


def _chain_original() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_samebits_original_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("SAMEBITS_AUTORECORD") == "1":
    try:
        import samebits.autorecord

        samebits.autorecord.install()
    except Exception as err:  # never break the user's program: say why recording is off
        print(f"samebits: zero-code recording disabled in pid {os.getpid()}: {err}", file=sys.stderr)
_chain_original()
