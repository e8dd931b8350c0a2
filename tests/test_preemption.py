"""SIGTERM to `meshsplit train` (preemption) saves at the next step boundary and exits; the
resumed run ends with the parameters of a run never stopped, and no worker is left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import meshsplit as ms

from cli_runner import run_meshsplit

pytestmark = pytest.mark.timeout(300)

STEPS_PER_EPOCH = 22  # 1437 digits // 64


def _children(pid: int) -> set[int]:
    """The processes `pid` started (Linux /proc), read while it runs."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "gone"


def _train(checkpoints: Path, *extra: str) -> list[str]:
    return [
        *("train", "--model", "mlp", "--dp", "2", "--epochs", "3"),
        *("--checkpoint-dir", str(checkpoints), *extra),
    ]


def test_sigterm_saves_at_a_step_boundary_and_the_resumed_run_matches(tmp_path: Path) -> None:
    stopped_dir = tmp_path / "stopped"
    job = subprocess.Popen(
        [sys.executable, "-m", "meshsplit", *_train(stopped_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while not (stopped_dir / "latest").exists():  # the first epoch's checkpoint
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        workers |= _children(job.pid)
        time.sleep(0.05)
    workers |= _children(job.pid)
    job.send_signal(signal.SIGTERM)
    asked = time.monotonic()
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - asked < 20
    assert job.returncode == 143, stderr
    assert "stopped:" in stderr and "SIGTERM" in stderr and "--resume" in stderr, stderr
    assert "Traceback" not in stderr
    while any(_alive(pid) for pid in workers) and time.monotonic() < asked + 25:
        time.sleep(0.1)  # the workers are gone; the spawn resource tracker follows
    assert workers and not any(_alive(pid) for pid in workers), [_state(p) for p in workers]
    saved = (stopped_dir / "latest").read_text()
    steps = int(saved.removeprefix("step-"))
    assert STEPS_PER_EPOCH < steps < 3 * STEPS_PER_EPOCH, saved  # mid-run, not the end
    resumed = run_meshsplit(*_train(stopped_dir, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    whole_dir = tmp_path / "whole"
    whole = run_meshsplit(*_train(whole_dir))
    assert whole.returncode == 0, whole.stderr
    assert (stopped_dir / "latest").read_text() == (whole_dir / "latest").read_text()
    after_stop = ms.load_full_state_dict(stopped_dir)
    uninterrupted = ms.load_full_state_dict(whole_dir)
    for key, value in uninterrupted.items():
        torch.testing.assert_close(after_stop[key], value, rtol=1e-5, atol=1e-6, msg=key)
