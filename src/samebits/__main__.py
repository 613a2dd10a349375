"""`python -m samebits` runs the command line."""

import sys

from samebits.cli import main

sys.exit(main())
