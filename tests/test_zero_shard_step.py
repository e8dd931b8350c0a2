"""Under ZeRO 2/3 an element-wise optimizer steps over the plain local shards (not DTensors):
bit for bit what it computes over the DTensors, the state DTensors again between steps, and
an optimizer that may read a whole tensor (a subclass: a trust ratio) left on DTensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit.data_parallel import sync

from reference import assert_matches, batches, build, loss_for, train_plainly

pytestmark = pytest.mark.timeout(600)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-6),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-6, amsgrad=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01, initial_accumulator_value=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True, eps=1e-6),
}
CASES = [(name, 3) for name in OPTIMIZERS] + [("adamw", 2)]


class NormedAdamW(torch.optim.AdamW):
    """A subclass may read whole tensors (a trust ratio): it must see the DTensors."""


def _seen_in_step(optimizer: torch.optim.Optimizer) -> list[str]:
    """The kinds of parameter the optimizer's groups hold while it steps."""
    seen: list[str] = []

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        kinds = {type(p).__name__ for g in opt.param_groups for p in g["params"]}
        seen.append(",".join(sorted(kinds)))

    optimizer.register_step_pre_hook(record)  # after the engine's own pre-hook
    return seen


def _train(name: str, stage: int) -> dict[str, Any]:
    """Three steps of the CNN under dp2 and ZeRO `stage` with optimizer `name`."""
    make = OPTIMIZERS.get(name, lambda p: NormedAdamW(p, lr=1e-3, eps=1e-6))
    made: list[torch.optim.Optimizer] = []
    engine = ms.parallelize(
        build("cnn"),
        ms.Plan(dp=2, zero=stage),
        optimizer=lambda p: made.append(make(p)) or made[-1],
        loss_fn=loss_for("cnn"),
    )
    seen = _seen_in_step(made[-1])
    losses = [engine.train_step(x, y) for x, y in batches("cnn", 8, 3)]
    state = made[-1].state_dict()["state"]
    kinds = {type(v).__name__ for s in state.values() for v in s.values() if v.dim() > 0}
    result = {
        "losses": losses,
        "state": engine.full_state_dict(),
        "seen": seen[-1],
        "state kinds": sorted(kinds),
    }
    engine.close()
    return result


def _job() -> dict[str, Any]:
    results = {f"{n}, zero={s}": _train(n, s) for n, s in [*CASES, ("subclass", 3)]}
    on_shards = sync.step_on_shards
    sync.step_on_shards = lambda optimizer: None  # every step over DTensors, as FSDP2's
    try:
        for name, stage in CASES:
            results[f"{name}, zero={stage}, DTensors"] = _train(name, stage)
    finally:
        sync.step_on_shards = on_shards
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return ms.launch(_job, 2, timeout_s=500)


@pytest.mark.parametrize("name, stage", CASES, ids=[f"{n}-zero{s}" for n, s in CASES])
def test_an_elementwise_optimizer_steps_over_plain_shards_as_over_dtensors(
    per_rank: list[dict[str, Any]], name: str, stage: int
) -> None:
    for result in per_rank:
        run, over_dtensors = (
            result[f"{name}, zero={stage}"],
            result[f"{name}, zero={stage}, DTensors"],
        )
        assert run["seen"] == "Tensor"  # every parameter's local shard, none a DTensor
        assert over_dtensors["seen"] == "DTensor"
        assert run["state kinds"] == over_dtensors["state kinds"] == ["DTensor"]
        assert run["losses"] == over_dtensors["losses"]
        for key, value in over_dtensors["state"].items():
            assert torch.equal(run["state"][key], value), key


def test_sgd_over_plain_shards_equals_one_process(per_rank: list[dict[str, Any]]) -> None:
    model = build("cnn")
    expected = train_plainly(
        model, OPTIMIZERS["sgd"](model.parameters()), loss_for("cnn"), batches("cnn", 8, 3)
    )
    runs = [result["sgd, zero=3"] for result in per_rank]
    assert_matches([(run["losses"], run["state"]) for run in runs], expected)


def test_a_subclass_steps_over_the_dtensors(per_rank: list[dict[str, Any]]) -> None:
    for result in per_rank:
        assert result["subclass, zero=3"]["seen"] == "DTensor"
