"""Parallel transposed convolutions (ConvTranspose1d, 2d, 3d): split by output channels
(column) or by input channels (row), as `conv.py` splits convolutions. A transposed
convolution is linear in its input channels too; its weight is laid out (in, out, *kernel), so
a column splits dimension 1 and a row dimension 0. Decoders and generators pair them with
convolutions or with each other.
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

__all__ = ["TRANSPOSED", "ColumnParallelConvTranspose", "RowParallelConvTranspose"]

TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONVOLVE = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}
"""The functional transposed convolution for a weight of that many dims (in, out, *kernel)."""
TransposedConv = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d

_GEOMETRY = ("stride", "padding", "output_padding", "dilation", "kernel_size")


class _Transposed(ParallelLayer):
    """What both splits keep of the whole layer: its geometry and channel counts (as model
    code reads them), and `output_size` turned into output padding as the layer does."""

    groups, padding_mode = 1, "zeros"
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
    dilation: tuple[int, ...]
    kernel_size: tuple[int, ...]
    in_channels: int
    out_channels: int

    def _keep_geometry(self, conv: TransposedConv) -> None:
        if conv.groups != 1 or conv.padding_mode != "zeros":
            raise PlanError(
                f"{type(conv).__name__} with groups={conv.groups} cannot be split by channels; "
                "replicate it (tp_plan={'<name>': 'replicate'})"
            )
        for key in (*_GEOMETRY, "in_channels", "out_channels"):
            setattr(self, key, getattr(conv, key))

    def _options(self, x: torch.Tensor, output_size: list[int] | None) -> dict[str, Any]:
        extra = nn.ConvTranspose2d._output_padding(
            self,  # type: ignore[arg-type]  # it reads only self.output_padding
            x,
            output_size,
            list(self.stride),
            list(self.padding),
            list(self.kernel_size),
            len(self.kernel_size),
            list(self.dilation),
        )
        return {
            "stride": self.stride,
            "padding": self.padding,
            "output_padding": extra,
            "dilation": self.dilation,
        }


class ColumnParallelConvTranspose(_Transposed):
    """A transposed convolution split by output channels: rank i makes channels
    conv_t(X, W[:, i]) + b_i.

    Input: replicated, entered by copy (backward: all-reduce dX). Output: channels split along
    dim 1, or whole when `gather_output`.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1, "bias": 0}

    def __init__(
        self, *, conv: TransposedConv, group: dist.ProcessGroup, gather_output: bool
    ) -> None:
        super().__init__(group)
        self._keep_geometry(conv)
        self.weight = layers.shard_param(conv.weight, 1, group, layer=conv, what="out_channels")
        self.bias = None
        if conv.bias is not None:
            self.bias = layers.shard_param(conv.bias, 0, group, layer=conv, what="out_channels")
        self.gather_output = gather_output

    @classmethod
    def from_module(
        cls,
        conv: TransposedConv,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        gather_output: bool = False,
    ) -> ColumnParallelConvTranspose:
        return cls(conv=conv, group=layers.tp_group(mesh_or_group), gather_output=gather_output)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        options = self._options(x, output_size)
        convolve = _CONVOLVE[self.weight.dim()]
        y = convolve(layers.enter_copy(self, x), self.weight, self.bias, **options)
        return layers.leave_gather(self, y, 1) if self.gather_output else y


class RowParallelConvTranspose(_Transposed):
    """A transposed convolution split by input channels: Y = sum_i conv_t(X_i, W[i]), then + b.

    Input: X_i (channels split along dim 1), or replicated X sliced here when `scatter_input`.
    Output: the sum over tp (forward: all-reduce), then the replicated bias.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(
        self, *, conv: TransposedConv, group: dist.ProcessGroup, scatter_input: bool
    ) -> None:
        super().__init__(group)
        self._keep_geometry(conv)
        self.weight = layers.shard_param(conv.weight, 0, group, layer=conv, what="in_channels")
        self.bias = layers.copy_param(conv.bias)
        self.scatter_input = scatter_input

    @classmethod
    def from_module(
        cls,
        conv: TransposedConv,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        scatter_input: bool = False,
    ) -> RowParallelConvTranspose:
        return cls(conv=conv, group=layers.tp_group(mesh_or_group), scatter_input=scatter_input)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.scatter_input:
            x = layers.enter_slice(self, x, 1)
        options = self._options(x, output_size)
        y = layers.leave_sum(self, _CONVOLVE[self.weight.dim()](x, self.weight, None, **options))
        return y if self.bias is None else y + layers.channel_bias(self.bias, y)
