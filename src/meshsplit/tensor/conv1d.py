"""Hugging Face's `Conv1D` (GPT-2's projections) split over tp: a Linear with its weight transposed.

Conv1D computes Y = X·W + b with W of shape (in, out). Column split keeps W's columns (dim 1,
the output features) and b's rows (dim 0); row split keeps W's rows (dim 0, the input
features). Parameter names stay `weight` and `bias`, so state-dict keys stay the original's.
Conv1D is recognised by shape, not by import: class name "Conv1D", an int `nf` and a 2-D
weight (in, nf), so meshsplit itself does not need transformers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.tensor import layers
from meshsplit.tensor.shards import ParallelLayer

__all__ = ["ColumnParallelConv1D", "RowParallelConv1D", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D: Y = X·W + b with W (in, nf)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == module.nf
    )


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """X·W (+ b) over the last dim of X, as Conv1D computes it."""
    flat = x.reshape(-1, x.shape[-1])
    y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


class ColumnParallelConv1D(ParallelLayer):
    """Y = X·W + b with W's columns split: rank i computes Y_i = X·W_i + b_i.

    Input: replicated X, entered by copy (forward: identity; backward: all-reduce dX over tp).
    Output: Y_i split along the last dim, or whole when `gather_output` (forward: all-gather;
    backward: own slice). Fused (`parts` > 1, GPT-2's c_attn = q|k|v): block i of each part.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1, "bias": 0}
    nf = property(lambda self: self.weight.shape[1] * self.tp)
    """The whole layer's output features, as model code reads them."""

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        gather_output: bool,
        parts: int,
    ) -> None:
        super().__init__(group, parts=parts)
        self.weight = weight
        self.bias = bias
        self.gather_output = gather_output

    @classmethod
    def from_module(
        cls,
        conv: Any,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        gather_output: bool = False,
        parts: int = 1,
    ) -> ColumnParallelConv1D:
        group = layers.tp_group(mesh_or_group)
        layers.check_fused_output(parts, gather_output)
        weight = layers.shard_param(conv.weight, 1, group, layer=conv, what="nf", parts=parts)
        bias = None
        if conv.bias is not None:
            bias = layers.shard_param(conv.bias, 0, group, layer=conv, what="nf", parts=parts)
        return cls(weight=weight, bias=bias, group=group, gather_output=gather_output, parts=parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(layers.enter_copy(self, x), self.weight, self.bias)
        return layers.leave_gather(self, y, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        n_in, out = self.weight.shape
        return f"nx={n_in}, nf={out}x{self.tp}, parts={self.parts}, gather={self.gather_output}"


class RowParallelConv1D(ParallelLayer):
    """Y = X·W + b with W's rows split: Y = sum_i X_i·W_i, then + b.

    Input: X_i, this rank's slice of the last dim, as a column layer leaves it; or replicated X
    sliced here when `scatter_input` (forward: slice; backward: all-gather).
    Output: the sum over tp (forward: all-reduce; backward: identity), then the replicated bias.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0}
    nf = property(lambda self: self.weight.shape[1])
    """The whole layer's output features, as model code reads them."""

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        scatter_input: bool,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.bias = bias
        self.scatter_input = scatter_input

    @classmethod
    def from_module(
        cls, conv: Any, mesh_or_group: Mesh | dist.ProcessGroup, *, scatter_input: bool = False
    ) -> RowParallelConv1D:
        group = layers.tp_group(mesh_or_group)
        weight = layers.shard_param(conv.weight, 0, group, layer=conv, what="nx")
        bias = layers.copy_param(conv.bias)
        return cls(weight=weight, bias=bias, group=group, scatter_input=scatter_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scatter_input:
            x = layers.enter_slice(self, x, -1)
        y = layers.leave_sum(self, _matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias.to(y.dtype)  # addmm's dtype

    def extra_repr(self) -> str:
        n_in, out = self.weight.shape
        return f"nx={n_in}x{self.tp}, nf={out}, scatter={self.scatter_input}"
