"""Layer split equals single-process training: models, schedules, micro-batches, recompute.

Many cases share one `ms.launch` per process count: spawning workers dominates the time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms

from reference import assert_matches, train_parallel, train_single

TWO_STAGES: list[tuple[str, str, dict[str, Any]]] = [
    ("small_mlp", "sgd", {"micro_batches": 1, "schedule": "gpipe"}),
    ("small_mlp", "adamw", {"micro_batches": 4, "schedule": "1f1b"}),
    ("small_mlp", "adamw", {"micro_batches": 4, "schedule": "gpipe", "recompute": "always"}),
    ("small_mlp", "sgd", {"micro_batches": 4, "schedule": "1f1b", "recompute": "except_last"}),
    ("cnn", "sgd", {"micro_batches": 4, "schedule": "1f1b"}),
    ("cnn", "adamw", {"micro_batches": 1, "schedule": "gpipe", "recompute": "always"}),
    ("transformer", "adamw", {"micro_batches": 4, "schedule": "1f1b"}),
    ("transformer", "sgd", {"micro_batches": 4, "schedule": "gpipe", "recompute": "always"}),
    # SGD: an input pixel that is 0 in nearly every row gets a ~1e-10 gradient, which AdamW
    # turns into a full step, so summation-order noise showed as a 3e-6 difference
    ("skip_mlp", "sgd", {"micro_batches": 4, "schedule": "1f1b", "stages": (3, 3)}),
    ("skip_mlp", "sgd", {"micro_batches": 1, "schedule": "gpipe", "recompute": "always"}),
]

FOUR_PROCESSES: list[tuple[str, str, dict[str, Any]]] = [
    ("small_mlp", "adamw", {"pp": 4, "micro_batches": 4, "schedule": "1f1b"}),
    ("small_mlp", "sgd", {"pp": 4, "micro_batches": 1, "recompute": "except_last"}),
    ("mlp", "sgd", {"pp": 4, "micro_batches": 4, "schedule": "gpipe"}),
    # the skip connection leaves stage 0 for stage 3, past stages 1 and 2
    ("skip_mlp", "sgd", {"pp": 4, "micro_batches": 4, "stages": (2, 1, 1, 2)}),  # SGD: see above
    (
        "skip_mlp",
        "sgd",
        {
            "pp": 4,
            "micro_batches": 4,
            "schedule": "gpipe",
            "stages": (2, 1, 1, 2),
            "recompute": "always",
        },
    ),
    ("small_mlp", "adamw", {"dp": 2, "pp": 2, "micro_batches": 2, "schedule": "1f1b"}),
]


def _run(cases: list[tuple[str, str, dict[str, Any]]], pp: int) -> list[Any]:
    return [
        train_parallel(model, opt, ms.Plan(**{"pp": pp, **options}))
        for model, opt, options in cases
    ]


def _check(per_rank: list[list[Any]], cases: list[tuple[str, str, dict[str, Any]]]) -> None:
    for index, (model, opt, options) in enumerate(cases):
        try:
            assert_matches([rank[index] for rank in per_rank], train_single(model, opt))
        except AssertionError as error:
            raise AssertionError(f"{model} {opt} {options}: {error}") from error


def _two_stage_worker() -> dict[str, Any]:
    return {"cases": _run(TWO_STAGES, 2), **_engine_details()}


def _engine_details() -> dict[str, Any]:
    """describe(), predict(), buffer reuse and a refused plan, on one small pipeline."""
    torch.manual_seed(0)
    model = ms.models.mlp((784, 32, 16, 10))
    engine = ms.parallelize(model, ms.Plan(pp=2, micro_batches=4))
    x, y = ms.data.synthetic_images(16, seed=5)
    engine.train_step(x, y)
    after_one = engine.runner.buffer_allocations  # type: ignore[attr-defined]
    engine.train_step(x, y)
    engine.train_step(x, y)
    after_three = engine.runner.buffer_allocations  # type: ignore[attr-defined]
    predicted = engine.predict(x[:7])  # 7 rows: uneven micro-batches
    details = {
        "describe": engine.describe(),
        "allocations": (after_one, after_three),
        "predicted": predicted,
        "state": engine.full_state_dict(),
    }
    engine.close()
    recomputing = ms.parallelize(
        ms.models.mlp((784, 32, 16, 10)), ms.Plan(pp=2, recompute="except_last"), example_inputs=x
    )
    stage = recomputing.runner.stage  # type: ignore[attr-defined]
    details["recomputes"] = stage.compute is not stage.program
    recomputing.close()
    try:
        ms.parallelize(
            nn.Sequential(nn.Linear(8, 2)), ms.Plan(pp=2), example_inputs=torch.ones(2, 8)
        )
    except ms.PlanError as error:
        details["refused"] = str(error)
    return details


def test_two_stages_match_single_process() -> None:
    per_rank = ms.launch(_two_stage_worker, 2)
    _check([rank["cases"] for rank in per_rank], TWO_STAGES)
    first, last = per_rank
    # predict: the full output on every rank, equal to the trained model's
    model = ms.models.mlp((784, 32, 16, 10))
    model.load_state_dict(first["state"])
    expected = model.eval()(ms.data.synthetic_images(16, seed=5)[0][:7]).detach()
    for rank in per_rank:
        torch.testing.assert_close(rank["predicted"], expected)
    # except_last: the first stage recomputes in backward, the last runs as it is
    assert [rank["recomputes"] for rank in per_rank] == [True, False]
    # receive buffers come from a pool: nothing new after the first step
    assert first["allocations"][0] == first["allocations"][1] > 0
    assert last["allocations"][0] == last["allocations"][1] > 0
    described = first["describe"]
    assert [s["layers"] for s in described["stages"]] == [
        s["layers"] for s in last["describe"]["stages"]
    ]
    assert sum(len(s["layers"]) for s in described["stages"]) == 6
    assert sum(s["parameters"] for s in described["stages"]) == sum(
        p.numel() for p in model.parameters()
    )
    assert all(s["forward_ms"] > 0 and s["backward_ms"] >= 0 for s in described["stages"])
    assert described["bubble_fraction"] == pytest.approx(1 / 5)
    assert described["schedule"].startswith("stage 0 | F0")
    for rank in per_rank:
        assert rank["refused"].startswith("Plan.pp=2 exceeds the 1 layers of the model")


def _four_process_worker() -> list[Any]:
    return [
        train_parallel(model, opt, ms.Plan(**options)) for model, opt, options in FOUR_PROCESSES
    ]


def test_four_stages_skip_connections_and_data_parallel_match_single_process() -> None:
    _check(ms.launch(_four_process_worker, 4), FOUR_PROCESSES)


class Fails(nn.Module):
    """Raises in forward once it sees an input it was not profiled on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.abs().max()) > 100:
            raise RuntimeError("stage failed mid-step")
        return x


def _stage_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), Fails(), nn.Linear(16, 10))
    plan = ms.Plan(pp=2, micro_batches=2, stages=(2, 2))
    x, y = ms.data.synthetic_images(8)
    engine = ms.parallelize(model, plan, example_inputs=x[:4])
    engine.train_step(x * 1e6, y)


def test_a_stage_that_raises_ends_the_job_without_hanging() -> None:
    with pytest.raises(ms.WorkerError) as caught:
        ms.launch(_stage_raises, 2, timeout_s=60)
    assert caught.value.rank == 1
    assert "stage failed mid-step" in caught.value.traceback
