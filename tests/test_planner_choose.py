"""`ms.choose_plan` end to end on a reference model: ranked, explained, infeasible named.

A made-up machine keeps these fast and deterministic (the calibration has its own tests);
the command-line test prices this machine for real.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from test_memory_estimate import _adam, _batch, _loss, _model

import meshsplit as ms
from meshsplit.job import allocator
from meshsplit.pipeline.blocks import piece_names
from meshsplit.planner.machine import OPERATIONS, Link, Machine

from cli_runner import run_meshsplit
from hf_models import FACTORIES

pytestmark = pytest.mark.timeout(300)


def _machine() -> Machine:
    link = Link(2e-4, 1e9)
    links = {op: {2: link, 4: link} for op in OPERATIONS}
    return Machine(name="made-up", links=links, cores=None)


def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    x, y = ms.data.digits("train")
    return ms.models.mlp(), (x[:32], y[:32])


def test_choose_plan_ranks_every_plan_with_terms_memory_and_a_reason() -> None:
    model, batch = _mlp()
    report = ms.choose_plan(model, batch, 2, machine=_machine(), estimate_top=2)
    assert report.best == report.rows[0].plan and report.rows[0].reason is None
    times = [row.step_time_s for row in report.rows]
    assert times == sorted(times)
    shapes = {(r.plan.dp, r.plan.pp, r.plan.tp) for r in report.rows}
    assert shapes == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    for row in report.rows:
        assert len(row.peak_bytes) == 2 and min(row.peak_bytes) > 0
        assert math.isclose(sum(row.terms.values()), row.step_time_s, rel_tol=1e-9)
    assert all(row.reason and row.reason.startswith(row.plan.describe()) for row in report.rows[1:])
    assert [row.memory_source for row in report.rows[:2]] == ["estimate", "estimate"]
    json.dumps(report.as_dict())  # JSON-ready
    own_allocator = not sys.platform.startswith("linux") or "LD_PRELOAD" in os.environ
    if not own_allocator and not any(k.startswith("MALLOC_") for k in os.environ):
        assert allocator.applied  # the items were timed with the heap kept, as in the workers


def test_plans_no_device_count_or_budget_allows_are_plan_errors() -> None:
    model, batch = _mlp()
    with pytest.raises(ms.PlanError, match="devices=0"):
        ms.choose_plan(model, batch, 0, machine=_machine())
    with pytest.raises(ms.PlanError, match="memory_budget='1KiB'"):
        ms.choose_plan(model, batch, 2, machine=_machine(), memory_budget="1KiB")
    with pytest.raises(ms.PlanError, match="memory_budget"):
        ms.choose_plan(model, batch, 2, machine=_machine(), memory_budget="lots")


def test_a_batch_that_does_not_divide_is_listed_as_infeasible() -> None:
    model, (x, y) = _mlp()
    report = ms.choose_plan(model, (x[:3], y[:3]), 2, machine=_machine(), estimate_top=1)
    refused = {(p.dp, p.pp, p.tp): why for p, why in report.infeasible}
    assert "divisibility" in refused[(2, 1, 1)]


def test_the_best_plan_is_taken_from_choose_plan_alone() -> None:
    model, batch = _mlp()
    plan = ms.choose_plan(model, batch, 2, machine=_machine(), estimate_top=1).best
    assert isinstance(plan, ms.Plan) and plan.world_size == 2
    assert not hasattr(ms.Plan, "auto")  # one way to take the planner's choice


def test_paper_mode_prices_a_cluster_and_refuses_an_unknown_one() -> None:
    model, batch = _mlp()
    report = ms.choose_plan(model, batch, 4, cluster="dgx-h100", estimate_top=1)
    assert report.machine.flop_per_s and report.machine.cores is None
    assert all(row.terms["sharing"] == 0 for row in report.rows)
    with pytest.raises(ms.PlanError, match="dgx-a100"):
        ms.choose_plan(model, batch, 4, cluster="dgx-z9")


def test_plan_command_prints_the_ranking_and_writes_the_report(tmp_path) -> None:
    out = tmp_path / "plan.json"
    done = run_meshsplit(
        "plan", "--model", "mlp", "--devices", "2", "--batch-size", "32", "--json", str(out),
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "best: " in done.stdout and "predicted step time" in done.stdout
    report = json.loads(out.read_text())
    assert report["best"] == report["rows"][0]["plan"] and len(report["rows"]) >= 3
    assert report["machine"]["links"]["all_reduce"]["2"]["bytes_per_s"] > 0


def test_train_with_the_planners_choice(tmp_path) -> None:
    metrics = tmp_path / "metrics.json"
    done = run_meshsplit(
        "train", "--model", "mlp", "--plan", "auto", "--devices", "2", "--epochs", "1",
        "--batch-size", "256", "--metrics-out", str(metrics), timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "planner: " in done.stdout and "the fastest of" in done.stdout
    shape = json.loads(metrics.read_text())["plan"]
    assert shape["dp"] * shape["pp"] * shape["tp"] == 2


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_choose_plan_ranks_plans_for_models_it_did_not_write(name: str) -> None:
    report = ms.choose_plan(
        _model(name), _batch(name), 4, machine=_machine(), estimate_top=0, loss_fn=_loss(name)
    )
    shapes = {(r.plan.dp, r.plan.pp, r.plan.tp) for r in report.rows}
    assert {(4, 1, 1), (1, 4, 1)} <= shapes  # data and layer split price on every model
    too_small = [reason for _, reason in report.infeasible if "micro-batch size" in reason]
    if name == "resnet":  # BatchNorm after a 1x1 map refuses one row: those plans are named
        assert too_small and "more than 1 value per channel" in too_small[0]
        assert all(r.plan.micro_batches <= 4 for r in report.rows if r.plan.dp == 1)
    else:
        assert not too_small


def test_the_planner_cuts_a_pipeline_only_where_the_layer_split_can() -> None:
    """GPT-2 adds its position embedding to the token embedding after calling both, so no
    stage may begin at `wpe`. The planner offered pp4 x v2 = 8 chunks of its 8 pieces (one
    beginning at `wpe`), pinned, which the layer split then refused."""
    model = _model("gpt2")
    report = ms.choose_plan(
        model, _batch("gpt2"), 4, machine=_machine(), estimate_top=0, loss_fn=_loss("gpt2")
    )
    names = piece_names(model)
    piped = [row.plan for row in report.rows if row.plan.pp > 1]
    assert piped and "m.transformer.wpe" in names
    for plan in piped:
        assert plan.stages is not None
        starts = [sum(plan.stages[:k]) for k in range(1, len(plan.stages))]
        assert "m.transformer.wpe" not in [names[k] for k in starts], plan.describe()
    most = max(piped, key=lambda plan: plan.pp * plan.virtual_stages)
    estimate = ms.estimate_memory(
        _model("gpt2"), most, _batch("gpt2"), optimizer=_adam, loss_fn=_loss("gpt2")
    )  # the layer split takes the pinned chunks
    assert len(estimate.ranks) == 4
