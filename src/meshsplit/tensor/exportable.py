"""The tp collectives as custom operators, for a model torch.export traces after its operator
split (a layer split's traced front end under pp x tp): export runs an autograd.Function's
forward into plain ops and drops its backward, while a custom operator stays one node that
keeps the backward registered for it. `collectives.py` calls these while exporting only (in
eager mode the autograd.Functions are cheaper: no clone, no dispatch through the library).
Rationale: docs/internals.md#tensorcollectivespy
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from meshsplit.tensor.staged import (
    all_gather_along,
    all_reduce_fresh,
    all_reduce_together,
    own_slice,
)

__all__ = ["copy_all_to_tp", "copy_to_tp", "gather_from_tp", "reduce_from_tp", "scatter_to_tp"]


def _group(name: str) -> dist.ProcessGroup:
    """The process group a traced graph names (a group cannot be an operator's argument)."""
    resolve: Any = distributed_c10d._resolve_process_group  # typed for a GroupName
    group: dist.ProcessGroup = resolve(name)
    return group


def _empty_along(x: torch.Tensor, group: str, dim: int, *, gathered: bool) -> torch.Tensor:
    """A tensor shaped as `x` gathered over the group along `dim`, or as its slice."""
    size = dist.get_world_size(_group(group))
    shape = list(x.shape)
    shape[dim] = shape[dim] * size if gathered else shape[dim] // size
    return x.new_empty(shape)


def _remember_group(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group = inputs[1]
    ctx.dim = inputs[2] if len(inputs) > 2 else None


@torch.library.custom_op("meshsplit::copy_to_tp", mutates_args=())
def copy_to_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: identity (a copy: an operator's output may not alias its input)."""
    return x.clone()


@copy_to_tp.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _copy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return all_reduce_fresh(grad, _group(ctx.group)), None


copy_to_tp.register_autograd(_copy_backward, setup_context=_remember_group)


@torch.library.custom_op("meshsplit::copy_all_to_tp", mutates_args=())
def copy_all_to_tp(xs: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    """`copy_to_tp` of tensors that enter one split region together."""
    return [x.clone() for x in xs]


@copy_all_to_tp.register_fake
def _(xs: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _copy_all_backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, None]:
    return all_reduce_together(grads, _group(ctx.group)), None


copy_all_to_tp.register_autograd(_copy_all_backward, setup_context=_remember_group)


@torch.library.custom_op("meshsplit::reduce_from_tp", mutates_args=())
def reduce_from_tp(x: torch.Tensor, group: str) -> torch.Tensor:
    """Forward: all-reduce (sum) over tp."""
    return all_reduce_fresh(x, _group(group))


@reduce_from_tp.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


reduce_from_tp.register_autograd(_reduce_backward, setup_context=_remember_group)


@torch.library.custom_op("meshsplit::gather_from_tp", mutates_args=())
def gather_from_tp(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """Forward: all-gather along `dim`."""
    return all_gather_along(x, dim, _group(group)).clone()


@gather_from_tp.register_fake
def _(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return _empty_along(x, group, dim, gathered=True)


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return own_slice(grad, ctx.dim, _group(ctx.group)), None, None


gather_from_tp.register_autograd(_gather_backward, setup_context=_remember_group)


@torch.library.custom_op("meshsplit::scatter_to_tp", mutates_args=())
def scatter_to_tp(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """Forward: this rank's slice of `dim` (a copy)."""
    return own_slice(x, dim, _group(group)).clone()


@scatter_to_tp.register_fake
def _(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return _empty_along(x, group, dim, gathered=False)


def _scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return all_gather_along(grad, ctx.dim, _group(ctx.group)), None, None


scatter_to_tp.register_autograd(_scatter_backward, setup_context=_remember_group)
