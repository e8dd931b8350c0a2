"""`meshsplit train`: trains, writes metrics, and turns a bad plan into one clear line."""

from __future__ import annotations

import json

import pytest

from cli_runner import run_meshsplit


def test_train_mlp_reaches_accuracy_and_writes_metrics(tmp_path) -> None:
    out = tmp_path / "m.json"
    done = run_meshsplit("train", "--model", "mlp", "--dp", "2", "--metrics-out", str(out))
    assert done.returncode == 0, done.stderr
    metrics = json.loads(out.read_text())
    assert metrics["test_accuracy"] >= 0.90
    assert metrics["plan"]["dp"] == 2
    assert len(metrics["peak_memory_bytes"]) == 2
    for key in ("final_loss", "samples_per_second"):
        assert metrics[key] > 0
    assert "test accuracy" in done.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--dp", "0"], "Plan.dp=0"),
        (["--dp", "3", "--batch-size", "64"], "global batch 64"),
        (["--schedule", "zigzag"], "Plan.schedule"),
        (["--tp", "3"], "Plan.tp=3 does not divide Linear 'fc1'"),
    ],
)
def test_bad_plan_is_one_clear_line(args: list[str], words: str) -> None:
    done = run_meshsplit("train", "--model", "mlp", *args)
    assert done.returncode == 2
    assert words in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 3  # one message, wrapped at most


def test_train_resumes_from_checkpoint(tmp_path) -> None:
    checkpoints, out = tmp_path / "ckpt", tmp_path / "m.json"
    common = ["train", "--model", "mlp", "--checkpoint-dir", str(checkpoints)]
    first = run_meshsplit(*common, "--epochs", "1")
    assert first.returncode == 0, first.stderr
    assert (checkpoints / "latest").read_text() == "step-00000022"  # 1437 samples // 64
    second = run_meshsplit(*common, "--epochs", "2", "--resume", "--metrics-out", str(out))
    assert second.returncode == 0, second.stderr
    history = json.loads(out.read_text())["history"]
    assert [row["epoch"] for row in history] == [2.0]  # only the epoch that was left
    assert (checkpoints / "latest").read_text() == "step-00000044"


def test_resume_without_checkpoint_is_one_clear_line(tmp_path) -> None:
    done = run_meshsplit("train", "--checkpoint-dir", str(tmp_path / "none"), "--resume")
    assert done.returncode == 2
    assert "no checkpoint in" in done.stderr
    assert "Traceback" not in done.stderr
