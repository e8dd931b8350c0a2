"""Tests run on CPU with one thread per worker; multi-process tests spawn through ms.launch.

Hugging Face models are built from configs with random weights: nothing is downloaded, and
the hub is told so (workers inherit the environment).
"""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the planner's calibration of this machine, measured once per test run, not in the home dir
os.environ.setdefault("MESHSPLIT_CACHE_DIR", tempfile.mkdtemp(prefix="meshsplit-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
