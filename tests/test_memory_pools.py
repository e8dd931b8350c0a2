"""Pre-allocation (memory/pools.py): optimizer state made at the build without changing the
trajectory, step 1 peaking as step 100, and steady steps that allocate no lasting buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import meshsplit as ms
from meshsplit.memory import pools

from reference import OPTIMIZERS, assert_matches, batches, build, train_parallel, train_single

pytestmark = pytest.mark.timeout(300)

OPTIMIZERS["adam"] = lambda params: torch.optim.Adam(params, lr=1e-3, eps=1e-6)
MODEL = "small_mlp"
STEPS = 100
PROFILED = (1, 50, 51)

KEPT_ON_TRAJECTORY = {
    "sgd momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd nesterov wd": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1
    ),
    "adam wd amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True, foreach=False),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop centered": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
}
LEFT_LAZY = {
    "sgd dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
    "nadam": lambda p: torch.optim.NAdam(p),  # mu_product starts at 1, not 0
    "lbfgs": lambda p: torch.optim.LBFGS(p),  # its step needs a closure
}


def _trajectory(make: Any, preallocate: bool) -> tuple[list[torch.Tensor], str | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    optimizer = make(model.parameters())
    reason = pools.preallocate_optimizer_state(optimizer) if preallocate else None
    if preallocate and reason is None:
        assert optimizer.state, "state made before the first step"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], reason


@pytest.mark.parametrize("name", KEPT_ON_TRAJECTORY)
def test_preallocated_state_keeps_the_trajectory_bit_for_bit(name: str) -> None:
    make = KEPT_ON_TRAJECTORY[name]
    fresh, _ = _trajectory(make, preallocate=False)
    early, reason = _trajectory(make, preallocate=True)
    assert reason is None
    for a, b in zip(fresh, early, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", LEFT_LAZY)
def test_an_optimizer_that_would_diverge_is_left_lazy_with_a_reason(name: str) -> None:
    make = LEFT_LAZY[name]
    model = nn.Linear(3, 2)
    optimizer = make(model.parameters())
    reason = pools.preallocate_optimizer_state(optimizer)
    assert reason is not None and type(optimizer).__name__ in reason
    assert not optimizer.state


def test_allocator_settings_parse_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not pools.allocator_settings()["expandable_segments"]
    pools.set_expandable_segments(True)
    settings = pools.allocator_settings()
    assert settings["expandable_segments"]
    assert settings["settings"] == {"max_split_size_mb": "128", "expandable_segments": "True"}


def _exact(dp: int) -> list[Any]:
    plans = [ms.Plan(dp=dp), ms.Plan(dp=dp, micro_batches=2)]
    return [train_parallel(MODEL, opt, plan) for opt in ("sgd", "adam", "adamw") for plan in plans]


@pytest.mark.parametrize("dp", [1, 2])
def test_preallocated_runs_equal_single_process_pytorch(dp: int) -> None:
    per_rank = ms.launch(_exact, dp, args=(dp,))
    expected = [train_single(MODEL, opt) for opt in ("sgd", "adam", "adamw") for _ in range(2)]
    for index, want in enumerate(expected):
        assert_matches([results[index] for results in per_rank], want)


def _allocations(engine: ms.Engine, x: torch.Tensor, y: torch.Tensor) -> int:
    """Allocations (profiler memory events of positive size) of one train_step."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.train_step(x, y)
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    return sum(1 for e in events if e.name() == "[memory]" and e.nbytes() > 0)


def _lasting(engine: ms.Engine) -> dict[str, list[int]]:
    """Storage addresses of the buffers that live for the whole run."""
    optimizer = pools.local_optimizer(engine.optimizer)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "optimizer": [t.untyped_storage().data_ptr() for t in state],
        "gradients": [t.untyped_storage().data_ptr() for t in engine.sync.gradient_tensors()],
        "p2p": [t.untyped_storage().data_ptr() for t in engine.runner.communication_buffers()],
    }


def steady(plan: ms.Plan, optimizer: str = "adam", steps: int = STEPS) -> dict[str, Any]:
    """Runs in every worker: the tracker's peak after each step, allocations of the
    profiled steps, and what lasting buffers exist before step 1 and after the last."""
    x, y = batches(MODEL, 16, 1)[0]
    engine = ms.parallelize(
        build(MODEL), plan, optimizer=OPTIMIZERS[optimizer], example_inputs=x[:4]
    )
    engine.memory.track = True  # every step's peak, not the default sample
    before = engine.memory_report().optimizer_bytes
    at_build = _lasting(engine)
    peaks, allocations, p2p = [], {}, []
    for step in range(1, steps + 1):
        if step in PROFILED:
            allocations[step] = _allocations(engine, x, y)
        else:
            engine.train_step(x, y)
        peaks.append(engine.memory_report().tensor_peak_bytes)
        p2p.append(getattr(engine.runner, "buffer_allocations", 0))
    exchange = getattr(getattr(engine.runner, "stage", None), "exchange", None)
    # a message's shapes travel once, in a header: [length], then the header itself
    headers = 0 if exchange is None else 2 * (len(exchange.told) + len(exchange._heard))
    result = {
        "optimizer_bytes_before_step_1": before,
        "optimizer_bytes": engine.memory_report().optimizer_bytes,
        "lasting_at_build": at_build,
        "lasting_at_end": _lasting(engine),
        "peaks": peaks,
        "allocations": allocations,
        "p2p_allocations": p2p,
        "header_allocations": headers,
        "lazy_reason": engine.preallocated.lazy_reason,
    }
    engine.close()
    return result


@pytest.mark.parametrize(
    "plan", [ms.Plan(dp=2), ms.Plan(pp=2, micro_batches=4)], ids=["dp2", "pp2-m4"]
)
def test_step_1_peaks_as_step_100_and_steady_steps_allocate_alike(plan: ms.Plan) -> None:
    # SGD: with its momentum made by the first step, step 1 peaked 23% under step 100
    for rank, result in enumerate(ms.launch(steady, 2, args=(plan, "sgd"))):
        assert result["lazy_reason"] is None
        assert result["optimizer_bytes_before_step_1"] == result["optimizer_bytes"] > 0
        first, last = result["peaks"][0], result["peaks"][-1]
        assert abs(first - last) <= 0.02 * last, (rank, first, last)
        counts = result["allocations"]
        assert counts[50] == counts[51], (rank, counts)
        # step 1 allocates only what steady steps do, plus (pp) the receive pool's buffers
        # and the shape headers: everything else lasting was made at the build
        new_buffers, headers = result["p2p_allocations"][0], result["header_allocations"]
        assert counts[1] - new_buffers - headers == counts[50], (rank, counts, new_buffers)
        assert result["p2p_allocations"][-1] == new_buffers  # the pool is warm after step 1
        at_build, at_end = result["lasting_at_build"], result["lasting_at_end"]
        assert at_build["optimizer"] == at_end["optimizer"]  # made once, never again
        assert at_build["gradients"] == at_end["gradients"]


def _budgeted() -> dict[str, Any]:
    x, y = batches(MODEL, 16, 1)[0]
    engine = ms.parallelize(
        build(MODEL), ms.Plan(dp=2, memory_budget="64MiB"), optimizer=OPTIMIZERS["adam"]
    )
    engine.prepare(x)
    budget = engine.memory.budget
    assert budget is not None
    return {"predicted": budget.static["optimizer"], "held": engine.memory_report().optimizer_bytes}


def test_the_budget_check_predicts_the_state_made_at_the_build() -> None:
    for result in ms.launch(_budgeted, 2):
        assert result["predicted"] == result["held"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator is CUDA's")
def test_reserve_memory_makes_the_allocator_hold_the_peak() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device)
    reserved = pools.reserve(device, held + (256 << 20))
    assert reserved > 0
    assert torch.cuda.memory_reserved(device) >= held + (256 << 20)
    assert torch.cuda.memory_allocated(device) < held + (256 << 20)
    assert pools.reserve(device, held) == 0
    assert pools.reserve_target(100, None) == 200
    assert pools.reserve_target(100, 1000) == 900
