"""`python -m samebits` runs the command line."""

import os
import sys

from samebits.cli import main

code = main()
parallel = sys.modules.get("samebits.compare._parallel")
if parallel is not None and parallel.started_process_group:
    # `torchrun -m samebits diff --distributed`: the result is printed and the group destroyed.
    # Skip the C++ static destructors: after a gloo group they abort now and then ("terminate
    # called without an active exception"), failing a finished comparison's torchrun job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
