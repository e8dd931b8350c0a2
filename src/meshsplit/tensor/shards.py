"""Where each split tensor's pieces lie, and putting them back together.

Works on any module that contains parallel layers — a whole model or one pipeline stage cut
from it — because each parallel layer says which of its own parameters are split.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.tensor.collectives import all_gather_along
from meshsplit.tensor.layers import ParallelLayer

__all__ = ["shard_dims", "unshard_state_dict"]


def shard_dims(module: nn.Module) -> dict[str, int]:
    """State-dict name -> the dimension split over tp, for every split tensor under `module`.

    Rank r of tp holds the r-th of tp equal contiguous blocks along that dimension; every
    name not listed is replicated (the same on every tp rank).
    """
    dims: dict[str, int] = {}
    for prefix, layer in module.named_modules():
        if isinstance(layer, ParallelLayer):
            for name, dim in layer.shard_dims.items():
                if getattr(layer, name, None) is not None:
                    dims[f"{prefix}.{name}" if prefix else name] = dim
    return dims


def unshard_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """The unsplit state dict: each split tensor all-gathered over tp along its dimension.

    Every tp rank must call this (it runs one all-gather per split tensor, in key order);
    keys and order stay those of `state_dict`, shapes become the original model's.
    """
    dims = shard_dims(module)
    return {
        key: all_gather_along(tensor, dims[key], group) if key in dims else tensor
        for key, tensor in state_dict.items()
    }
