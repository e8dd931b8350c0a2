"""Receives posted one action ahead: the next message lands while a stage computes.

On cores that the workers fill, a message whose receive is posted only when its stage is
ready to wait needs both ranks' transport threads to get a core first (milliseconds); posted
ahead, it arrives during the previous action. Checked here: after the first step (headers
heard), every remote receive of every schedule was posted ahead (the equivalence tests of
each schedule run with it: training stays equal to one process).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.pipeline.p2p import Exchange

SCHEDULES = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "zero-bubble"},
    {"schedule": "interleaved", "virtual_stages": 2},
    {"schedule": "zbv"},
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ms.models.mlp((16, 32, 32, 32, 32, 32, 32, 32, 8))


def _count_receives(options: dict[str, Any]) -> tuple[int, int]:
    """Runs in each worker: two steps of pp2 with 4 micro-batches; the second step's remote
    receives, and how many of them were taken from a receive posted ahead."""
    engine = ms.parallelize(
        _model(),
        ms.Plan(pp=2, micro_batches=4, **options),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    x, y = torch.randn(16, 16), torch.randint(0, 8, (16,))
    engine.train_step(x, y)
    exchange: Exchange = engine.runner.stage.exchange
    counts = {"asked": 0, "ahead": 0}
    take = exchange.receive_like

    def counting(messages: list[Any]) -> Any:
        remote = [m for m in messages if m[0] != exchange.rank and m[2]]
        counts["asked"] += len(remote)
        counts["ahead"] += sum(bool(exchange._posted.get((m[0], m[1]))) for m in remote)
        return take(messages)

    exchange.receive_like = counting  # type: ignore[method-assign]
    engine.train_step(x, y)
    engine.close()
    return counts["asked"], counts["ahead"]


@pytest.mark.parametrize("options", SCHEDULES, ids=lambda o: o["schedule"])
def test_every_receive_after_the_first_step_was_posted_ahead(options: dict[str, Any]) -> None:
    for asked, ahead in ms.launch(_count_receives, 2, args=(options,)):
        assert asked > 0
        # the first action of a step has nothing before it to post during
        assert ahead >= asked - 1
