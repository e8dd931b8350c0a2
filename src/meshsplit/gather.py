"""The flat all-gather and reduce-scatter under the name the installed torch prefers.

torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for all_gather_single /
reduce_scatter_single, which torch 2.11 (what the GPU machines ship) lacks. The name is
chosen once at import; the function is looked up on torch.distributed at each call, so the
collective interceptor (job/intercept.py) and tests that patch torch.distributed see it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []

ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_flat(
    output: torch.Tensor, mine: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Every rank's `mine`, concatenated along dim 0 into `output`, on every rank."""
    return getattr(dist, ALL_GATHER)(output, mine, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """The sum over ranks of `full`, this rank's slice of dim 0 in `output`."""
    return getattr(dist, REDUCE_SCATTER)(output, full, group=group, async_op=async_op)
