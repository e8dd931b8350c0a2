"""Tests run on CPU with one thread per worker; multi-process tests spawn through ms.launch.

Hugging Face models are built from configs with random weights: nothing is downloaded, and
the hub is told so (workers inherit the environment).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
