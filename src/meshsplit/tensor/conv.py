"""Parallel convolutions (Conv1d, Conv2d, Conv3d): split by output channels (column) or by
input channels (row), Megatron's pair carried over to convolutions, which PyTorch's own tensor
parallel does not split. Channels are dim 1 of every batched input, whatever the number of
spatial dims. Rationale: docs/internals.md#tensorlayerspy
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.plan import PlanError
from meshsplit.tensor import layers
from meshsplit.tensor.shards import ParallelLayer

__all__ = ["CONVOLUTIONS", "ColumnParallelConv", "RowParallelConv"]

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVOLVE = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
"""The functional convolution for a weight of that many dims (out, in, *kernel)."""


def _conv_options(conv: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> dict[str, Any]:
    """The geometry F.convNd needs; refuses what a channel split cannot keep exact."""
    if conv.groups != 1 or conv.padding_mode != "zeros":
        raise PlanError(
            f"{type(conv).__name__} with groups={conv.groups}, "
            f"padding_mode={conv.padding_mode!r} cannot be split by channels; "
            "replicate it (tp_plan={'<name>': 'replicate'})"
        )
    return {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}


class _ConvGeometry:
    """The convolution's geometry, for code outside the layer that reads it (MobileNetV2's TF
    padding)."""

    options: dict[str, Any]
    groups, padding_mode = 1, "zeros"
    stride = property(lambda self: self.options["stride"])
    padding = property(lambda self: self.options["padding"])
    dilation = property(lambda self: self.options["dilation"])
    kernel_size = property(lambda self: tuple(self.weight.shape[2:]))


class ColumnParallelConv(_ConvGeometry, ParallelLayer):
    """A convolution split by output channels: rank i computes channels C_i = conv(X, W_i) + b_i.

    Input: replicated X, entered by copy (forward: identity; backward: all-reduce dX over tp).
    Output: channels split along dim 1, or whole when `gather_output` (forward: all-gather;
    backward: own slice).
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}
    in_channels = property(lambda self: self.weight.shape[1])
    out_channels = property(lambda self: self.weight.shape[0] * self.tp)
    """The whole layer's, as model code reads them."""

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        options: dict[str, Any],
        gather_output: bool,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.bias = bias
        self.options = options
        self.gather_output = gather_output

    @classmethod
    def from_module(
        cls,
        conv: nn.Conv1d | nn.Conv2d | nn.Conv3d,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        gather_output: bool = False,
    ) -> ColumnParallelConv:
        group = layers.tp_group(mesh_or_group)
        options = _conv_options(conv)
        weight = layers.shard_param(conv.weight, 0, group, layer=conv, what="out_channels")
        bias = (
            None
            if conv.bias is None
            else layers.shard_param(conv.bias, 0, group, layer=conv, what="")
        )
        return cls(
            weight=weight, bias=bias, group=group, options=options, gather_output=gather_output
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        convolve = _CONVOLVE[self.weight.dim()]
        y = convolve(layers.enter_copy(self, x), self.weight, self.bias, **self.options)
        return layers.leave_gather(self, y, 1) if self.gather_output else y

    def extra_repr(self) -> str:
        out, n_in, *kernel = self.weight.shape
        return f"{n_in}->{out}x{self.tp}, kernel={tuple(kernel)}, gather={self.gather_output}"


class RowParallelConv(_ConvGeometry, ParallelLayer):
    """A convolution split by input channels: Y = sum_i conv(X_i, W_i), then + b.

    Convolution is linear in its input channels, so each rank convolves its block of channels
    with its block of W's input channels and the partial maps add up to the whole.
    Input: X_i (channels split along dim 1), or replicated X sliced here when `scatter_input`
    (forward: slice; backward: all-gather). Output: the sum over tp (forward: all-reduce;
    backward: identity), then the replicated bias.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1}
    in_channels = property(lambda self: self.weight.shape[1] * self.tp)
    out_channels = property(lambda self: self.weight.shape[0])
    """The whole layer's, as model code reads them."""

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        options: dict[str, Any],
        scatter_input: bool,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.bias = bias
        self.options = options
        self.scatter_input = scatter_input

    @classmethod
    def from_module(
        cls,
        conv: nn.Conv1d | nn.Conv2d | nn.Conv3d,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        scatter_input: bool = False,
    ) -> RowParallelConv:
        group = layers.tp_group(mesh_or_group)
        options = _conv_options(conv)
        weight = layers.shard_param(conv.weight, 1, group, layer=conv, what="in_channels")
        return cls(
            weight=weight,
            bias=layers.copy_param(conv.bias),
            group=group,
            options=options,
            scatter_input=scatter_input,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scatter_input:
            x = layers.enter_slice(self, x, 1)
        y = layers.leave_sum(
            self, _CONVOLVE[self.weight.dim()](x, self.weight, None, **self.options)
        )
        return y if self.bias is None else y + layers.channel_bias(self.bias, y)

    def extra_repr(self) -> str:
        out, n_in, *kernel = self.weight.shape
        return f"{n_in}x{self.tp}->{out}, kernel={tuple(kernel)}, scatter={self.scatter_input}"
