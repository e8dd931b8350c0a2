"""A key or value projection whose kv heads are fewer than the tp ranks: ranks share them.

Grouped-query attention with h query heads and g kv heads (g < tp, tp a multiple of g) splits
its query heads h/tp to a rank; the query heads of rank r read kv head ⌊r·g/tp⌋, which the
tp/g ranks around it share. Each rank computes only that head's rows of k (and v) from the
whole weight, kept on every rank (Megatron replicates the kv heads the same way). A rank's
weight gradient is nonzero only in its head's rows, and is the share of its query heads:
the sum over tp (gradient_sum.py) gives each head the sum over the ranks sharing it, which
is what one process computes.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.tensor.layers import copy_param, enter_copy, tp_group
from meshsplit.tensor.shards import ParallelLayer

__all__ = ["SharedHeadsLinear"]


class SharedHeadsLinear(ParallelLayer):
    """nn.Linear computing only this rank's block of `heads` equal blocks of output rows."""

    shard_dims: ClassVar[dict[str, int]] = {}

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        heads: int,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.bias = bias
        rows = weight.shape[0] // heads
        start = dist.get_rank(group) * heads // self.tp * rows
        self.rows = slice(start, start + rows)
        """The rows of this rank's kv head."""

    @classmethod
    def from_module(
        cls, linear: nn.Linear, mesh_or_group: Mesh | dist.ProcessGroup, *, heads: int
    ) -> SharedHeadsLinear:
        weight = copy_param(linear.weight)
        assert weight is not None
        return cls(
            weight=weight,
            bias=copy_param(linear.bias),
            group=tp_group(mesh_or_group),
            heads=heads,
        )

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_copy(self, x)
        bias = None if self.bias is None else self.bias[self.rows]
        return F.linear(x, self.weight[self.rows], bias)
