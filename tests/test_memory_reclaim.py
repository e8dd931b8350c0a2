"""Reclaim: a closed engine gives back what it took, and a long run does not grow.

One launch of 2 workers (dp=2: gradient buckets, an all-reduce every step) measures both:
resident memory after each of 11 engines is built, trained and closed, and resident memory
every 1,000 steps of a 10,000-step run with the default settings (the tracker on).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit.memory.report import resident_bytes

pytestmark = pytest.mark.timeout(600)

ENGINES = 10
STEPS = 10_000
WARM_UP = 1_000


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _engines() -> tuple[list[int], str]:
    """Resident bytes after each build-train-close (the first is warm-up), and what a closed
    engine says when asked to train."""
    after = []
    x, y = ms.data.synthetic_images(16)
    for _ in range(ENGINES + 1):
        engine = ms.parallelize(ms.models.mlp(), ms.Plan(dp=2), optimizer=_adam)
        for _ in range(3):
            engine.train_step(x, y)
        engine.close()
        try:
            engine.train_step(x, y)
        except RuntimeError as error:
            refusal = str(error)
        del engine
        gc.collect()
        after.append(resident_bytes())
    return after, refusal


def _long_run() -> dict[int, int]:
    """Resident bytes every WARM_UP steps of a small model's 10,000 steps."""
    torch.manual_seed(0)
    engine = ms.parallelize(ms.models.mlp((64, 32, 10)), ms.Plan(dp=2), optimizer=_adam)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    marks = {}
    for step in range(1, STEPS + 1):
        engine.train_step(x, y)
        if step % WARM_UP == 0:
            marks[step] = resident_bytes()
    engine.close()
    return marks


def _job() -> dict[str, Any]:
    after, refusal = _engines()
    return {"engines": after, "refusal": refusal, "long": _long_run()}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return ms.launch(_job, 2, timeout_s=500)


def test_ten_engines_built_and_closed_grow_resident_memory_by_under_5_percent(
    per_rank: list[dict[str, Any]],
) -> None:
    for rank in per_rank:
        first, *rest = rank["engines"]
        assert max(rest) < 1.05 * first, [round(b / 2**20, 1) for b in rank["engines"]]
        assert "engine is closed" in rank["refusal"] and "ms.parallelize" in rank["refusal"]


def test_a_10000_step_run_keeps_resident_memory_flat_after_warm_up(
    per_rank: list[dict[str, Any]],
) -> None:
    for rank in per_rank:
        marks = rank["long"]
        warm = marks[WARM_UP]
        assert max(marks.values()) < 1.01 * warm, {k: round(v / 2**20, 2) for k, v in marks.items()}
