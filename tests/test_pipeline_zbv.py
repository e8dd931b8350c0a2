"""ZB-V: two chunks per rank in a V, backward split into B and W, equal to one process.

The schedule is checked without processes (every action once, no deadlock, 2P chunk
micro-batches in flight, a smaller bubble than ZB-H1); then the reference transformer, a
Hugging Face GPT-2 (its tied embedding and head both on rank 0, the V's two ends; in 8 chunks
its attention mask skips cuts, under zbv and interleaved) and a BatchNorm CNN train under
pp2, pp4, dp2 x pp2 (ZeRO 2 and 3) and pp2 x tp2 against one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.pipeline.schedules import (
    chunk_ranks,
    diagram,
    idle_fraction,
    max_in_flight,
    one_f_one_b,
    schedule,
    timeline,
    zero_bubble,
)

from reference import assert_each_case, assert_matches, train_gpt2, train_parallel, train_single

RTOL, ATOL = 1e-4, 1e-5
ZBV = {"schedule": "zbv"}


@pytest.mark.parametrize("stages", range(2, 9))
def test_every_rank_runs_each_of_its_chunks_once_without_deadlock(stages: int) -> None:
    assert chunk_ranks(stages, 2, "zbv") == [*range(stages), *reversed(range(stages))]
    for micro in range(1, 3 * stages + 1):
        actions = schedule("zbv", stages, micro, 2)
        timeline(actions)  # raises on a deadlock
        for rank, row in enumerate(actions):
            mine = {rank, 2 * stages - 1 - rank}
            want = {(k, j, c) for k in "FBW" for j in range(micro) for c in mine}
            assert sorted((a.kind, a.micro, a.chunk) for a in row) == sorted(want)
            # at most 1F1B's activations: p micro-batches of a stage, 2p of half-stage chunks
            assert max_in_flight(row) <= 2 * stages
        if micro >= 2 * stages:
            assert idle_fraction(actions) < idle_fraction(zero_bubble(stages, micro))
            assert idle_fraction(zero_bubble(stages, micro)) < idle_fraction(
                one_f_one_b(stages, micro)
            )


def test_the_v_turns_on_the_last_rank_and_ends_on_the_first() -> None:
    assert diagram(schedule("zbv", 2, 2, 2)) == (
        "stage 0 | F0:0 F1:0 ..   F0:3 B0:3 F1:3 B1:3 B0:0 W0:3 B1:0 W1:3 W0:0 W1:0\n"
        "stage 1 | ..   F0:1 F0:2 F1:1 F1:2 B0:2 B0:1 B1:2 B1:1 W0:2 W0:1 W1:2 W1:1"
    )
    plan = ms.Plan(pp=2, micro_batches=4, **ZBV)
    assert plan.virtual_stages == 2 and plan.describe() == "dp1 pp2 tp1 m4 zbv"
    with pytest.raises(ms.PlanError, match="two chunks per rank in a V, not virtual_stages=3"):
        ms.Plan(pp=2, micro_batches=4, schedule="zbv", virtual_stages=3)


TWO: list[dict[str, Any]] = [
    {"pp": 2, "micro_batches": 4, **ZBV},
    {"pp": 2, "micro_batches": 4, **ZBV, "recompute": "except_last"},
    {"pp": 2, "micro_batches": 4, **ZBV, "recompute": "always"},
]
FOUR: list[dict[str, Any]] = [
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZBV},
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZBV, "zero": 2},
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZBV, "zero": 3},
    {"pp": 2, "tp": 2, "micro_batches": 4, **ZBV},
]


def _batchnorm_cnn(plan: ms.Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A CNN with BatchNorm (statistics per micro-batch, running statistics once a step)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2),
        nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )  # fmt: skip
    x, y = ms.data.synthetic_images(48, seed=3)
    engine = ms.parallelize(
        model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    )
    losses = [
        engine.train_step(xb, yb % 5) for xb, yb in zip(x.split(16), y.split(16), strict=True)
    ]
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def _two_process_worker() -> dict[str, Any]:
    x, _ = ms.data.synthetic_images(16, seed=5)
    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.mlp((784, 32, 32, 16, 10)), ms.Plan(pp=2, micro_batches=4, **ZBV),
        example_inputs=x,
    )  # fmt: skip
    described = engine.describe()
    predicted = engine.predict(x)
    engine.close()
    torch.manual_seed(0)
    plain = ms.models.mlp((784, 32, 32, 16, 10))
    refused = None
    try:
        ms.parallelize(
            ms.models.mlp((784, 32, 16, 10)), ms.Plan(pp=2, micro_batches=2, **ZBV),
            example_inputs=x,
        )  # fmt: skip
    except ms.PlanError as error:
        refused = str(error)
    return {
        "transformer": [train_parallel("transformer", "sgd", ms.Plan(**o)) for o in TWO],
        "gpt2": train_gpt2(ms.Plan(pp=2, micro_batches=2, **ZBV)),
        "batchnorm": [
            _batchnorm_cnn(ms.Plan(pp=2, micro_batches=2, schedule=s)) for s in ("1f1b", "zbv")
        ],
        "describe": described,
        "predicted": predicted,
        "expected": plain(x).detach(),
        "refused": refused,
    }


def test_two_stages_match_single_process() -> None:
    pytest.importorskip("transformers")
    per_rank = ms.launch(_two_process_worker, 2)
    expected = train_single("transformer", "sgd")
    assert_each_case([r["transformer"] for r in per_rank], TWO, expected, rtol=RTOL, atol=ATOL)
    assert_matches([r["gpt2"] for r in per_rank], train_gpt2(None), rtol=RTOL, atol=ATOL)
    one_f_one_b_run, zbv_run = per_rank[0]["batchnorm"]
    assert_matches([zbv_run], one_f_one_b_run, rtol=RTOL, atol=ATOL, case="BatchNorm")
    described = per_rank[0]["describe"]
    assert described["chunks"] == {0: [0, 3], 1: [1, 2]}
    assert [s["stage"] for s in described["stages"]] == [0, 1, 1, 0]
    assert " W0:3" in described["schedule"]
    for rank in per_rank:  # the output, made on rank 0, reaches every rank
        torch.testing.assert_close(rank["predicted"], rank["expected"], rtol=RTOL, atol=ATOL)
        assert rank["refused"].startswith(
            "Plan.pp=2 x virtual_stages=2 = 4 chunks exceeds the 3 layers with parameters"
        )


SKIPS: list[dict[str, Any]] = [
    {"pp": 4, "micro_batches": 4, **ZBV},
    {"pp": 4, "micro_batches": 4, "schedule": "interleaved", "virtual_stages": 2},
]
"""GPT-2 in 8 chunks: its attention mask, made in one chunk, is read by every later one, so a
chunk sends to two chunks of one peer and to one of its own rank."""


def _four_process_worker() -> dict[str, list[tuple[list[float], dict[str, torch.Tensor]]]]:
    return {
        "transformer": [train_parallel("transformer", "sgd", ms.Plan(**o)) for o in FOUR],
        "gpt2": [train_gpt2(ms.Plan(**o)) for o in SKIPS],
    }


def test_four_processes_match_single_process() -> None:
    pytest.importorskip("transformers")
    results = ms.launch(_four_process_worker, 4)
    expected = train_single("transformer", "sgd")
    assert_each_case([r["transformer"] for r in results], FOUR, expected, rtol=RTOL, atol=ATOL)
    gpt2 = [r["gpt2"] for r in results]
    assert_each_case(gpt2, SKIPS, train_gpt2(None), rtol=RTOL, atol=ATOL, label="GPT-2")
