"""Interleaved 1F1B and zero bubble (ZB-H1) equal single-process training.

The reference transformer and a Hugging Face GPT-2 (tied embeddings) train 3 SGD steps under
pp2, pp4, dp2 x pp2 (ZeRO 2 too), pp2 x tp2 and recompute, and must match one process on the
same global batch. Cases share one `ms.launch` per process count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshsplit as ms

from reference import assert_each_case, train_gpt2, train_parallel, train_single

RTOL, ATOL = 1e-4, 1e-5
INTERLEAVED = {"schedule": "interleaved", "virtual_stages": 2}
ZERO_BUBBLE = {"schedule": "zero-bubble"}

TWO: list[dict[str, Any]] = [
    {"pp": 2, "micro_batches": 4, **INTERLEAVED},
    {"pp": 2, "micro_batches": 4, **INTERLEAVED, "recompute": "except_last"},
    {"pp": 2, "micro_batches": 4, **ZERO_BUBBLE},
    {"pp": 2, "micro_batches": 4, **ZERO_BUBBLE, "recompute": "except_last"},
    # the last stage recomputed too: W reads a checkpointed graph B has already replayed
    {"pp": 2, "micro_batches": 4, **ZERO_BUBBLE, "recompute": "always"},
]
FOUR: list[dict[str, Any]] = [
    {"pp": 4, "micro_batches": 4, **ZERO_BUBBLE},
    {"pp": 4, "micro_batches": 4, **ZERO_BUBBLE, "recompute": "except_last"},
    {"dp": 2, "pp": 2, "micro_batches": 2, **INTERLEAVED},
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZERO_BUBBLE},
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZERO_BUBBLE, "zero": 2},
    {"dp": 2, "pp": 2, "micro_batches": 2, **ZERO_BUBBLE, "zero": 3},
    {"dp": 2, "pp": 2, "micro_batches": 2, **INTERLEAVED, "zero": 2},
    {"pp": 2, "tp": 2, "micro_batches": 4, **INTERLEAVED, "recompute": "except_last"},
    {"pp": 2, "tp": 2, "micro_batches": 4, **ZERO_BUBBLE},
]
GPT2: list[dict[str, Any]] = [
    {"pp": 2, "micro_batches": 2, **INTERLEAVED},
    {"pp": 2, "micro_batches": 2, **ZERO_BUBBLE, "recompute": "except_last"},
]


def _details() -> dict[str, Any]:
    """describe() of an interleaved engine, the post-accumulate hooks one zero-bubble step
    fires per parameter, and a model with too few cut points refused."""
    x, y = ms.data.synthetic_images(16, seed=5)
    plan = ms.Plan(pp=2, micro_batches=4, **INTERLEAVED)
    engine = ms.parallelize(ms.models.mlp((784, 32, 32, 16, 10)), plan, example_inputs=x)
    details: dict[str, Any] = {"describe": engine.describe()}
    engine.close()
    engine = ms.parallelize(
        ms.models.mlp((784, 32, 16, 10)), ms.Plan(pp=2, micro_batches=4, **ZERO_BUBBLE)
    )
    engine.train_step(x, y)  # the first step builds the split
    fired: dict[str, int] = {}
    for name, param in engine.runner.module.named_parameters():

        def count(_: torch.Tensor, name: str = name) -> None:
            fired[name] = fired.get(name, 0) + 1

        param.register_post_accumulate_grad_hook(count)
    engine.train_step(x, y)
    details["fired"] = fired
    details["passes"] = engine.runner.backward_passes()
    details["zero_bubble"] = engine.describe()
    engine.close()
    details["runs"] = _recomputed_runs(x, y)
    try:
        ms.parallelize(
            ms.models.mlp((784, 16, 10)), ms.Plan(pp=2, micro_batches=2, **INTERLEAVED),
            example_inputs=x,
        )  # fmt: skip
    except ms.PlanError as error:
        details["refused"] = str(error)
    return details


def _recomputed_runs(x: torch.Tensor, y: torch.Tensor) -> int:
    """How often this rank's first Linear runs in a zero-bubble step of 4 micro-batches under
    recompute (the second stage holds several Linears, each its own group of W)."""
    model = ms.models.mlp((784, 32, 32, 32, 32, 16, 10))
    plan = ms.Plan(pp=2, micro_batches=4, recompute="always", **ZERO_BUBBLE)
    engine = ms.parallelize(model, plan, example_inputs=x)
    engine.train_step(x, y)
    first = next(m for m in engine.runner.module.modules() if isinstance(m, torch.nn.Linear))
    runs = [0]
    first.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    engine.train_step(x, y)
    engine.close()
    return runs[0]


def _two_process_worker() -> dict[str, Any]:
    return {
        "transformer": [train_parallel("transformer", "sgd", ms.Plan(**o)) for o in TWO],
        "gpt2": [train_gpt2(ms.Plan(**o)) for o in GPT2],
        **_details(),
    }


def _four_process_worker() -> list[Any]:
    return [train_parallel("transformer", "sgd", ms.Plan(**options)) for options in FOUR]


def test_two_stages_match_single_process_and_describe_chunks() -> None:
    pytest.importorskip("transformers")
    per_rank = ms.launch(_two_process_worker, 2)
    expected = train_single("transformer", "sgd")
    assert_each_case([r["transformer"] for r in per_rank], TWO, expected, rtol=RTOL, atol=ATOL)
    assert_each_case([r["gpt2"] for r in per_rank], GPT2, train_gpt2(None), rtol=RTOL, atol=ATOL)
    first = per_rank[0]
    described = first["describe"]
    assert described["chunks"] == {0: [0, 2], 1: [1, 3]}
    assert [s["stage"] for s in described["stages"]] == [0, 1, 0, 1]
    assert sum(len(s["layers"]) for s in described["stages"]) == 8
    assert described["schedule"].startswith("stage 0 | F0:0 F1:0 F0:2 F1:2")
    assert described["bubble_fraction"] == pytest.approx(1 / 9)
    # zero bubble: W, not B, accumulates, once per micro-batch and parameter
    for rank in per_rank:
        assert set(rank["fired"].values()) == {rank["passes"]} == {4}
    assert " W0" in first["zero_bubble"]["schedule"]
    # recompute once in B and once in W, not once per W group (the second stage's 3 groups
    # ran it 5 times a micro-batch); the first stage has no B to send back: its W runs it
    assert [rank["runs"] for rank in per_rank] == [4 * 2, 4 * 3]
    assert first["zero_bubble"]["bubble_fraction"] == pytest.approx(1 / 13)
    for rank in per_rank:
        assert rank["refused"].startswith(
            "Plan.pp=2 x virtual_stages=2 = 4 chunks exceeds the 2 layers with parameters"
        )


def test_four_processes_match_single_process() -> None:
    results = ms.launch(_four_process_worker, 4)
    assert_each_case(results, FOUR, train_single("transformer", "sgd"), rtol=RTOL, atol=ATOL)
