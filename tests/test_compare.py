"""`meshsplit compare` runs every plan for N workers and writes the table, JSON, Markdown, PNG."""

from __future__ import annotations

import io
import json

import pytest

from meshsplit.cli.compare import CompareConfig, candidate_plans
from meshsplit.job.traffic import count_traffic

from cli_runner import run_meshsplit


def test_candidate_plans_cover_every_factorisation() -> None:
    plans = candidate_plans(CompareConfig(model="mlp", devices=4))
    shapes = [(p.dp, p.pp, p.tp) for p in plans]
    assert sorted(shapes) == sorted(
        [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
    )
    assert shapes[:3] == [(4, 1, 1), (1, 4, 1), (1, 1, 4)]  # pure splits first
    assert all(p.micro_batches == (4 if p.pp > 1 else 1) for p in plans)


def test_traffic_counter_restores_torch_distributed() -> None:
    import torch.distributed as dist

    original = dist.all_reduce
    with count_traffic() as traffic:
        assert dist.all_reduce is not original
    assert dist.all_reduce is original
    assert traffic.total_bytes == 0


@pytest.mark.timeout(600)
def test_compare_writes_three_files_and_every_plan_matches(tmp_path) -> None:
    done = run_meshsplit(
        "compare",
        "--model",
        "mlp",
        "--devices",
        "4",
        "--steps",
        "3",
        "--batch-size",
        "16",
        "--out",
        str(tmp_path),
        timeout=540,
    )
    assert done.returncode == 0, done.stderr
    for name in ("compare.json", "compare.md", "compare.png", "timeline.json", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = json.loads((tmp_path / "compare.json").read_text())["plans"]
    assert len(rows) == 6
    ran = [row for row in rows if "refused" not in row]
    assert len(ran) == 6, [row.get("refused") for row in rows]  # the MLP takes every plan
    assert all(row["loss_matches"] for row in ran)
    assert max(row["ratio_to_best"] for row in ran) == 1.0
    assert all(len(row["peak_memory_bytes"]) == 4 for row in ran)
    # the planner's prediction beside each run: memory exact per rank, time in the right range
    planner = json.loads((tmp_path / "compare.json").read_text())["planner"]
    assert planner["largest_memory_error"] <= 0.10
    assert all(row["predicted_step_s"] > 0 for row in ran)
    assert planner["step_time_mape"] < 1.0  # within 2x on average: a broken model is far off
    assert "planner: step-time MAPE" in done.stdout
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    slices = [e for e in trace if e.get("ph") == "X"]
    assert {e["pid"] for e in slices} == {1, 2}  # the measured step and the predicted one
    assert "dp4 pp1 tp1" in done.stdout


def test_a_plan_the_batch_cannot_take_is_listed_as_refused() -> None:
    from meshsplit.cli.compare import _row
    from meshsplit.plan import Plan

    config = CompareConfig(model="mlp", devices=3, batch_size=64)
    row = _row(config, Plan(dp=3), reference=[])
    assert "global batch 64 is not divisible" in row["refused"]
    assert row["plan"] == "dp3 pp1 tp1"


def test_the_table_is_printed_whole_where_no_terminal_is() -> None:
    from meshsplit.cli import compare_report
    from meshsplit.cli.show import print_table

    row = {
        "plan": "dp2 pp1 tp2 m2 zero3 compress=bf16",
        "samples_per_second": 1234.5,
        "ratio_to_best": 1.0,
        "step_s": 0.0123,
        "predicted_step_s": 0.011,
        "estimated_peak_bytes": [3 * 2**20],
        "tensor_peak_bytes": [3 * 2**20],
        "peak_memory_bytes": [300 * 2**20],
        "bytes_per_step": 2**20,
        "loss_matches": True,
    }
    config = CompareConfig(model="cnn", devices=4)
    out = io.StringIO()  # not a terminal: rich would fit 80 columns and cut the rest
    print_table(compare_report.table(config, [row]), file=out)
    text = out.getvalue()
    assert "…" not in text, text
    for header in compare_report.HEADERS:
        assert header in text, (header, text)
    assert row["plan"] in text
