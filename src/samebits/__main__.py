"""`python -m samebits` runs the command line."""

import os
import sys

from samebits.cli import main

code = main()
parallel = sys.modules.get("samebits.compare._parallel")
if parallel is not None and parallel.started_process_group:
    # `torchrun -m samebits diff --distributed`: the comparison is printed and its process group
    # destroyed. Skip the C++ static destructors: after a gloo group they abort now and then
    # ("terminate called without an active exception"), turning a finished comparison into a
    # failed torchrun job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
