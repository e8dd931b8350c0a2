"""`python -m meshsplit` runs the command line."""

import sys

from meshsplit.cli.main import main

sys.exit(main())
