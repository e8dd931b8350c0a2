"""Tests run on CPU with one thread per worker; multi-process tests spawn through ms.launch."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
