"""The operator-split rule, checked without processes: pairs, heads, overrides, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.tensor import plan_splits

from reference import build


def _splits(model: nn.Module, tp: int, tp_plan: dict[str, str] | None = None) -> dict[str, str]:
    return {d.name: d.split for d in plan_splits(model, tp, tp_plan)}


def test_mlp_splits_in_column_row_pairs() -> None:
    assert _splits(ms.models.mlp(), 4) == {
        "fc1": "column",
        "fc2": "row",
        "fc3": "column",
        "fc4": "row",
    }


def test_cnn_pairs_convolutions_then_linears() -> None:
    decisions = plan_splits(ms.models.cnn(), 2)
    assert {d.name: d.split for d in decisions} == {
        "conv1": "column",
        "conv2": "row",
        "fc1": "column",
        "fc2": "row",
    }
    assert not any(d.gather_output or d.scatter_input for d in decisions)


def test_transformer_splits_heads_pairs_vocab_and_replicates_the_rest() -> None:
    decisions = {d.name: d for d in plan_splits(build("transformer"), 2)}
    assert decisions["block1.attn"].split == "heads"
    assert decisions["block1.mlp.fc1"].split == "column"
    assert decisions["block1.mlp.fc2"].split == "row"
    assert decisions["embed.tokens"].split == "vocab"
    assert decisions["embed.positions"].split == "replicate"  # under 1% of the parameters
    assert decisions["ln_f"].split == "replicate"
    assert decisions["head"].split == "column" and decisions["head"].gather_output
    assert "block1.attn.q" not in decisions  # attention is one unit


def test_a_norm_between_two_linears_breaks_the_pair() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    decisions = {d.name: d for d in plan_splits(model, 2)}
    assert decisions["0"].split == decisions["2"].split == "column"
    assert decisions["0"].gather_output and decisions["2"].gather_output
    assert decisions["1"].split == "replicate"


@pytest.mark.parametrize(
    ("model", "tp", "words"),
    [
        ("mlp", 3, ["Plan.tp=3", "Linear 'fc1'", "out_features=1024", "{1, 2, 4, 8, 16, 32, ...}"]),
        ("cnn", 3, ["Conv2d 'conv1'", "out_channels=32"]),
        ("transformer", 8, ["'block0.attn'", "n_heads=4", "{1, 2, 4}"]),
    ],
)
def test_bad_tp_names_the_layer_its_size_and_what_works(
    model: str, tp: int, words: list[str]
) -> None:
    with pytest.raises(ms.PlanError) as error:
        plan_splits(build(model), tp)
    for word in words:
        assert word in str(error.value)


def test_user_plan_overrides_the_rule() -> None:
    splits = _splits(ms.models.mlp(), 2, {"fc1": "replicate"})
    assert splits == {"fc1": "replicate", "fc2": "column", "fc3": "row", "fc4": "replicate"}
    decisions = {d.name: d for d in plan_splits(ms.models.mlp(), 2, {"fc2": "row"})}
    assert decisions["fc1"].split == "column" and not decisions["fc1"].gather_output
    assert decisions["fc2"].reason == "user plan"


@pytest.mark.parametrize(
    ("tp_plan", "words"),
    [
        ({"fc9": "column"}, ["'fc9'", "fc1, fc2, fc3, fc4"]),
        ({"fc1": "heads"}, ["'fc1'", "column, row, replicate"]),
        ({"fc4": "column"}, ["Plan.tp=4", "'fc4'", "out_features=10"]),
    ],
)
def test_bad_user_plan_is_refused(tp_plan: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ms.PlanError) as error:
        plan_splits(ms.models.mlp(), 4, tp_plan)
    for word in words:
        assert word in str(error.value)


def test_a_lone_layer_tp_cannot_divide_is_replicated_and_nothing_split_is_refused() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 10))
    assert _splits(model, 4) == {"0": "column", "1": "replicate", "2": "replicate"}
    with pytest.raises(ms.PlanError, match="splits no layer"):
        plan_splits(nn.Sequential(nn.Linear(8, 10)), 4)


class PairWithoutGrad(nn.Module):
    """A pair the forward runs under no_grad (Hugging Face's HRM runs its early cycles so, to
    bound their memory), then a head that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


def test_a_pair_the_forward_runs_without_grad_is_still_split() -> None:
    decisions = plan_splits(PairWithoutGrad(), 2, example=torch.randn(4, 16))
    assert {d.name: d.split for d in decisions if d.name != "head"} == {
        "up": "column",
        "down": "row",
    }


def test_a_layer_kept_whole_says_what_it_is_and_why() -> None:
    """describe() names the layer's class and why it stays whole, not a generic 'norm'."""
    model = nn.Sequential(
        nn.LSTM(8, 8, batch_first=True),
        nn.MultiheadAttention(8, 2, batch_first=True),
        nn.LayerNorm(8),
        nn.ConvTranspose2d(4, 4, 2),
    )
    decided = {d.name: d for d in plan_splits(model, 2)}
    reasons = {name: d.reason for name, d in decided.items()}
    assert reasons["0"] == "LSTM has no operator split: kept whole on every tp rank"
    assert decided["1"].split == "heads"  # torch's attention splits by heads
    assert reasons["2"] == "norm kept whole (one weight per feature)"
    assert decided["3"].split == "column"  # a lone transposed convolution, gathered


class _DoubledTranspose(nn.ConvTranspose2d):
    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return super().forward(x, output_size) * 2


def test_transposed_convolutions_pair_and_one_with_its_own_forward_stays_whole() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 2, stride=2),
        _DoubledTranspose(8, 4, 2, stride=2),
    )
    decided = {d.name: d for d in plan_splits(model, 2)}
    assert decided["0"].split == "column" and decided["2"].split == "row"
    assert decided["3"].reason == "own forward: _DoubledTranspose kept whole"
