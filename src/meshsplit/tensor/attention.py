"""Attention split by heads: q/k/v column-parallel, out row-parallel, one input copy for all three.

The region crossing is `layers.enter_copy`, looked up on the module at call time so that the
`torch.fx.wrap` registered there also covers this call in a symbolic trace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.tensor import layers

__all__ = ["HeadParallelAttention", "split_heads"]


class HeadParallelAttention(nn.Module):
    """Attention split by heads: each rank runs a contiguous block of n_heads/tp heads.

    q, k and v are column-parallel (their output rows are the heads' rows, so a block of rows
    is a block of heads) and share one input copy (forward: identity; backward: one all-reduce
    of dX over tp for all three); `out` is row-parallel (forward: one all-reduce). The
    attention's own forward then runs unchanged on the local heads.

    `split_heads` turns an attention module into a subclass of its own class with this one
    first in the MRO, so isinstance checks and the original forward both still hold.
    """

    group: dist.ProcessGroup

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(layers.enter_copy(self, x), *args, **kwargs)


_HEAD_PARALLEL_CLASSES: dict[type, type] = {}
"""One head-split subclass per attention class, so split blocks share a class."""


def _head_parallel_class(cls: type) -> type:
    if cls not in _HEAD_PARALLEL_CLASSES:
        name = f"HeadParallel{cls.__name__}"
        _HEAD_PARALLEL_CLASSES[cls] = type(name, (HeadParallelAttention, cls), {})
    return _HEAD_PARALLEL_CLASSES[cls]


def split_heads(attention: Any, mesh_or_group: Mesh | dist.ProcessGroup) -> nn.Module:
    """Split `attention` (Linear children q, k, v, out; int attribute n_heads) by heads, in place.

    Afterwards `n_heads` is this rank's head count.
    """
    group = layers.tp_group(mesh_or_group)
    tp = dist.get_world_size(group)
    layers.check_heads(tp, attention.n_heads, f"{type(attention).__name__} n_heads")
    for name in ("q", "k", "v"):
        projection = layers.ColumnParallelLinear.from_module(
            getattr(attention, name), group, copy_input=False
        )
        setattr(attention, name, projection)
    attention.out = layers.RowParallelLinear.from_module(attention.out, group)
    attention.n_heads = attention.n_heads // tp
    attention.group = group
    attention.__class__ = _head_parallel_class(type(attention))
    return attention
