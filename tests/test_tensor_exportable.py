"""The tp collectives traced by torch.export (tensor/exportable.py) compute what the eager
ones do, forward and backward, on real workers: a graph exported after an operator split
runs them as operators that keep their backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms
from meshsplit.tensor import collectives


class EveryCollective(nn.Module):
    """Enters and leaves a split region by each of the five collectives."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        assert group is not None
        copied = collectives.copy_to_tp(x, group)
        a, b = collectives.copy_all_to_tp([x * 2, y], group)
        mine = collectives.scatter_to_tp(y * 3, group, 1)
        gathered = collectives.gather_from_tp(mine * (dist.get_rank() + 1), group, 1)
        summed = collectives.reduce_from_tp(copied * a * (dist.get_rank() + 1), group)
        return summed.sum(1) + gathered.sum(1) + b.pow(2).sum(1)


def _both() -> list[dict[str, Any]]:
    torch.manual_seed(0)  # the same inputs on both ranks: replicated outside the region
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    model = EveryCollective()
    exported = torch.export.export(model, (x, y), strict=False).module()
    results = []
    for run in (model, exported):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = run(xs, ys)
        out.sum().backward()
        results.append({"out": out.detach(), "dx": xs.grad, "dy": ys.grad})
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    return [*results, {"ops": ops}]


def test_exported_collectives_match_the_eager_ones_forward_and_backward() -> None:
    for eager, exported, found in ms.launch(_both, 2, timeout_s=120):
        assert {f"meshsplit.{name}.default" for name in (
            "copy_to_tp", "copy_all_to_tp", "scatter_to_tp", "gather_from_tp", "reduce_from_tp"
        )} <= found["ops"]  # fmt: skip
        for key in ("out", "dx", "dy"):
            torch.testing.assert_close(exported[key], eager[key], rtol=0, atol=0)
