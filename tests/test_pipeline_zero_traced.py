"""A traced pipeline item reads a parameter of its own directly (PoolFormer's layer_scale):
under ZeRO 2/3 the shard lives in the item, and the state every rank reports is that one.

Before, the item's traced copy held the sharded parameter while the model kept the old one,
which counted as state no item holds: `full_state_dict()` (and checkpoints) reported the
initial values of every such parameter, though training used the shards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms

from reference import assert_matches, train_plainly


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.tanh(self.lin(x))


class Net(nn.Module):
    """Blocks the layer split traces through (not a Sequential): `scale` is read directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = Scaled(), Scaled(), Scaled(), Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _run(zero: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    plan = ms.Plan(dp=2, pp=2, micro_batches=2, zero=zero)
    engine = ms.parallelize(_build(), plan, optimizer=_sgd, loss_fn=nn.MSELoss())
    losses = [engine.train_step(x, y) for x, y in _batches()]
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("zero", [2, 3])
def test_a_traced_items_own_parameters_report_their_trained_values(zero: int) -> None:
    net = _build()
    want = train_plainly(net, _sgd(net.parameters()), nn.MSELoss(), _batches())
    assert not torch.equal(want[1]["a.scale"], torch.full((8,), 0.5))  # it does train
    assert_matches(ms.launch(_run, 4, args=(zero,), timeout_s=300), want, case=f"zero={zero}")
