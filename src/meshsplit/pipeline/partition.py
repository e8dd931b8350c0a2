"""Balanced layer split: contiguous stages that minimise the slowest stage. Numbers in, numbers out.

The slowest stage sets the step time, so this is the linear partition problem, solved exactly
by dynamic programming over the prefix sums S of the layer costs (best[k][i]: the optimum for
the first i layers in k stages):

    best[k][i] = min over j < i of max(best[k-1][j], S[i] - S[j])

Ties go to the smaller sum of squared stage costs. Given each layer's memory, a second pass
of the same recurrence, over memory and limited to stages within SLACK of that optimum cost,
spreads the weights. Rationale: docs/internals.md#pipelinepartitionpy
"""

from __future__ import annotations

from collections.abc import Sequence

from meshsplit.plan import PlanError

__all__: list[str] = []


SLACK = 0.1
"""How much slower than the fastest split's slowest stage a split may be when it spreads the
parameters more evenly: profiles of small layers vary by about this much from run to run."""


def balance(
    costs: Sequence[float],
    stages: int,
    anchors: Sequence[bool] | None = None,
    memory: Sequence[float] | None = None,
    virtual_stages: int = 1,
) -> tuple[int, ...]:
    """Layers per stage (contiguous, each >= 1) that minimise the largest stage cost.

    With `anchors`, every stage must also hold at least one anchored layer (the runner
    anchors layers with parameters: a stage with nothing to train has no optimizer). With
    `memory` (per layer), the split minimises the largest stage memory among those whose
    largest stage cost is within SLACK of the least, so near-equal timings do not leave
    one rank holding most of the weights. `stages` counts chunks under interleaving
    (`virtual_stages` of them per rank), which changes only the words of errors.
    """
    check_split(len(costs), stages, virtual_stages=virtual_stages)
    label, name = split_words(stages, virtual_stages)
    anchors = [True] * len(costs) if anchors is None else list(anchors)
    if sum(anchors) < stages:
        raise PlanError(
            f"{label} exceeds the {sum(anchors)} layers with parameters of the model "
            f"(each stage needs one); use {name} <= {sum(anchors)}"
        )
    fastest = _min_max_split(costs, stages, anchors, costs, float("inf"))
    if memory is None:
        return fastest
    bound = (1 + SLACK) * max(stage_costs(costs, fastest))
    return _min_max_split(memory, stages, anchors, costs, bound)


def balance_runs(
    costs: Sequence[float],
    runs: Sequence[tuple[int, int]],
    stages: int,
    anchors: Sequence[bool],
    memory: Sequence[float] | None = None,
    virtual_stages: int = 1,
) -> tuple[int, ...]:
    """`balance` where a stage may begin only at some items: over `runs` ([start, stop) of
    items a stage takes whole, in order, covering every item), as items per stage."""
    sizes = balance(
        [sum(costs[a:b]) for a, b in runs],
        stages,
        [any(anchors[a:b]) for a, b in runs],
        None if memory is None else [sum(memory[a:b]) for a, b in runs],
        virtual_stages,
    )
    ends = [runs[sum(sizes[: k + 1]) - 1][1] for k in range(stages)]
    return tuple(b - a for a, b in zip([0, *ends], ends, strict=False))


def _min_max_split(
    values: Sequence[float],
    stages: int,
    anchors: Sequence[bool],
    costs: Sequence[float],
    bound: float,
) -> tuple[int, ...]:
    """The contiguous split minimising the largest stage sum of `values` (ties: the smaller
    sum of squares) among those whose every stage holds an anchor and costs at most `bound`."""
    n = len(values)
    prefix, held, spent = [0.0], [0], [0.0]
    for value, anchored, cost in zip(values, anchors, costs, strict=True):
        prefix.append(prefix[-1] + value)
        held.append(held[-1] + int(anchored))
        spent.append(spent[-1] + cost)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # (largest stage, sum of squares)
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        # stage k ends after layer i; the k-1 stages before it need at least k-1 layers
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if held[i] == held[j] or spent[i] - spent[j] > bound:
                    continue
                largest, squares = best[k - 1][j]
                stage = prefix[i] - prefix[j]
                candidate = (max(largest, stage), squares + stage * stage)
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    sizes = []
    end = n
    for k in range(stages, 0, -1):
        start = cut[k][end]
        sizes.append(end - start)
        end = start
    return tuple(reversed(sizes))


def stage_costs(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Total cost of each stage for the split `sizes`."""
    totals, start = [], 0
    for size in sizes:
        totals.append(sum(costs[start : start + size]))
        start += size
    return totals


def split_words(chunks: int, virtual_stages: int = 1) -> tuple[str, str]:
    """How errors name a split into `chunks` parts: ('Plan.pp=2', 'pp'), or under
    interleaving ('Plan.pp=2 x virtual_stages=2 = 4 chunks', 'pp*virtual_stages')."""
    if virtual_stages == 1:
        return f"Plan.pp={chunks}", "pp"
    label = (
        f"Plan.pp={chunks // virtual_stages} x virtual_stages={virtual_stages} = {chunks} chunks"
    )
    return label, "pp*virtual_stages"


def check_split(
    layers: int, stages: int, sizes: Sequence[int] | None = None, virtual_stages: int = 1
) -> None:
    """Refuse a split that leaves a stage empty or does not cover the model's layers."""
    label, name = split_words(stages, virtual_stages)
    if stages > layers:
        raise PlanError(
            f"{label} exceeds the {layers} layers of the model; use {name} <= {layers} "
            "(or mark more split points)"
        )
    if sizes is None:
        return
    if len(sizes) != stages or any(size < 1 for size in sizes):
        raise PlanError(
            f"Plan.stages={list(sizes)} must give each of the {stages} stages (chunks) at "
            f"least one layer; e.g. stages={list(_even(layers, stages))}"
        )
    if sum(sizes) != layers:
        raise PlanError(
            f"Plan.stages={list(sizes)} covers {sum(sizes)} layers but the model has {layers}; "
            f"use stages that sum to {layers}, e.g. stages={list(_even(layers, stages))}"
        )


def _even(layers: int, stages: int) -> tuple[int, ...]:
    """The most even split by layer count, for suggestions in error messages."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if k < extra else 0) for k in range(stages))
