"""`python -m samebits.recipes [--steps N ...]`: run the reference recipe (see recipes/cli.py)."""

import os
import sys

from samebits.recipes.cli import main

code = main()
# Everything is written, flushed and closed (streams, checkpoint, process group). Skip the
# C++ static destructors: under load about 1 run in 15 aborted there ("terminate called
# without an active exception", no Python frame), turning a finished run into a failure.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
