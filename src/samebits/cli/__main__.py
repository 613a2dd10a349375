"""`python -m samebits.cli` runs the command line."""

import sys

from samebits.cli import main

sys.exit(main())
