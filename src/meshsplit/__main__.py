"""`python -m meshsplit` runs the command line."""

import sys

from meshsplit.cli import main

sys.exit(main())
