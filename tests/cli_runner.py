"""Run the `meshsplit` command as a user would: a fresh interpreter, output captured."""

from __future__ import annotations

import subprocess
import sys


def run_meshsplit(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshsplit", *args], capture_output=True, text=True, timeout=timeout
    )
