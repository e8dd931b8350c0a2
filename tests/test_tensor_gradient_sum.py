"""A layer kept whole inside a split pair (a per-head norm between q and o) gets the gradient
one process computes: each tp rank's share summed over tp, under dp, ZeRO 2/3 and pipelines.

Before, the pair around such a layer was kept whole (exact, but the attention split nothing);
without the sum, the tp ranks' copies of the norm's weights drift apart (Gemma 3's q_norm off
by up to 2.2x after three SGD steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms

transformers = pytest.importorskip("transformers")

from hf_models import MORE  # noqa: E402
from reference import HeadNormAttention, assert_matches, train_plainly  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
BATCH, STEPS = 8, 3


def _head_norms() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), HeadNormAttention(), HeadNormAttention(), nn.Linear(16, 8)
    )


MODELS = {"head_norms": _head_norms, "qwen3": MORE["qwen3"], "gemma3": MORE["gemma3"]}
PLANS = {
    "dp2 x tp2, zero 2": ms.Plan(dp=2, tp=2, zero=2),
    "dp2 x tp2, zero 3": ms.Plan(dp=2, tp=2, zero=3),
    "pp2 x tp2, zero bubble": ms.Plan(pp=2, tp=2, micro_batches=2, schedule="zero-bubble"),
}


def _build(model: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model]()


def _batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = BATCH * STEPS
    if model == "head_norms":
        x, y = torch.randn(rows, 5, 8, generator=g), torch.randn(rows, 5, 8, generator=g)
    else:
        x = torch.randint(0, 64, (rows, 8), generator=g)
        y = torch.randint(0, 64, (rows, 8), generator=g)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _loss(model: str) -> nn.Module:
    return nn.MSELoss() if model == "head_norms" else ms.models.TokenCrossEntropy()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _parallel(cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    results = []
    for model, plan in cases:
        engine = ms.parallelize(_build(model), PLANS[plan], optimizer=_sgd, loss_fn=_loss(model))
        losses = [engine.train_step(x, y) for x, y in _batches(model)]
        splits = {d.name: (d.split, d.summed) for d in engine.operator_split}
        results.append({"losses": losses, "state": engine.full_state_dict(), "splits": splits})
        engine.close()
    return results


@pytest.mark.timeout(600)
def test_whole_layers_inside_split_pairs_match_one_process() -> None:
    cases = [(model, plan) for model in MODELS for plan in PLANS]
    per_rank = ms.launch(_parallel, 4, args=(cases,), timeout_s=500)
    for index, (model, plan) in enumerate(cases):
        net = _build(model)
        want_losses, want_state = train_plainly(
            net, _sgd(net.parameters()), _loss(model), _batches(model)
        )
        results = [(r[index]["losses"], r[index]["state"]) for r in per_rank]
        assert_matches(
            results, (want_losses, want_state), rtol=RTOL, atol=ATOL, case=f"{model} {plan}"
        )
        for rank, ranks in enumerate(per_rank):
            got, where = ranks[index], f"{model} {plan} rank {rank}"
            splits = got["splits"]
            assert any(names for _, names in splits.values()), f"{where}: nothing summed"
            queries = [s for name, (s, _) in splits.items() if name.endswith(("q_proj", ".q"))]
            assert queries and set(queries) == {"column"}, f"{where}: {splits}"
