"""Layers the example never ran split as their twins that it did (tensor/twins.py).

A model with a list of expert modules, routed by the sign of two input features: an example
whose features are all negative reaches expert 0 only. The data flow pairs expert 0's layers;
its siblings of the same class and shapes take the same pair, and the split trains like one
process on batches that reach every expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import meshsplit as ms
from meshsplit.tensor import plan_splits

from reference import OPTIMIZERS, train_plainly

WIDTH, HIDDEN = 16, 32


class Expert(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, hidden), nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class ListedExperts(nn.Module):
    """Top-1 routing by the signs of features 0 and 1; `hidden` gives each expert's width."""

    def __init__(self, hidden: tuple[int, ...] = (HIDDEN,) * 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(width) for width in hidden)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        routed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(1)
            if rows.numel():
                routed = routed.index_add(0, rows, expert(x[rows]))
        return self.head(x + routed)


def _model(hidden: tuple[int, ...] = (HIDDEN,) * 4) -> ListedExperts:
    torch.manual_seed(0)
    return ListedExperts(hidden)


def _to_expert_zero(rows: int = 8) -> torch.Tensor:
    """Inputs that every row routes to expert 0."""
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(3))
    x[:, :2] = -x[:, :2].abs()
    return x


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, WIDTH, generator=g), torch.randint(0, 4, (16,), generator=g))] * 3


def _splits(model: nn.Module) -> dict[str, tuple[str, str]]:
    decisions = plan_splits(model, 2, example=_to_expert_zero())
    return {d.name: (d.split, d.reason) for d in decisions}


def test_experts_the_example_never_reached_pair_as_the_one_it_did() -> None:
    splits = _splits(_model())
    for index in range(4):
        assert splits[f"experts.{index}.fc1"][0] == "column", splits
        assert splits[f"experts.{index}.fc2"][0] == "row", splits
    assert "data flow" in splits["experts.0.fc2"][1]
    assert "'experts.0', its twin" in splits["experts.3.fc2"][1]


def test_a_sibling_of_other_shapes_is_not_a_twin() -> None:
    splits = _splits(_model((HIDDEN, HIDDEN, 2 * HIDDEN, HIDDEN)))
    assert splits["experts.1.fc2"][0] == "row"
    for layer in ("fc1", "fc2"):  # the lone-layer rule: not a pair
        assert splits[f"experts.2.{layer}"] == ("column", "no partner: output gathered")


def _train() -> dict[str, Any]:
    engine = ms.parallelize(
        _model(), ms.Plan(tp=2), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.CrossEntropyLoss(),
        example_inputs=_to_expert_zero(),
    )  # fmt: skip
    losses = [engine.train_step(x, y) for x, y in _batches()]
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters() if "experts" in n}
    result = {"losses": losses, "state": engine.full_state_dict(), "shapes": shapes}
    engine.close()
    return result


def test_tp2_trains_every_expert_split_like_one_process() -> None:
    x, _ = _batches()[0]
    routed = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    assert set(routed.tolist()) == {0, 1, 2, 3}, "the batch must reach every expert"
    model = _model()
    want_losses, want_state = train_plainly(
        model, OPTIMIZERS["sgd"](model.parameters()), nn.CrossEntropyLoss(), _batches()
    )
    for rank, got in enumerate(ms.launch(_train, 2, timeout_s=120, backend="gloo")):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses))
        for key, value in want_state.items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6)
        for index in range(4):
            assert got["shapes"][f"experts.{index}.fc1.weight"] == (HIDDEN // 2, WIDTH), rank
            assert got["shapes"][f"experts.{index}.fc2.weight"] == (WIDTH, HIDDEN // 2), rank
