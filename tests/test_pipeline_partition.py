"""The balanced split on synthetic costs: optimal (checked by brute force), pure, and strict."""

from __future__ import annotations

import itertools
import random

import pytest

import meshsplit as ms
from meshsplit.pipeline.partition import SLACK, balance, check_split, stage_costs


def _brute_force(costs: list[float], stages: int, anchors: list[bool] | None = None) -> float:
    """Smallest largest-stage cost over every contiguous split into non-empty stages."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if anchors is not None and not all(
            any(anchors[a:b]) for a, b in itertools.pairwise(bounds)
        ):
            continue
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, max(stage_costs(costs, sizes)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_optimal_on_random_costs(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.choice([rng.uniform(0.1, 10), rng.uniform(0.1, 0.5)]) for _ in range(n)]
    for stages in range(1, n + 1):
        sizes = balance(costs, stages)
        assert len(sizes) == stages and sum(sizes) == n and min(sizes) >= 1
        assert max(stage_costs(costs, sizes)) == pytest.approx(_brute_force(costs, stages))


@pytest.mark.parametrize("seed", range(40))
def test_balance_with_anchors_is_optimal_and_gives_each_stage_one(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    costs = [rng.uniform(0.0, 5) for _ in range(n)]
    anchors = [rng.random() < 0.5 for _ in range(n)]
    anchors[rng.randrange(n)] = True
    for stages in range(1, sum(anchors) + 1):
        sizes = balance(costs, stages, anchors)
        starts = [sum(sizes[:k]) for k in range(stages + 1)]
        assert all(any(anchors[a:b]) for a, b in itertools.pairwise(starts))
        best = _brute_force(costs, stages, anchors)
        assert max(stage_costs(costs, sizes)) == pytest.approx(best)
    if sum(anchors) < n:
        with pytest.raises(ms.PlanError, match="layers with parameters"):
            balance(costs, sum(anchors) + 1, anchors)


def test_ties_on_the_slowest_stage_are_broken_evenly() -> None:
    # the 10 decides the maximum; the other layers still spread over the other stages
    assert balance([10, 1, 1, 1, 1, 1, 1], 3) == (1, 3, 3)


def test_near_equal_timings_spread_the_weights() -> None:
    """T5-like: the fastest split by a hair leaves one stage holding the whole encoder."""
    costs = [0.05, 0.6, 0.5, 0.05, 0.05, 1.25, 1.3, 0.05, 0.05]
    memory = [2, 8, 8, 0, 2, 12, 12, 0, 2]
    assert balance(costs, 4) == (5, 1, 1, 2)
    sizes = balance(costs, 4, memory=memory)
    assert sizes == (2, 3, 1, 3)
    assert max(stage_costs(costs, sizes)) <= (1 + SLACK) * max(stage_costs(costs, (5, 1, 1, 2)))


@pytest.mark.parametrize("seed", range(20))
def test_memory_is_spread_only_within_the_slack_of_the_fastest(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    costs = [rng.uniform(0.1, 5) for _ in range(n)]
    memory = [rng.uniform(0, 10) for _ in range(n)]
    for stages in range(1, n + 1):
        sizes = balance(costs, stages, memory=memory)
        fastest = _brute_force(costs, stages)
        assert max(stage_costs(costs, sizes)) <= (1 + SLACK) * fastest + 1e-9
        assert (
            max(stage_costs(memory, sizes))
            <= max(stage_costs(memory, balance(costs, stages))) + 1e-9
        )


def test_balance_examples() -> None:
    assert balance([1, 1, 1, 1], 2) == (2, 2)
    assert balance([10, 1, 1, 1, 1], 2) == (1, 4)
    assert balance([1, 2, 3, 4, 5, 6], 3) == (3, 2, 1)
    assert balance([5.0], 1) == (1,)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(
        ms.PlanError, match=r"Plan.pp=5 exceeds the 4 layers of the model; use pp <= 4"
    ):
        balance([1, 1, 1, 1], 5)


@pytest.mark.parametrize(
    ("sizes", "words"),
    [((3, 0), "at least one layer"), ((2, 3), "covers 5 layers but the model has 4")],
)
def test_manual_stages_must_cover_the_layers(sizes: tuple[int, ...], words: str) -> None:
    with pytest.raises(ms.PlanError, match=words) as caught:
        check_split(4, 2, sizes)
    assert "stages=[2, 2]" in str(caught.value)


def test_plan_refuses_empty_stage_and_uneven_micro_batches() -> None:
    with pytest.raises(ms.PlanError, match="Plan.stages"):
        ms.Plan(pp=2, stages=(3, 0))
    with pytest.raises(ms.PlanError, match="not divisible by dp\\*micro_batches"):
        ms.Plan(pp=2, micro_batches=3).check_batch(16)
