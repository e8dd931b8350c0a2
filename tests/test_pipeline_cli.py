"""`meshsplit train --pp`: prints the stage table and trains to accuracy through the pipeline."""

from __future__ import annotations

import json

from cli_runner import run_meshsplit


def test_train_with_layer_split_prints_stages_and_learns(tmp_path) -> None:
    out = tmp_path / "m.json"
    done = run_meshsplit(
        "train",
        "--model",
        "mlp",
        "--pp",
        "2",
        "--micro-batches",
        "4",
        "--recompute",
        "except_last",
        "--epochs",
        "2",
        "--metrics-out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "layer split" in done.stdout and "backward ms" in done.stdout
    assert "stage 1 | .. F0 B0" in done.stdout  # the 1F1B diagram under the table
    metrics = json.loads(out.read_text())
    assert metrics["plan"]["pp"] == 2 and metrics["plan"]["recompute"] == "except_last"
    assert metrics["test_accuracy"] >= 0.90
