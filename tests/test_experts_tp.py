"""The operator split of experts modules (tensor/experts.py) equals one process, and each tp
rank holds 1/tp of every expert.

Every mixture-of-experts family of the suite (fused 3-D experts: gate|up in halves, GPT-OSS's
adjacent pairs with biases, Llama 4's transposed weights) trains 3 SGD steps under tp2 against
plain PyTorch on the global batch; a few also under tp4, with ep, with pp and with ZeRO 3; a
checkpoint saved under tp2 resumes under dp2. A module whose split answers do not add up to
its own stays whole, saying why.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms
from meshsplit.tensor import plan_splits
from meshsplit.tensor.dataflow import as_it_is
from meshsplit.tensor.experts import prove, split_experts_module

transformers = pytest.importorskip("transformers")

from test_experts import (  # noqa: E402
    ATOL,
    BUILDERS,
    RTOL,
    Case,
    FusedExperts,
    _batches,
    _build,
    _expert_bytes,
    _single,
    assert_exact,
    train_cases,
)

from hf_models import MOE  # noqa: E402
from reference import OPTIMIZERS  # noqa: E402

FUSED = [name for name in BUILDERS if name != "own_listed"] + list(MOE)
"""Every model whose experts are fused 3-D weights (own_listed's are Linear layers, which
the operator split takes as column/row pairs anyway)."""


def _check(cases: list[Case], per_rank: list[list[dict[str, Any]]]) -> None:
    for index, (model, fields) in enumerate(cases):
        want = _single(model)
        whole = _expert_bytes(_build(model))
        share = whole / fields.get("tp", 1) / fields.get("ep", 1) / fields.get("pp", 1)
        for rank, results in enumerate(per_rank):
            got = results[index]
            where = f"{model} {ms.Plan(**fields).describe()} rank {rank}"
            assert_exact(got, want, where)
            assert got["split_over_tp"], f"{where}: no experts module split over tp"
            assert got["expert_bytes"] <= 1.1 * share, f"{where}: {got['expert_bytes']} > {share}"


@pytest.mark.timeout(600)
def test_tp2_splits_every_familys_experts_and_matches_one_process() -> None:
    cases: list[Case] = [(model, {"tp": 2}) for model in FUSED]
    _check(cases, ms.launch(train_cases, 2, args=(cases,), timeout_s=400, backend="gloo"))


@pytest.mark.timeout(600)
def test_the_experts_split_composes_with_tp4_ep_pp_and_zero3() -> None:
    plans = [
        {"tp": 4},
        {"dp": 2, "ep": 2, "tp": 2},
        {"pp": 2, "tp": 2, "micro_batches": 2},
        {"dp": 2, "tp": 2, "zero": 3},
    ]
    cases: list[Case] = [(m, p) for p in plans for m in ("mixtral", "gpt_oss", "llama4")]
    _check(cases, ms.launch(train_cases, 4, args=(cases,), timeout_s=500, backend="gloo"))


def _resumed(
    directory: str, model: str, saved: dict[str, int], loads: list[dict[str, int]]
) -> list[dict[str, Any]]:
    """Two steps under `saved`, saved (momentum included); the third after loading under
    each of `loads`."""
    batches = _batches()

    def engine(fields: dict[str, int]) -> ms.Engine:
        return ms.parallelize(
            _build(model), ms.Plan(**fields), optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip

    first = engine(saved)
    for x, y in batches[:2]:
        first.train_step(x, y)
    first.save(directory)
    first.close()
    results = []
    for fields in loads:
        resumed = engine(fields)
        resumed.load(directory)
        loss = resumed.train_step(*batches[2])
        results.append({"loss": loss, "state": resumed.full_state_dict()})
        resumed.close()
    return results


@pytest.mark.parametrize(
    ("model", "saved", "loads"),
    [
        # experts fused gate|up, saved part by part under tp; read back whole under dp, as
        # their parts under tp, and each rank its own experts under ep
        ("mixtral", {"tp": 2}, [{"dp": 2}, {"tp": 2}, {"dp": 2, "ep": 2}]),
        ("gpt_oss", {"tp": 2}, [{"dp": 2}, {"tp": 2}]),
        # experts over ep and each expert's width over tp: saved whole over tp, sharded over
        # ep; read back under ep x tp with ZeRO 2 and under plain dp
        (
            "mixtral",
            {"dp": 2, "ep": 2, "tp": 2},
            [{"dp": 2, "ep": 2, "tp": 2, "zero": 2}, {"dp": 4}],
        ),
        # ZeRO 1 over the ranks holding the same experts: each rank saves the state it owns,
        # its ep peers own the same names (the same dealing of the same shapes)
        (
            "mixtral",
            {"dp": 4, "ep": 2, "zero": 1},
            [{"dp": 4, "ep": 2, "zero": 1}, {"dp": 4, "ep": 4, "zero": 1}, {"dp": 4}],
        ),
    ],
    ids=["mixtral-tp2", "gpt_oss-tp2", "mixtral-ep2-tp2", "mixtral-dp4-ep2-zero1"],
)
def test_a_checkpoint_of_split_experts_resumes_under_another_plan(
    tmp_path: Any, model: str, saved: dict[str, int], loads: list[dict[str, int]]
) -> None:
    want_losses, want_state = _single(model)
    workers = ms.Plan(**saved).world_size
    for per_plan in ms.launch(
        _resumed, workers, args=(str(tmp_path), model, saved, loads), timeout_s=300,
        backend="gloo",
    ):  # fmt: skip
        for got in per_plan:
            assert got["loss"] == pytest.approx(want_losses[2], rel=RTOL)
            for key, value in want_state.items():
                torch.testing.assert_close(got["state"][key], value, rtol=RTOL, atol=ATOL)


class SquaredExperts(nn.Module):
    """Fused experts whose answer is squared after the projection out: not a sum over the
    inner width, so no split of it adds up."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 32, 16) * 0.2)
        self.down = nn.Parameter(torch.randn(4, 16, 32) * 0.2)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(4):
            token, slot = torch.where(top_k_index == expert)
            h = (torch.relu(hidden_states[token] @ self.up[expert].T) @ self.down[expert].T) ** 2
            out = out.index_add(0, token, h * top_k_weights[token, slot, None])
        return out


def test_layouts_are_proved_on_the_example_and_a_module_that_does_not_add_up_stays_whole() -> None:
    x, _ = _batches()[0]
    decided = {d.name: d for d in plan_splits(_build("gpt_oss"), 2, example=x)}
    experts = decided["m.model.layers.0.mlp.experts"]
    assert experts.split == "experts"
    # GPT-OSS interleaves gate and up: its fused weight splits in blocks of adjacent pairs,
    # its bias after the projection out stays whole and counts on rank 0, summed over tp
    assert dict(experts.layouts)["gate_up_proj"] == (2, 1)
    assert dict(experts.layouts)["down_proj_bias"] is None
    assert experts.summed == ("m.model.layers.0.mlp.experts.down_proj_bias",)
    mixtral = {d.name: d for d in plan_splits(_build("mixtral"), 2, example=x)}
    assert dict(mixtral["m.model.layers.0.mlp.experts"].layouts)["gate_up_proj"] == (1, 2)

    model = _build("own")
    for block in model.blocks:
        block.experts = SquaredExperts()
    kept = {d.name: d for d in plan_splits(model, 2, example=x)}["blocks.0.experts"]
    assert kept.split == "replicate"
    assert "no split of its inner width adds up" in kept.reason
    without_example = {d.name: d for d in plan_splits(_build("mixtral"), 2)}
    assert without_example["m.model.layers.0.mlp.experts"].split == "replicate"


def _built_in_parts(cases: list[Case]) -> list[dict[str, Any]]:
    """Each model from its factory, each rank building only its part."""
    results = []
    for model, fields in cases:
        torch.manual_seed(0)
        engine = ms.parallelize(
            BUILDERS[model], ms.Plan(**fields), optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
        engine.prepare(_batches()[0][0])
        results.append(
            {"state": engine.full_state_dict(), "expert_bytes": _expert_bytes(engine.module)}
        )
        engine.close()
    return results


def test_a_model_each_rank_builds_in_parts_splits_its_experts_under_ep_and_tp() -> None:
    """A factory's experts are cut while the split holds them, then kept real: the values are
    factory()'s bit for bit and each rank holds half (the expert split used to cut the meta
    tensors, which could then not be built)."""
    cases: list[Case] = [
        (m, p) for m in ("mixtral", "gpt_oss") for p in ({"dp": 2, "ep": 2}, {"tp": 2})
    ]
    per_rank = ms.launch(_built_in_parts, 2, args=(cases,), timeout_s=300, backend="gloo")
    for index, (model, fields) in enumerate(cases):
        torch.manual_seed(0)
        whole = BUILDERS[model]()
        for rank, results in enumerate(per_rank):
            got = results[index]
            for key, value in whole.state_dict().items():
                assert torch.equal(got["state"][key], value), (model, fields, rank, key)
            assert got["expert_bytes"] <= 0.55 * _expert_bytes(whole), (model, fields, rank)


def _one_module_split() -> dict[str, Any]:
    """A FusedExperts module split over tp2 against itself whole: answers, the gradients of
    its tokens and routing weights, and the all-reduces one forward and backward ran."""
    torch.manual_seed(0)
    whole = FusedExperts(4, 16, 32)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(10, 16, generator=g)
    weights, index = torch.softmax(torch.randn(10, 4, generator=g), -1).topk(2, dim=-1)
    layouts = prove(whole, ((tokens, index, weights), {}), 2, as_it_is)
    assert not isinstance(layouts, str), layouts
    split = split_experts_module(copy.deepcopy(whole), layouts.layouts, dist.group.WORLD)
    upstream = torch.randn(10, 16, generator=g)
    calls = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    results = {}
    for name, module in (("whole", whole), ("split", split)):
        x, w = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
        calls[0] = 0
        with mock.patch.object(dist, "all_reduce", counted):
            out = module(x, index, w)
            (out * upstream).sum().backward()
        results[name] = {"out": out.detach(), "x": x.grad, "w": w.grad, "calls": calls[0]}
    return results


def test_a_split_experts_module_sums_over_tp_with_one_all_reduce_each_way() -> None:
    for got in ms.launch(_one_module_split, 2, timeout_s=60, backend="gloo"):
        whole, split = got["whole"], got["split"]
        for key in ("out", "x", "w"):
            torch.testing.assert_close(split[key], whole[key], rtol=1e-5, atol=1e-5)
        assert (whole["calls"], split["calls"]) == (0, 2)
