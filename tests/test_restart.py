"""torchrun --max-restarts: a worker killed mid-run; the restarted generation resumes from the
latest complete checkpoint by itself and ends with the parameters of a run never killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshsplit as ms

pytestmark = pytest.mark.timeout(400)

SCRIPT = Path(__file__).with_name("torchrun_restart_job.py")
STEPS_PER_EPOCH = 22  # 1437 digits // 64


def _torchrun(checkpoints: Path, die_at: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT)]
    return subprocess.run(
        [*command, str(checkpoints), str(die_at)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_restarted_generation_resumes_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    first = _torchrun(killed, die_at=STEPS_PER_EPOCH + 7)  # in the second epoch
    assert first.returncode == 0, first.stderr[-3000:]
    assert "failed (exitcode: 1) local_rank: 1" in first.stderr  # generation 0 did lose rank 1
    second = _torchrun(whole, die_at=0)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (killed / "latest").read_text() == (whole / "latest").read_text()
    after_kill, uninterrupted = ms.load_full_state_dict(killed), ms.load_full_state_dict(whole)
    for key, value in uninterrupted.items():
        torch.testing.assert_close(after_kill[key], value, rtol=1e-5, atol=1e-6, msg=key)
