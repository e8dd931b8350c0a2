"""Plan.memory_budget in real workers: refused before the first step, enforced during it, and
recompute='auto' recomputing just enough that the measured peak stays under the budget."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import meshsplit as ms

pytestmark = pytest.mark.timeout(600)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ms.models.transformer(n_layers=4)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(1))
    return x, x.roll(-1, 1)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _run(plans: list[ms.Plan]) -> list[dict[str, Any]]:
    """Runs in every worker: two steps of each plan, or the PlanError every rank raised."""
    results = []
    x, y = _batch()
    for plan in plans:
        try:
            engine = ms.parallelize(
                _model(), plan, optimizer=_adam, loss_fn=ms.models.TokenCrossEntropy()
            )
            losses = [engine.train_step(x, y) for _ in range(2)]
        except ms.PlanError as error:
            results.append({"refused": str(error)})
            continue
        memory = engine.describe()["memory"]
        results.append(
            {
                "peak": engine.memory_report().tensor_peak_bytes,
                "recompute": memory["recompute"] if memory else [],
                "added_ms": memory["added_forward_ms"] if memory else 0.0,
                "losses": losses,
            }
        )
        engine.close()
    return results


def test_auto_recompute_lowers_the_real_peak_as_the_budget_falls() -> None:
    base = ms.Plan(pp=2, micro_batches=4, schedule="gpipe", recompute="auto")
    free = ms.estimate_memory(
        _model(), base, _batch(), optimizer=_adam, loss_fn=ms.models.TokenCrossEntropy()
    )
    base = free.plan  # the stage sizes the estimate profiled, so every run cuts alike
    budgets = [int(free.peak_bytes * f) for f in (1.2, 0.85, 0.7, 0.5, 0.05)]
    plans = [base] + [replace(base, memory_budget=b) for b in budgets]
    per_rank = ms.launch(_run, 2, args=(plans,), timeout_s=600)
    unbudgeted = per_rank[0][0]["losses"]
    peaks = []
    for index, budget in enumerate(budgets, start=1):
        outcomes = [results[index] for results in per_rank]
        if "refused" in outcomes[0]:
            assert all(o == outcomes[0] for o in outcomes)  # every rank refuses alike
            assert (
                "recompute='auto'" in outcomes[0]["refused"]
                or "before any" in outcomes[0]["refused"]
            )
            continue
        for outcome in outcomes:
            assert outcome["peak"] <= budget, (budget, outcome)
            assert outcome["losses"] == pytest.approx(unbudgeted, rel=1e-5)
        peaks.append(max(o["peak"] for o in outcomes))
        chosen = [o["recompute"] for o in outcomes]
        if budget < free.peak_bytes:
            assert any(chosen) and all(o["added_ms"] >= 0 for o in outcomes)
        else:
            assert not any(chosen)  # room enough: nothing recomputed, nothing slower
    assert len(peaks) >= 3, "at least three budgets must be met"
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    assert "refused" in per_rank[0][-1]  # 5% of the need cannot be met


def test_a_rank_whose_state_cannot_fit_is_refused_before_its_first_step() -> None:
    plans = [ms.Plan(dp=2, memory_budget="64KiB"), ms.Plan(tp=2, memory_budget="1KiB")]
    per_rank = ms.launch(_run, 2, args=(plans,), timeout_s=300)
    for results in per_rank:
        for outcome in results:
            assert "before any activation" in outcome["refused"]
            assert "rank 0" in outcome["refused"] and "rank 1" in outcome["refused"]


def _over_budget(budget: int) -> None:
    engine = ms.parallelize(
        _model(),
        ms.Plan(pp=2, micro_batches=4, memory_budget=budget),
        optimizer=_adam,
        loss_fn=ms.models.TokenCrossEntropy(),
    )
    x, y = _batch()
    engine.train_step(x, y)


def test_going_past_the_budget_at_run_time_stops_the_job_naming_rank_step_and_phase() -> None:
    plan = ms.Plan(pp=2, micro_batches=4)
    need = ms.estimate_memory(
        _model(), plan, _batch(), optimizer=_adam, loss_fn=ms.models.TokenCrossEntropy()
    )
    floor = max(sum(r.breakdown[c] for c in ("parameters", "gradients", "optimizer"))
                for r in need.ranks)  # fmt: skip
    budget = (floor + need.peak_bytes) // 2  # the state fits; the activations do not
    with pytest.raises(ms.WorkerError, match=r"MemoryBudgetError: rank \d, step 1: (for|back)ward"):
        ms.launch(_over_budget, 2, args=(budget,), timeout_s=120)


class _Picking(torch.nn.Module):
    """Adds a layer's output over the rows its input picks: what it allocates follows the
    data, not the batch shape."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.layer(x[x[:, 0] > 0].repeat(64, 1)).sum(0)


def _counted_steps(cases: list[tuple[str, list[Any]]]) -> list[list[int]]:
    """Runs in a worker: for each case, the steps whose live tensors were counted under a
    budget."""
    from meshsplit.runtime import rank_memory

    counted: list[int] = []

    class Counting(rank_memory.LiveTensors):
        def __enter__(self) -> Any:
            counted.append(int(self.where.rsplit(" ", 1)[1]))
            return super().__enter__()

    rank_memory.LiveTensors = Counting  # this worker's own copy of the module
    results = []
    for name, batches in cases:
        model, loss_fn = (
            (_model(), ms.models.TokenCrossEntropy())
            if name == "transformer"
            else (_Picking(), torch.nn.MSELoss())
        )
        plan = ms.Plan(memory_budget="1GiB")
        engine = ms.parallelize(model, plan, optimizer=_adam, loss_fn=loss_fn)
        counted.clear()
        for x, y in batches:
            engine.train_step(x, y)
        engine.close()
        results.append(list(counted))
    return results


def test_a_budget_is_held_on_a_sample_once_steps_peak_alike() -> None:
    # counting costs a small model's CPU step about half: a budget no longer counts them all
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 64, generator=g).abs(), torch.randn(16, 64, generator=g)
    # rows picked by the data: 2, 4, 6, ... rows, a peak of its own every step
    picking = [(x * torch.where(torch.arange(16) < 2 * n, 1.0, -1.0)[:, None], y) for n in
               range(1, 8)]  # fmt: skip
    cases = [
        ("transformer", [_batch()] * 8),
        ("picking", picking),
        ("picking", [picking[0]] * 7),
        ("picking", [picking[0]] * 99 + [picking[6]] * 5),
    ]
    steady, changing, same, later = ms.launch(_counted_steps, 1, args=(cases,), backend="gloo")[0]
    assert steady == [1, 2, 3]  # steps 2 and 3 peaked alike: the rest are not counted
    assert changing == list(range(1, 8))
    assert same == [1, 2, 3]
    # a sampled step (every 100th) that peaks otherwise: every step is counted again until
    # two counted in a row peak alike (100 and 101)
    assert later == [1, 2, 3, 100, 101]
