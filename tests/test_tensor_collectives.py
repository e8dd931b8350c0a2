"""Collectives per step match the design, counted by wrapping torch.distributed in the workers.

Design (tp > 1, per step): forward has one all-reduce per column/row pair, per attention block
and per vocab-split embedding, and one all-gather per column layer whose output is gathered.
Backward has one all-reduce per column layer or attention block whose input needs a gradient
(the first layer's input is data, so it has none), and nothing else: the row layers' and the
embedding's backward are identities, a gather's backward is a slice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

import meshsplit as ms
from meshsplit.gather import ALL_GATHER

from reference import batches, build, loss_for

COUNTED = ("all_reduce", ALL_GATHER, "broadcast")


@contextmanager
def _counting(group: dist.ProcessGroup) -> Iterator[Counter[str]]:
    """Count calls of the collectives in COUNTED that run on `group`."""
    ranks = dist.get_process_group_ranks(group)
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            used = kwargs.get("group")
            if used is not None and dist.get_process_group_ranks(used) == ranks:
                counts[name] += 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _count(model_name: str) -> tuple[dict[str, int], dict[str, int]]:
    """Collectives on the tp group in one forward (predict) and in one training step, with the
    defaults on: the non-finite check rides on the step's one agreement."""
    plan = ms.Plan(tp=2)
    engine = ms.parallelize(build(model_name), plan, loss_fn=loss_for(model_name))
    x, y = batches(model_name, 8, 1)[0]
    engine.train_step(x, y)  # warm up: build everything first
    group = engine.mesh.group("tp")
    with _counting(group) as forward:
        engine.predict(x)
    with _counting(group) as step:
        engine.train_step(x, y)
    engine.close()
    return dict(forward), dict(step)


def _count_all() -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    return {name: _count(name) for name in ("mlp", "cnn", "transformer")}


AGREE = 1
"""The step's one agreement over the mesh (its loss, the non-finite flag, the batch check),
which at tp=2 is the tp group."""
# model -> (forward, whole step); n_layers = 2 transformer blocks
EXPECTED = {
    # fc1|fc2 and fc3|fc4 pairs: 2 forward all-reduces; backward: fc3's input copy only.
    "mlp": ({"all_reduce": 2}, {"all_reduce": 3 + AGREE}),
    # conv1|conv2 and fc1|fc2 pairs: 2 forward; backward: fc1's input copy only.
    "cnn": ({"all_reduce": 2}, {"all_reduce": 3 + AGREE}),
    # forward: embedding 1 + per block (attention 1 + mlp pair 1), head gathers its logits;
    # backward: per block (attention copy 1 + mlp copy 1) + head copy 1.
    "transformer": (
        {"all_reduce": 1 + 2 * 2, ALL_GATHER: 1},
        {"all_reduce": (1 + 2 * 2) + (2 * 2 + 1) + AGREE, ALL_GATHER: 1},
    ),
}


@pytest.fixture(scope="module")
def counted() -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    first, second = ms.launch(_count_all, 2)
    assert first == second
    return first


@pytest.mark.parametrize("model", list(EXPECTED))
def test_collectives_per_step_match_the_design(counted: dict, model: str) -> None:
    assert counted[model] == EXPECTED[model]
