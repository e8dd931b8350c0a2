"""Hybrid dp x pp x tp plans on one mesh equal single-process training after 3 steps."""

from __future__ import annotations

import pytest

import meshsplit as ms

from reference import assert_matches, train_parallel, train_single

# Adam for the transformer; SGD for the CNN, whose channel-split convolution sums in another
# order, which Adam turns into visible updates on near-zero gradients (see reference.py).
FOUR_WORKERS = [
    ("transformer", "adamw", (2, 2, 1)),
    ("transformer", "adamw", (2, 1, 2)),
    ("transformer", "adamw", (1, 2, 2)),
    ("cnn", "sgd", (2, 2, 1)),
    ("cnn", "sgd", (1, 2, 2)),
]
EIGHT_WORKERS = [("transformer", "adamw", (2, 2, 2))]


def _plan(shape: tuple[int, int, int]) -> ms.Plan:
    dp, pp, tp = shape
    return ms.Plan(dp=dp, pp=pp, tp=tp, micro_batches=2 if pp > 1 else 1)


def _run(cases: list[tuple[str, str, tuple[int, int, int]]]) -> list:
    return [train_parallel(model, opt, _plan(shape)) for model, opt, shape in cases]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("workers", "cases"), [(4, FOUR_WORKERS), (8, EIGHT_WORKERS)], ids=["4-workers", "8-workers"]
)
def test_hybrid_plans_match_single_process(workers: int, cases: list) -> None:
    per_rank = ms.launch(_run, workers, args=(cases,))
    for index, (model, opt, _shape) in enumerate(cases):
        assert_matches([rank[index] for rank in per_rank], train_single(model, opt))


def _held_after_split() -> tuple[int, int]:
    model = ms.models.mlp()
    example = ms.data.synthetic_images(4)[0]
    engine = ms.parallelize(model, ms.Plan(pp=2), example_inputs=example)
    held = sum(p.numel() for p in model.parameters())
    runs = sum(p.numel() for p in engine.runner.parameters())
    engine.close()
    return held, runs


def test_each_stage_holds_only_its_own_weights() -> None:
    total = sum(p.numel() for p in ms.models.mlp().parameters())
    per_rank = ms.launch(_held_after_split, 2)
    assert all(held == runs for held, runs in per_rank)
    assert sum(runs for _, runs in per_rank) == total
