"""Mixed precision in the memory estimate, the cost model, the planner and their commands.

bf16 autocast halves what matmuls make and what the wire carries, so the estimate must see
half the activations (and match real workers), and the planner must price half the bytes
for pipeline messages, forward tp collectives and a bf16 dp reduce.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_planner_choose import _machine
from test_planner_cost import _machine as _synthetic_machine
from test_planner_cost import _workload as _synthetic_workload
from torch import nn

import meshsplit as ms
from meshsplit.cli.compare import CompareConfig, candidate_plans, reference_losses
from meshsplit.planner.cost import Prediction, predict
from meshsplit.planner.measure import measure_workload

from cli_runner import run_meshsplit

pytestmark = pytest.mark.timeout(120)

BF16 = {"precision": "bf16-mixed"}


def _stack() -> nn.Module:
    """Linear layers on many rows: what autograd saves is matmul outputs (and ReLUs of them)."""
    torch.manual_seed(0)
    widths = (32, 64, 64, 64, 10)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _stack_batch(rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return ms.models.transformer(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=8)


def _tokens(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, rows, 8), generator=g)
    return tokens[0], tokens[1]


def _loss(name: str) -> nn.Module:
    return ms.models.TokenCrossEntropy() if name == "transformer" else nn.CrossEntropyLoss()


@pytest.mark.parametrize("plan", [ms.Plan(), ms.Plan(pp=2, micro_batches=2, stages=(4, 3))])
def test_bf16_estimate_holds_about_half_the_activations(plan: ms.Plan) -> None:
    activations = {}
    for precision in ("fp32", "bf16-mixed"):
        estimate = ms.estimate_memory(
            _stack(), replace(plan, precision=precision), _stack_batch(), loss_fn=_loss("stack")
        )
        activations[precision] = sum(r.breakdown["activations"] for r in estimate.ranks)
    assert 0.4 <= activations["bf16-mixed"] / activations["fp32"] <= 0.6, activations


def _build(name: str) -> nn.Module:
    return _transformer() if name == "transformer" else _stack()


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _tokens() if name == "transformer" else _stack_batch(256)


def _measure(cases: list[tuple[str, ms.Plan]]) -> list[tuple[int, str]]:
    """Runs in every worker: two steps of each case; this rank's measured peak of each."""
    peaks = []
    for name, plan in cases:
        engine = ms.parallelize(_build(name), plan, loss_fn=_loss(name))
        for _ in range(2):
            engine.train_step(*_batch(name))
        report = engine.memory_report()
        peaks.append((report.tensor_peak_bytes, report.tensor_peak_phase))
        engine.close()
    return peaks


CASES = [
    ("transformer", ms.Plan(pp=2, micro_batches=2, **BF16)),
    ("transformer", ms.Plan(tp=2, **BF16)),
    ("stack", ms.Plan(dp=2, reduce_dtype="bf16", **BF16)),
]


def test_bf16_estimate_is_within_ten_percent_of_every_ranks_measured_peak() -> None:
    estimates = [
        ms.estimate_memory(_build(name), plan, _batch(name), loss_fn=_loss(name))
        for name, plan in CASES
    ]
    cases = [(name, e.plan) for (name, _), e in zip(CASES, estimates, strict=True)]
    per_rank = ms.launch(_measure, 2, args=(cases,), timeout_s=100)
    for index, (name, plan) in enumerate(cases):
        for rank, estimate in enumerate(estimates[index].ranks):
            measured, phase = per_rank[rank][index]
            assert abs(estimate.peak_bytes - measured) <= 0.10 * measured, (
                f"{name} {plan.describe()} rank {rank}: estimated {estimate.peak_bytes} at "
                f"{estimate.phase}, measured {measured} at {phase}"
            )


def test_the_cost_model_halves_compressed_pipeline_messages_and_a_bf16_dp_reduce() -> None:
    machine = _synthetic_machine()
    fp32 = _synthetic_workload()
    mixed = replace(fp32, precision="bf16-mixed")
    shape = ms.Plan(dp=2, pp=2, micro_batches=4)
    full = predict(fp32, machine, shape).bytes_per_step
    halved = replace(shape, reduce_dtype="bf16", compress_transfers="bf16", **BF16)
    half = predict(mixed, machine, halved).bytes_per_step
    assert half["pp"] == full["pp"] / 2 and half["dp"] == full["dp"] / 2
    kept = predict(mixed, machine, replace(shape, **BF16)).bytes_per_step
    assert kept["dp"] == full["dp"]  # an fp32 reduce moves fp32 gradients
    assert kept["pp"] == full["pp"]  # messages travel in the dtypes the stage made them in
    with pytest.raises(ValueError, match="measured under fp32"):
        predict(fp32, machine, replace(shape, **BF16))


def test_measured_forward_tp_collectives_of_matmul_outputs_take_half_the_bytes() -> None:
    loss = _loss("transformer")
    measured = {
        precision: measure_workload(
            _transformer(), _tokens(), widths=[2], sizes=[16], loss_fn=loss, precision=precision
        )
        for precision in ("fp32", "bf16-mixed")
    }
    assert measured["bf16-mixed"].precision == "bf16-mixed"
    pairs = zip(measured["fp32"].items[2], measured["bf16-mixed"].items[2], strict=True)
    for full, half in pairs:
        if full.name.startswith(("block", "head")):  # row-parallel outputs, gathered logits
            assert [t.bytes_per_row / 2 for t in full.forward_traffic] == [
                t.bytes_per_row for t in half.forward_traffic
            ]
        assert half.compact_output_bytes_per_row == full.output_bytes_per_row / 2


def test_choose_plan_ranks_every_plan_under_the_precision_asked_for() -> None:
    model, batch, loss = _transformer(), _tokens(), _loss("transformer")
    reports = {
        precision: ms.choose_plan(
            model,
            batch,
            4,
            machine=_machine(),
            estimate_top=1,
            loss_fn=loss,
            precision=precision,
            reduce_dtype=reduce,
        )  # fmt: skip
        for precision, reduce in (("fp32", "fp32"), ("bf16-mixed", "bf16"))
    }
    mixed = reports["bf16-mixed"]
    plans = [row.plan for row in mixed.rows] + [plan for plan, _ in mixed.infeasible]
    assert all(p.precision == "bf16-mixed" and p.reduce_dtype == "bf16" for p in plans)
    # the first plan the estimate covers (parameter-server plans, which may rank first on a
    # busy machine, it does not) reports the estimate's bytes
    covered = next(row for row in mixed.rows if row.plan.sync != "ps")
    assert covered.memory_source == "estimate"
    full = {_key(row.plan): row.prediction for row in reports["fp32"].rows}
    # each precision's own timings balance the layer split and name the slowest stage, whose
    # bytes a prediction reports: compare where both cut alike and name the same stage
    alike = [r for r in mixed.rows if _alike(full[_key(r.plan)], r.prediction)]
    assert sum(r.plan.pp == 1 for r in alike) == sum(r.plan.pp == 1 for r in mixed.rows) > 0
    for row in alike:
        bytes_per_step = row.prediction.bytes_per_step
        fp32 = full[_key(row.plan)].bytes_per_step
        assert bytes_per_step["pp"] == fp32["pp"]  # the residual stream crosses in fp32
        dp_full, dp_mixed = fp32["dp"], bytes_per_step["dp"]
        if row.plan.zero == 0:
            assert dp_mixed == dp_full / 2
        else:  # the gradients reduce in bf16; the parameters zero gathers stay fp32
            assert dp_full / 2 < dp_mixed < dp_full
        assert bytes_per_step["tp"] <= fp32["tp"]
    with pytest.raises(ms.PlanError, match="precision"):
        ms.choose_plan(model, batch, 4, machine=_machine(), precision="fp8")


def _alike(first: Prediction, second: Prediction) -> bool:
    """Whether two predictions cut the layers alike and report the same (slowest) stage."""
    return (first.stages, first.critical_stage) == (second.stages, second.critical_stage)


def _key(plan: ms.Plan) -> ms.Plan:
    """The plan in fp32: two plans share a key only when they differ by precision alone."""
    return replace(plan, precision="fp32", reduce_dtype="fp32")


def test_a_cluster_on_paper_computes_at_the_autocast_dtypes_rate() -> None:
    model, batch, loss = _transformer(), _tokens(), _loss("transformer")
    rates = [
        ms.choose_plan(
            model, batch, 2, cluster="dgx-h100", estimate_top=0, loss_fn=loss, precision=p
        ).machine.flop_per_s
        for p in ("fp32", "bf16-mixed")
    ]
    assert rates[1] > 10 * rates[0]


def test_compare_runs_every_plan_and_its_reference_under_the_precision() -> None:
    config = CompareConfig(model="mlp", devices=4, steps=2, batch_size=8, include_ps=True, **BF16)
    assert {plan.precision for plan in candidate_plans(config)} == {"bf16-mixed"}
    assert config.loss_rtol > CompareConfig(model="mlp", devices=4).loss_rtol
    mixed, full = reference_losses(config), reference_losses(replace(config, precision="fp32"))
    assert mixed != full and all(abs(a - b) <= 0.02 * b for a, b in zip(mixed, full, strict=True))


def test_plan_and_memory_commands_take_the_precision(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = run_meshsplit(
        "plan", "--model", "mlp", "--devices", "2", "--batch-size", "16", "--cluster",
        "dgx-h100", "--precision", "bf16-mixed", "--reduce-dtype", "bf16", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bf16-mixed reduce=bf16" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert all(row["shape"]["precision"] == "bf16-mixed" for row in rows)
    done = run_meshsplit(
        "memory", "--model", "transformer", "--pp", "2", "--micro-batches", "2",
        "--batch-size", "8", "--precision", "bf16-mixed", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "bf16-mixed" in text and "most activations in a step, bf16-mixed / fp32" in text
    figures = json.loads((tmp_path / "memory.json").read_text())
    assert figures["estimate"]["plan"]["precision"] == "bf16-mixed"
    refused = run_meshsplit("plan", "--model", "mlp", "--precision", "fp8")
    assert refused.returncode == 2 and "precision" in refused.stderr
