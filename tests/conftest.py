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
# the workers' forkserver imports transformers and the model code the tests build once; it
# finds tests/preload.py on PYTHONPATH (Python 3.11's forkserver ignores the caller's sys.path)
os.environ.setdefault("MESHSPLIT_PRELOAD", "preload")
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
