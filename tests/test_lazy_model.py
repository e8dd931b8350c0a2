"""A model each rank builds only its part of: a factory (or a meta model) to parallelize.

The values must be those of `factory()` in one process, bit for bit, under every split, and
each rank must hold only its part — while building as well as after.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.memory import lazy_model, pools
from meshsplit.memory.report import peak_bytes, reset_peak, resident_bytes, tensor_bytes

from hf_models import FACTORIES

pytestmark = pytest.mark.timeout(600)

MODELS = {**FACTORIES, "transformer": functools.partial(ms.models.transformer, n_layers=2)}


def _tokens(rows: int = 8, length: int = 8, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    return x, x.roll(-1, 1)


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _tokens()
    return (x, torch.arange(len(x)) % 3) if name == "bert" else (x, y)


def _loss(name: str) -> torch.nn.Module:
    return torch.nn.CrossEntropyLoss() if name == "bert" else ms.models.TokenCrossEntropy()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _build_parts(cases: list[tuple[str, ms.Plan]]) -> list[dict[str, Any]]:
    """Runs in every worker: parallelize each factory; what this rank holds, the whole state."""
    results = []
    for name, plan in cases:
        torch.manual_seed(0)
        engine = ms.parallelize(MODELS[name], plan, optimizer=_sgd, loss_fn=_loss(name))
        engine.prepare(_batch(name)[0])
        local = engine.runner.local_state_dict()
        results.append(
            {
                "meta": [n for n, t in local.items() if t.is_meta],
                "held": tensor_bytes(engine.runner.parameters()),
                "state": engine.full_state_dict(),
                "loss": engine.train_step(*_batch(name)),
            }
        )
        engine.close()
    return results


CASES = {
    2: [("gpt2", ms.Plan(dp=2)), ("gpt2", ms.Plan(pp=2, micro_batches=2)),
        ("llama", ms.Plan(tp=2)), ("bert", ms.Plan(pp=2, micro_batches=2)),
        ("transformer", ms.Plan(tp=2)), ("transformer", ms.Plan(pp=2, micro_batches=2))],
    4: [("gpt2", ms.Plan(pp=2, tp=2, micro_batches=2)), ("llama", ms.Plan(pp=4, micro_batches=4))],
}  # fmt: skip


@pytest.mark.parametrize("workers", sorted(CASES))
def test_a_factory_gives_the_one_process_values_and_each_rank_only_its_part(workers: int) -> None:
    per_rank = ms.launch(_build_parts, workers, args=(CASES[workers],), timeout_s=600)
    for index, (name, plan) in enumerate(CASES[workers]):
        torch.manual_seed(0)
        model = MODELS[name]()
        expected = model.state_dict()
        whole = tensor_bytes(model.parameters())
        for rank, results in enumerate(per_rank):
            result = results[index]
            assert result["meta"] == [], f"{name} {plan.describe()} rank {rank}"
            state = result["state"]
            assert state.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(state[key], value), f"{name} {plan.describe()}: {key}"
            if plan.pp * plan.tp > 1:
                assert result["held"] < 0.8 * whole, f"{name} {plan.describe()} rank {rank}"
        x, y = _batch(name)
        first_loss = float(
            _loss(name)(model(x), y).detach()
        )  # the first step's loss: the initial model's
        assert per_rank[0][index]["loss"] == pytest.approx(first_loss, rel=1e-5)


def _meta_model() -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ms.models.mlp((784, 64, 10))
    engine = ms.parallelize(model, ms.Plan(dp=2), optimizer=_sgd)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    losses = [engine.train_step(x, y) for _ in range(2)]
    state = engine.full_state_dict()
    return {"losses": losses, "state": state, "meta": [k for k, v in state.items() if v.is_meta]}


def test_a_meta_module_has_the_same_values_each_time_it_is_realized() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = lazy_model.build(model)
    stream = torch.get_rng_state()
    drawn = []
    for layer in (0, 0, 1):
        with lazy_model.realize(model[layer]):
            drawn.append(model[layer].weight.clone())
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])
    assert model[0].weight.is_meta
    assert torch.equal(torch.get_rng_state(), stream)  # the caller's stream left as it was


def test_a_meta_module_lends_real_copies_to_a_forward_that_records_a_graph() -> None:
    with torch.device("meta"):
        layer = nn.Linear(4, 2)
    layer = lazy_model.build(layer)
    meta = layer.weight
    with lazy_model.realize(layer, lend_copies=True):
        lent = layer.weight
        out = layer(torch.ones(3, 4))
    assert not lent.is_meta and not out.is_meta  # were meta: the copies came from the old
    assert layer.weight is meta  # the meta parameter is back; the graph keeps the copy
    out.sum().backward()
    assert lent.grad is not None and lent.grad.shape == (2, 4)


def test_a_meta_model_is_built_by_reset_parameters_alike_on_every_rank() -> None:
    first, second = ms.launch(_meta_model, 2, timeout_s=300)
    assert first["meta"] == [] and first["losses"] == second["losses"]
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
    assert all(torch.isfinite(torch.tensor(first["losses"])))


BIG = functools.partial(
    ms.models.transformer, vocab_size=256, d_model=512, n_heads=8, n_layers=8, seq_len=32
)
"""About 25M parameters: 101 MB of weights, 405 MB of training state with Adam."""


def _train_big(plan: ms.Plan, lazy: bool) -> dict[str, Any]:
    """Runs in every worker: build BIG from its factory (lazy) or whole, then two steps."""
    torch.manual_seed(0)
    before = resident_bytes()
    reset_peak(torch.device("cpu"))
    x, y = _tokens(rows=8, length=32, vocab=256)
    # what is measured is the split: the optimizer state the build makes after it (twice a
    # stage's weights, more than the whole model held in passing) is left to the first step
    with mock.patch.object(pools, "preallocate_optimizer_state", return_value="not measured"):
        engine = ms.parallelize(
            BIG if lazy else BIG(), plan, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4),
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
        engine.prepare(x)
    built = peak_bytes(torch.device("cpu")) - before
    losses = [engine.train_step(x, y) for _ in range(2)]
    return {
        "built": built,
        "tensor_peak": engine.memory_report().tensor_peak_bytes,
        "losses": losses,
    }


def test_a_model_three_times_a_ranks_budget_trains_under_pp4_and_tp4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # glibc keeps freed blocks of a few MB for reuse, so a process's resident peak would count
    # every module lent while splitting; served by mmap, a freed block leaves at once
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    torch.manual_seed(0)
    weights = tensor_bytes(BIG().parameters())
    budget = 4 * weights // 3  # parameters, gradients and two Adam moments: 3x the budget
    for plan in (  # two of the eight blocks per stage (the balancer weighs time, not bytes)
        ms.Plan(pp=4, micro_batches=4, stages=(3, 2, 2, 4), memory_budget=budget),
        ms.Plan(tp=4, micro_batches=2, memory_budget=budget),
    ):
        # spawn: glibc reads MALLOC_MMAP_THRESHOLD_ when a process starts, and a forkserver's
        # children share the malloc settings of the server, started before it was set
        lazy = ms.launch(_train_big, 4, args=(plan, True), timeout_s=600, start_method="spawn")
        whole = ms.launch(_train_big, 4, args=(plan, False), timeout_s=600, start_method="spawn")
        for rank, (part, built_whole) in enumerate(zip(lazy, whole, strict=True)):
            assert part["tensor_peak"] <= budget, (plan.describe(), rank, part)
            assert part["losses"] == pytest.approx(built_whole["losses"], rel=1e-5)
            # building from the factory never held the whole model; building it whole did.
            # Both pay the process's first-use costs and the rank's gradient buckets; the
            # factory's build lends one module at a time (its replay holds a few of its size)
            saved = built_whole["built"] - part["built"]
            assert saved > 0.25 * weights, (plan.describe(), rank, part, built_whole)
