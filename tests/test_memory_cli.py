"""`meshsplit memory` and `--memory-budget` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_meshsplit


def test_memory_prints_estimate_beside_measured_and_draws_each_rank(tmp_path: Path) -> None:
    done = run_meshsplit(
        "memory", "--model", "transformer", "--pp", "2", "--micro-batches", "4",
        "--batch-size", "16", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "estimate" in done.stdout and "measured" in done.stdout
    figures = json.loads((tmp_path / "memory.json").read_text())
    estimated = [rank["peak_bytes"] for rank in figures["estimate"]["ranks"]]
    measured = [rank["tensor_peak_bytes"] for rank in figures["measured"]]
    assert len(estimated) == len(measured) == 2
    for guess, real in zip(estimated, measured, strict=True):
        assert abs(guess - real) <= 0.10 * real
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_train_over_budget_is_refused_before_launch_with_the_fix() -> None:
    done = run_meshsplit("train", "--model", "mlp", "--memory-budget", "4MiB")
    assert done.returncode == 2
    text = " ".join(done.stderr.split())
    assert "does not fit Plan.memory_budget='4MiB'" in text and "rank 0 needs" in text
    assert "Traceback" not in done.stderr


def test_a_budget_in_an_unknown_unit_is_one_clear_line() -> None:
    done = run_meshsplit("train", "--model", "mlp", "--memory-budget", "2 gigs")
    assert done.returncode == 2
    assert "memory_budget" in done.stderr and "Traceback" not in done.stderr
