"""Convolutions pair through the data flow under tp, as Linear layers do: a stem called from a
forward of its own (Whisper's conv1 -> gelu -> conv2), a residual branch, a convolution into
a Linear through a flatten or a mean; a convolution that feeds a norm splits alone, its
output gathered. Every one of them holds half its weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshsplit as ms
from meshsplit.tensor.dataflow import normalised
from meshsplit.tensor.probe import Trace, quietly
from meshsplit.tensor.units import NORMS

from reference import assert_matches, train_plainly


class _Stem(nn.Module):
    """Two Conv1d called in forward, not an nn.Sequential, the second into a norm (Whisper's
    encoder: the norm makes the second no column, and it is still the first's row)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 32, 3, padding=1)
        self.conv2 = nn.Conv1d(32, 32, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return self.head(self.norm(x.transpose(1, 2)).mean(1))


class _Residual(nn.Module):
    """x + conv_b(silu(conv_a(x))): a UNet's block without a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv1d(4, 16, 1)
        self.conv_a = nn.Conv1d(16, 32, 3, padding=1)
        self.conv_b = nn.Conv1d(32, 16, 3, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.conv_b(F.silu(self.conv_a(x)))
        return self.head(x.amax(-1))


class _IntoLinear(nn.Module):
    """A Conv2d whose channels reach a Linear through a pooling and a flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 4, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x.reshape(-1, 1, 4, 8))), 2)
        return self.out(F.relu(self.fc(torch.flatten(x, 1))))


class _GroupNormed(nn.Module):
    """A GroupNorm between two convolutions: its groups span the split channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 16, 3, padding=1)
        self.norm = nn.GroupNorm(2, 16)
        self.conv2 = nn.Conv1d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(F.relu(self.norm(self.conv1(x))))
        return self.head(x.mean(-1))


NETS = {"stem": _Stem, "residual": _Residual, "into_linear": _IntoLinear, "normed": _GroupNormed}
SPLITS = {  # the layer -> its split, and its reason's source
    "stem": {"conv1": ("column", "data flow"), "conv2": ("row", "data flow")},
    "residual": {"conv_a": ("column", "data flow"), "conv_b": ("row", "data flow")},
    "into_linear": {"conv": ("column", "data flow"), "fc": ("row", "data flow")},
    # conv1 feeds the norm, so it splits alone; conv2's channels reach the head through a
    # mean over length, a pair of a convolution and a Linear
    "normed": {
        "conv1": ("column", "no partner"),
        "conv2": ("column", "data flow"),
        "head": ("row", "data flow"),
    },
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3 * 8, 4, 8, generator=generator)
    y = torch.randint(0, 5, (3 * 8,), generator=generator)
    return list(zip(x.split(8), y.split(8), strict=True))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[name]()


def _train(plan: ms.Plan) -> dict[str, tuple]:
    """Per net: losses, the whole state, each split layer's share of its weight and its
    decision on this rank."""
    results = {}
    for name in NETS:
        model = _build(name)
        whole = {n: p.numel() for n, p in model.named_parameters() if n.endswith("weight")}
        engine = ms.parallelize(model, plan, optimizer=_sgd, loss_fn=nn.CrossEntropyLoss())
        losses = [engine.train_step(x, y) for x, y in _batches()]
        held = dict(engine.module.named_parameters())
        layers = {layer.split(".")[0] for layer in SPLITS[name]}
        shares = {n.rsplit(".", 1)[0]: held[n].numel() / whole[n] for n in whole
                  if n.rsplit(".", 1)[0] in layers}  # fmt: skip
        splits = {d["name"]: (d["split"], d["reason"]) for d in engine.describe()["operator_split"]}
        results[name] = (losses, engine.full_state_dict(), shares, splits)
        engine.close()
    return results


@pytest.fixture(scope="module")
def split_by_two() -> list[dict[str, tuple]]:
    return ms.launch(_train, 2, args=(ms.Plan(tp=2),))


@pytest.mark.parametrize("name", list(NETS))
def test_convolutions_pair_through_the_data_flow_and_match_one_process(
    split_by_two: list[dict[str, tuple]], name: str
) -> None:
    model = _build(name)
    expected = train_plainly(model, _sgd(model.parameters()), nn.CrossEntropyLoss(), _batches())
    assert_matches([r[name][:2] for r in split_by_two], expected, case=name)
    for rank, results in enumerate(split_by_two):
        _, _, shares, splits = results[name]
        assert shares == dict.fromkeys(SPLITS[name], 0.5), (name, rank, shares)
        for layer, (split, source) in SPLITS[name].items():
            assert splits[layer][0] == split, (name, layer, splits[layer])
            assert source in splits[layer][1], (name, layer, splits[layer])


def test_a_convolution_that_feeds_a_norm_is_looked_at_only_as_a_row() -> None:
    # one forward names them, so a deep CNN's convolutions (each into a BatchNorm) cost no
    # probe and no simulated pair each; Whisper's second convolution still pairs as a row
    x = _batches()[0][0]
    for name, expected in (("stem", {"conv2"}), ("normed", {"conv1"}), ("residual", set())):
        model = _build(name)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv1d | nn.Linear)}
        norms = [m for m in model.modules() if isinstance(m, NORMS)]
        with quietly(model):
            trace = Trace(model, x, layers, norms)
        assert normalised(trace) == expected, name
