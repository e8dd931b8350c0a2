"""BatchNorm subclasses with a forward of their own normalise over the dp group.

timm builds EfficientNet, MobileNet, RegNet, DenseNet and others from `BatchNormAct2d`, an
nn.BatchNorm2d subclass whose forward calls `F.batch_norm` itself and then its activation.
Such a layer was left as it was, with a warning, so under dp each replica normalised its own
rows (first losses 10-30% off one process on timm's EfficientNet-B0). Now its `F.batch_norm`
calls see the statistics of every replica's rows: dp2 and dp4, with ZeRO 2 too, equal one
process on the global batch, running statistics included; a subclass that normalises by
other means is named in a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshsplit as ms

from reference import ATOL, RTOL, train_plainly


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: its own momentum bookkeeping, F.batch_norm, a ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        training = self.training or self.running_mean is None
        x = F.batch_norm(
            x, self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, training, factor, self.eps,
        )  # fmt: skip
        return torch.relu(x)


class ByHand(nn.BatchNorm2d):
    """Normalises without F.batch_norm: nothing to answer, so it is named."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps)


def _cnn(norm: type[nn.Module] = BatchNormAct) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.Conv2d(8, 8, 3, stride=2),
        norm(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )  # fmt: skip


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 5, (8,), generator=g))
            for _ in range(3)]  # fmt: skip


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _parallel(plans: list[ms.Plan]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    results = []
    for plan in plans:
        engine = ms.parallelize(_cnn(), plan, optimizer=_sgd, loss_fn=nn.CrossEntropyLoss())
        losses = [engine.train_step(x, y) for x, y in _batches()]
        results.append((losses, engine.full_state_dict()))
        engine.close()
    return results


@pytest.mark.parametrize("workers", [2, 4])
def test_an_own_forward_normalises_over_dp_as_one_process(workers: int) -> None:
    model = _cnn()
    want_losses, want_state = train_plainly(
        model, _sgd(model.parameters()), nn.CrossEntropyLoss(), _batches()
    )
    plans = [ms.Plan(dp=workers), ms.Plan(dp=workers, zero=2)]
    for results in ms.launch(_parallel, workers, args=(plans,), timeout_s=120):
        for plan, (losses, state) in zip(plans, results, strict=True):
            where = plan.describe()
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), rtol=RTOL, atol=ATOL,
                msg=lambda m, w=where: f"{w}: {m}",
            )  # fmt: skip
            for key, value in want_state.items():  # running statistics and the count too
                torch.testing.assert_close(
                    state[key], value, rtol=RTOL, atol=ATOL,
                    msg=lambda m, w=where, k=key: f"{w} {k}: {m}",
                )  # fmt: skip


def _warned(norm: type[nn.Module]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ms.parallelize(
            _cnn(norm), ms.Plan(dp=2), optimizer=_sgd, loss_fn=nn.CrossEntropyLoss()
        )
        x, y = _batches()[0]
        engine.train_step(x, y)
        engine.close()
    return [str(w.message) for w in caught]


def _warned_of_each() -> dict[str, list[str]]:
    return {norm.__name__: _warned(norm) for norm in (ByHand, nn.BatchNorm2d)}


def test_an_own_forward_without_f_batch_norm_is_named() -> None:
    for warned in ms.launch(_warned_of_each, 2):
        named = "ByHand's forward normalises without F.batch_norm"
        assert any(named in m for m in warned["ByHand"])
        # nn.BatchNorm2d becomes meshsplit's own layer, which is not a user's subclass
        assert not [m for m in warned["BatchNorm2d"] if "normalises without" in m]
