"""The planner searches and prices the expert split (Plan.ep) of a mixture-of-experts model.

A tiny `moe` reference model is measured once in this process: its plans include ep over
every divisor of dp that divides the experts (a dense model's include none), an ep plan's
rank holds the dense parameters and 1/ep of the experts, and its step has the all-to-all
term of two payloads each way per experts layer. The `moe` model trains under Plan(dp=2,
ep=2) as one process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit.planner.choose import choose_plan
from meshsplit.planner.cluster import load_cluster
from meshsplit.planner.cost import predict
from meshsplit.planner.explain import reason
from meshsplit.planner.machine import OPERATIONS, Link, Machine
from meshsplit.planner.measure import measure_workload
from meshsplit.planner.search import search
from meshsplit.planner.workload import Workload

SIZES = {"vocab_size": 64, "d_model": 16, "n_heads": 2, "n_layers": 2, "seq_len": 8}
MOE = {**SIZES, "experts": 4, "hidden": 32, "top_k": 2}
ROWS, STEPS = 8, 3


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return ms.models.moe(**MOE)


def _batch(rows: int = ROWS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return ms.data.synthetic_tokens(rows, seq_len=8, vocab_size=64, seed=seed)


def _machine(all_to_all_s: float = 1e-5, all_reduce_rate: float = 1e9) -> Machine:
    """Every link alike, but an all-to-all starts in `all_to_all_s` and an all-reduce moves
    `all_reduce_rate` bytes per second."""
    links = {op: {2: Link(1e-5, 1e9), 4: Link(1e-5, 1e9)} for op in OPERATIONS}
    links["all_to_all"] = {2: Link(all_to_all_s, 1e9), 4: Link(all_to_all_s, 1e9)}
    links["all_reduce"] = {2: Link(1e-5, all_reduce_rate), 4: Link(1e-5, all_reduce_rate)}
    return Machine(name="made-up", links=links, cores=None)


def _measure(model: torch.nn.Module) -> Workload:
    return measure_workload(
        model, _batch(), widths=[1, 2], optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy(),
        sizes=[2, 4, 8],
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe_workload() -> Workload:
    return _measure(_moe())


def _shapes(workload: Workload) -> set[tuple[int, int, int, int]]:
    ranking = search(workload, _machine(), 4)
    return {(r.plan.dp, r.plan.pp, r.plan.tp, r.plan.ep) for r in ranking.rows}


def test_plans_of_a_model_with_experts_include_ep_and_a_dense_models_none(
    moe_workload: Workload,
) -> None:
    assert moe_workload.experts == (4, 4)
    shapes = _shapes(moe_workload)
    assert {(4, 1, 1, 2), (4, 1, 1, 4), (2, 1, 2, 2), (2, 2, 1, 2), (4, 1, 1, 1)} <= shapes
    assert all(dp % ep == 0 for dp, _, _, ep in shapes)
    torch.manual_seed(0)
    dense = _measure(ms.models.transformer(**SIZES))
    assert dense.experts == () and {ep for *_, ep in _shapes(dense)} == {1}


def test_an_ep_rank_holds_the_dense_parameters_and_one_ep_th_of_the_experts(
    moe_workload: Workload,
) -> None:
    model = _moe()
    experts = sum(p.nbytes for p in model.parameters() if p.dim() == 3)
    items = moe_workload.items[1]
    assert sum(item.expert_bytes for item in items) == experts
    whole = predict(moe_workload, _machine(), ms.Plan(dp=4)).memory_bytes[0]
    # parameters, gradients and SGD's momentum: three bytes per byte a rank holds
    state = 2 + moe_workload.optimizer_state_per_byte
    assert moe_workload.optimizer_state_per_byte == pytest.approx(1.0)
    for ep in (2, 4):
        split = predict(moe_workload, _machine(), ms.Plan(dp=4, ep=ep)).memory_bytes[0]
        assert whole - split == pytest.approx(state * experts * (1 - 1 / ep), rel=1e-3)


def test_the_step_of_an_ep_plan_has_the_all_to_all_term(moe_workload: Workload) -> None:
    per_row = 2 * MOE["seq_len"] * MOE["top_k"] * MOE["d_model"] * 4  # two experts layers
    assert sum(item.dispatch_bytes_per_row for item in moe_workload.items[1]) == per_row
    assert sum(item.experts_calls for item in moe_workload.items[1]) == 2
    machine = _machine()
    dense = predict(moe_workload, machine, ms.Plan(dp=4))
    split = predict(moe_workload, machine, ms.Plan(dp=4, ep=4))
    assert dense.terms["communication_ep"] == 0 and dense.bytes_per_step["ep"] == 0
    assert split.terms["communication_ep"] > 0
    rows = ROWS / 4  # two all-to-alls of the payload each way, 3/4 of each leaving the rank
    assert split.bytes_per_step["ep"] == pytest.approx(4 * per_row * rows * 3 / 4)
    assert split.bytes_per_step["dp"] < dense.bytes_per_step["dp"]  # experts not summed
    slow = _machine(all_to_all_s=0.05)
    lost = predict(moe_workload, slow, ms.Plan(dp=4, ep=4))
    # 2 layers x (3 forward + 2 backward) all-to-alls, each at least 50 ms to start
    assert lost.terms["communication_ep"] >= 10 * 0.05
    sentence = reason(lost, predict(moe_workload, slow, ms.Plan(dp=4)), slow)
    assert "all-to-all over ep=4" in sentence, sentence
    slow_reduce = _machine(all_reduce_rate=1e6)  # the experts' gradients cost ~50 ms to sum
    dense, split = (predict(moe_workload, slow_reduce, ms.Plan(dp=4, ep=ep)) for ep in (1, 4))
    assert split.step_time_s < dense.step_time_s
    sentence = reason(dense, split, slow_reduce)
    assert "gradient all-reduce over dp=4" in sentence, sentence
    assert "the best holds 1/4 of the experts per rank, sums none" in sentence, sentence
    assert "all_to_all" in load_cluster("dgx-h100").machine().links


def test_choose_plan_ranks_ep_plans_with_their_estimate() -> None:
    report = choose_plan(
        _moe(), _batch(), 2, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy(),
        machine=_machine(),
    )  # fmt: skip
    plans = [row.plan for row in report.rows]
    assert any(plan.ep == 2 for plan in plans) and any(plan.ep == 1 for plan in plans)
    estimated = [row for row in report.rows if row.memory_source == "estimate"]
    assert estimated and all(len(row.peak_bytes) == 2 for row in estimated)


def _train(plan: ms.Plan | None) -> dict[str, Any]:
    """STEPS SGD steps of the moe model under `plan` (None: plain PyTorch, this process)."""
    batches = [_batch(seed=seed) for seed in range(STEPS)]
    loss_fn = ms.models.TokenCrossEntropy()
    if plan is None:
        model = _moe()
        optimizer = _sgd(model.parameters())
        losses = []
        for x, y in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return {"losses": losses, "state": model.state_dict()}
    engine = ms.parallelize(_moe(), plan, optimizer=_sgd, loss_fn=loss_fn)
    losses = [engine.train_step(x, y) for x, y in batches]
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


@pytest.mark.timeout(300)
def test_the_moe_reference_trains_under_dp2_ep2_as_one_process() -> None:
    want = _train(None)
    for got in ms.launch(_train, 2, args=(ms.Plan(dp=2, ep=2),), timeout_s=240):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=1e-6
        )
        assert got["state"].keys() == want["state"].keys()
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5)
