"""A layer listed twice in a Sequential (weights shared, as ALBERT shares its blocks) is two
layers of the pipeline, both trained as one process trains them.

The shared layer's two uses land on two stages (a tied parameter, summed over them) or on
two chunks of one rank (interleaved: its gradient accumulates twice per micro-batch, which
the dp sync must wait for before its bucket's all-reduce starts). A model whose own forward
loops over some of its blocks (recurrent depth) is cut around the loop, never inside it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms
from meshsplit.data_parallel.allreduce import GradientSync

from reference import OPTIMIZERS, LoopsOverBlocks, assert_matches, train_plainly

CASES: list[dict[str, Any]] = [
    # chunks [0-2 | 3-5 | 6-8 | 9-10]: both uses of the shared layer on rank 0, chunks 0 and 2
    {"dp": 2, "pp": 2, "micro_batches": 2, "stages": [3, 3, 3, 2], "schedule": "interleaved",
     "virtual_stages": 2},
    # stages [0-5 | 6-10]: one use on each stage
    {"dp": 2, "pp": 2, "micro_batches": 2, "stages": [6, 5]},
    {"dp": 2, "pp": 2, "micro_batches": 2, "stages": [6, 5], "schedule": "zero-bubble"},
]  # fmt: skip


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), shared, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
        shared, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


def _worker() -> list[tuple[list[float], dict[str, torch.Tensor], list[list[str]]]]:
    results = []
    for case in CASES:
        engine = ms.parallelize(
            _model(), ms.Plan(**case), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss()
        )
        losses = [engine.train_step(x, y) for x, y in _batches()]
        layers = [chunk["layers"] for chunk in engine.describe()["stages"]]
        results.append((losses, engine.full_state_dict(), layers))
        engine.close()
    return results


def test_a_layer_listed_twice_is_two_layers_trained_as_one_process() -> None:
    model = _model()
    expected = train_plainly(model, OPTIMIZERS["sgd"](model.parameters()), nn.MSELoss(), _batches())
    per_rank = ms.launch(_worker, 4, timeout_s=300)
    for index, case in enumerate(CASES):
        assert_matches([rank[index][:2] for rank in per_rank], expected)
        layers = per_rank[0][index][2]
        assert [name for chunk in layers for name in chunk] == [str(i) for i in range(11)], case


def _accumulates(times: list[int]) -> None:
    """A bucket's sync over steps whose backward reaches one weight `times[k]` times."""
    weight = nn.Parameter(torch.ones(4))
    sync = GradientSync([weight], dist.group.WORLD, bucket_mb=1.0)
    for passes in times:
        sync.begin_step(1)
        for _ in range(passes):
            (weight * 2).sum().backward()
        sync.finish()
        assert torch.equal(weight.grad, torch.full((4,), 4.0 * passes))
        sync.zero_grad()


def test_the_dp_sync_waits_for_a_gradient_that_accumulates_twice_and_refuses_a_third() -> None:
    ms.launch(_accumulates, 2, args=([2, 2, 2],), timeout_s=60)
    with pytest.raises(ms.WorkerError, match="accumulated after its bucket's all-reduce"):
        ms.launch(_accumulates, 2, args=([2, 3],), timeout_s=60)


LOOP_CASES: list[dict[str, Any]] = [
    {"dp": 2, "pp": 2, "micro_batches": 2},
    {"pp": 4, "micro_batches": 4},
    {"dp": 2, "pp": 2, "micro_batches": 2, "schedule": "zero-bubble"},
]
"""A recurrent-depth model's loop stays on one stage: its cuts fall before the embedding's
successor, block 1, block 3 and the head only (pp4 takes three of the four)."""


def _looping() -> list[tuple[list[float], dict[str, torch.Tensor], list[list[str]]]]:
    results = []
    for case in LOOP_CASES:
        engine = ms.parallelize(
            _loop_model(), ms.Plan(**case), optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
        losses = [engine.train_step(x, y) for x, y in _token_batches()]
        layers = [chunk["layers"] for chunk in engine.describe()["stages"]]
        results.append((losses, engine.full_state_dict(), layers))
        engine.close()
    return results


def _loop_model() -> nn.Module:
    torch.manual_seed(0)
    return LoopsOverBlocks()


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 16, (8, 5), generator=g), torch.randint(0, 16, (8, 5), generator=g))
        for _ in range(3)
    ]


def test_a_loop_over_blocks_is_one_stages_and_trains_as_one_process() -> None:
    model = _loop_model()
    expected = train_plainly(
        model,
        OPTIMIZERS["sgd"](model.parameters()),
        ms.models.TokenCrossEntropy(),
        _token_batches(),
    )
    per_rank = ms.launch(_looping, 4, timeout_s=300, backend="gloo")
    for index, case in enumerate(LOOP_CASES):
        assert_matches([rank[index][:2] for rank in per_rank], expected, case=str(case))
        stages = per_rank[0][index][2]
        loop = next(stage for stage in stages if "blocks.1" in stage)
        assert "blocks.2" in loop, f"{case}: the loop was cut: {stages}"
        assert len(stages) == case["pp"] and all(stages), stages
