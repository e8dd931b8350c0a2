"""The parallel layer a split decision makes of a module: one constructor per kind of layer
and split, each slicing the original's weights for this rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from meshsplit.tensor.attention import split_heads
from meshsplit.tensor.conv import CONVOLUTIONS, ColumnParallelConv, RowParallelConv
from meshsplit.tensor.conv1d import ColumnParallelConv1D, RowParallelConv1D, is_conv1d
from meshsplit.tensor.conv_transpose import (
    TRANSPOSED,
    ColumnParallelConvTranspose,
    RowParallelConvTranspose,
)
from meshsplit.tensor.experts import split_experts_module
from meshsplit.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from meshsplit.tensor.multihead import split_multihead
from meshsplit.tensor.shared_heads import SharedHeadsLinear
from meshsplit.tensor.units import Decision

__all__: list[str] = []


def parallel_form(module: nn.Module, decision: Decision, group: dist.ProcessGroup) -> nn.Module:
    """This rank's parallel layer for `module`, split as `decision` says (not "replicate")."""
    if decision.split == "experts":
        return split_experts_module(module, dict(decision.layouts), group)
    if decision.split == "heads":
        if isinstance(module, nn.MultiheadAttention):
            return split_multihead(module, group)
        return split_heads(module, group)
    if decision.split == "vocab":
        return VocabParallelEmbedding.from_module(module, group)  # type: ignore[arg-type]
    if decision.shared:
        return SharedHeadsLinear.from_module(module, group, heads=decision.shared)  # type: ignore[arg-type]
    gather, scatter = decision.gather_output, decision.scatter_input
    if is_conv1d(module):
        if decision.split == "column":
            return ColumnParallelConv1D.from_module(
                module, group, gather_output=gather, parts=decision.parts
            )
        return RowParallelConv1D.from_module(module, group, scatter_input=scatter)
    if isinstance(module, CONVOLUTIONS):
        if decision.split == "column":
            return ColumnParallelConv.from_module(module, group, gather_output=gather)
        return RowParallelConv.from_module(module, group, scatter_input=scatter)
    if isinstance(module, TRANSPOSED):
        if decision.split == "column":
            return ColumnParallelConvTranspose.from_module(module, group, gather_output=gather)
        return RowParallelConvTranspose.from_module(module, group, scatter_input=scatter)
    if decision.split == "column":
        return ColumnParallelLinear.from_module(
            module,  # type: ignore[arg-type]
            group,
            gather_output=gather,
            parts=decision.parts,
        )
    return RowParallelLinear.from_module(module, group, scatter_input=scatter)  # type: ignore[arg-type]
