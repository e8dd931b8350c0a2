"""Autograd-aware collectives over the tp group, named by the region they open or close.

An operator split runs between two regions: activations are *replicated* (every tp rank holds
the same tensor) outside it and *split* (each rank holds its own part) inside it. Each function
below crosses that boundary in one direction and is the other's transpose in backward:

| function          | forward                     | backward                           |
| ----------------- | --------------------------- | ---------------------------------- |
| `copy_to_tp`      | identity                    | all-reduce (sum) over tp           |
| `reduce_from_tp`  | all-reduce (sum) over tp    | identity                           |
| `gather_from_tp`  | all-gather along `dim`      | keep this rank's slice of `dim`    |
| `scatter_to_tp`   | keep this rank's slice      | all-gather along `dim`             |

Rationale: docs/internals.md#tensorcollectivespy
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.tensor import exportable
from meshsplit.tensor.staged import (
    all_gather_along,
    all_reduce_fresh,
    all_reduce_together,
    own_slice,
)

__all__ = [
    "InputCopies",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_fresh(grad, ctx.group), None


class _CopyAllToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, *all_reduce_together(grads, ctx.group))


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce_fresh(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return own_slice(grad, ctx.dim, ctx.group), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return own_slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a split region with a replicated input. forward: identity; backward: all-reduce.

    Each rank's split layer contributes a partial gradient dL/dx_i; the true gradient of the
    replicated x is their sum.
    """
    if torch.compiler.is_exporting():
        return exportable.copy_to_tp(x, group.group_name)
    return _CopyToTP.apply(x, group)


def copy_all_to_tp(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> tuple[torch.Tensor, ...]:
    """`copy_to_tp` of several tensors that enter one split region together (an experts
    module's tokens and routing weights): their gradients summed by one all-reduce."""
    if torch.compiler.is_exporting():
        return tuple(exportable.copy_all_to_tp(list(xs), group.group_name))
    return _CopyAllToTP.apply(group, *xs)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a split region by summing partial results. forward: all-reduce; backward: identity.

    Y = sum_i X_i A_i (row-parallel); the gradient of the sum is the same on every rank.
    """
    if torch.compiler.is_exporting():
        return exportable.reduce_from_tp(x, group.group_name)
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Leave a split region by concatenation. forward: all-gather along dim; backward: own slice.

    Y = [Y_0, ..., Y_{tp-1}] along `dim`; dL/dY_i is the i-th slice of dL/dY.
    """
    if torch.compiler.is_exporting():
        return exportable.gather_from_tp(x, group.group_name, dim)
    return _GatherFromTP.apply(x, group, dim)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Enter a split region by slicing. forward: keep own slice of dim; backward: all-gather.

    X_i = i-th slice of X along `dim`; dL/dX is the concatenation of every rank's dL/dX_i.
    """
    if torch.compiler.is_exporting():
        return exportable.scatter_to_tp(x, group.group_name, dim)
    return _ScatterToTP.apply(x, group, dim)


def in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` as the split layer reading it computes: in the autocast dtype when autocast is on
    (the layer would cast it anyway), so the gradient all-reduced in backward is half the
    bytes; as it is otherwise."""
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return x
    return x.to(torch.get_autocast_dtype(device))


class InputCopies:
    """The copy into the tp region of the tensor the last column layer read, for the next one.

    Column layers that read the same tensor one after another (q, k and v; gate and up) then
    share one copy: forward is the identity either way, and backward all-reduces their summed
    input gradient once, Megatron's one all-reduce per region, instead of once per layer.
    Only the latest copy is kept, so at most one activation outlives its step.
    """

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def copy(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        grad_mode = torch.is_grad_enabled()
        if self._last is not None and self._last[0] is x and self._last[2] == grad_mode:
            return self._last[1]
        fresh = copy_to_tp(in_autocast_dtype(x), group)
        self._last = (x, fresh, grad_mode)
        return fresh
