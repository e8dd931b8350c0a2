"""recompute='auto' between the always- and never-recompute needs: every budget it accepts holds
for three real steps, and every budget it refuses names one that does."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms

from reference import token_mixing

pytestmark = pytest.mark.timeout(300)

BUDGET_POINTS = (0.0, 0.03, 0.15, 0.4, 0.7, 1.0)
"""Where each budget lies between the always-recompute need (0) and the never one (1)."""


def _token_mixing() -> nn.Module:
    torch.manual_seed(0)
    return token_mixing()


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return ms.models.transformer(n_layers=4)


MODELS = {"token_mixing": (_token_mixing, 64), "transformer": (_transformer, 32)}
"""name -> (model factory, sequence length)."""


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _train(model: str, plan: ms.Plan) -> int:
    """Three steps under `plan`; the largest tracked peak of any step on any rank."""
    factory, length = MODELS[model]
    x = torch.randint(0, 256, (16, length), generator=torch.Generator().manual_seed(1))
    engine = ms.parallelize(
        factory(), plan, optimizer=_adamw, loss_fn=ms.models.TokenCrossEntropy()
    )
    peak = 0
    try:
        for _ in range(3):
            engine.train_step(x, x.roll(-1, 1))
            peak = max(peak, engine.memory_report().tensor_peak_bytes or 0)
    finally:
        engine.close()
    largest = torch.tensor(peak)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest)


def _sweep(cases: list[tuple[str, str]], dp: int, pp: int = 1) -> list[dict[str, Any]]:
    """Runs in every worker: each case's needs, then each budget between them."""
    results = []
    split = {"dp": dp, "pp": pp, "micro_batches": pp}
    for model, precision in cases:
        always = _train(model, ms.Plan(**split, precision=precision, recompute="always"))
        never = _train(model, ms.Plan(**split, precision=precision))
        tried: dict[int, int] = {}
        """named budget -> the peak under it (a budget is run once)."""
        for point in BUDGET_POINTS:
            budget = int(always + point * (never - always))
            outcome: dict[str, Any] = {"case": (model, precision, point), "budget": budget}
            try:
                outcome["peak"] = _train(model, _auto(split, precision, budget))
            except ms.PlanError as error:
                outcome["refused"] = str(error)
                named = re.search(r"memory_budget='(\d+)KiB' fits", str(error))
                if named is not None:
                    fitting = outcome["named"] = int(named.group(1)) * 1024
                    if fitting not in tried:
                        tried[fitting] = _train(model, _auto(split, precision, fitting))
                    outcome["named_peak"] = tried[fitting]
            results.append(outcome)
    return results


def _auto(split: dict[str, int], precision: str, budget: int) -> ms.Plan:
    return ms.Plan(**split, precision=precision, recompute="auto", memory_budget=budget)


def _check(outcomes: list[dict[str, Any]]) -> None:
    for outcome in outcomes:
        if "refused" in outcome:
            assert "named" in outcome, outcome  # a refusal names a budget that fits
            assert outcome["named"] > outcome["budget"], outcome
            assert outcome["named_peak"] <= outcome["named"], outcome
        else:
            assert outcome["peak"] <= outcome["budget"], outcome
    assert any("peak" in o for o in outcomes), "some budget between the needs is accepted"


def test_every_budget_auto_accepts_holds_on_one_process() -> None:
    cases = [(model, precision) for model in MODELS for precision in ("fp32", "bf16-mixed")]
    per_rank = ms.launch(_sweep, 1, args=(cases, 1), timeout_s=300)
    _check(per_rank[0])


def test_every_budget_auto_accepts_holds_under_dp2() -> None:
    per_rank = ms.launch(_sweep, 2, args=([("token_mixing", "fp32")], 2), timeout_s=300)
    assert per_rank[0] == per_rank[1] or all("refused" in a or "peak" in a for a in per_rank[0])
    _check(per_rank[0])


def test_every_budget_auto_accepts_holds_on_a_two_stage_pipeline() -> None:
    per_rank = ms.launch(_sweep, 2, args=([("token_mixing", "fp32")], 1, 2), timeout_s=300)
    for outcomes in per_rank:
        _check(outcomes)
