"""Collectives over the tp group without autograd, in flat staging buffers reused from one
call to the next (the autograd-aware ones, `collectives.py`, and their exportable twins,
`exportable.py`, run these).
Rationale: docs/internals.md#tensorcollectivespy
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.gather import all_gather_flat
from meshsplit.memory.report import tensor_bytes
from meshsplit.phases import waiting

__all__ = [
    "Staging",
    "all_gather_along",
    "all_reduce_fresh",
    "all_reduce_together",
    "forget_staging",
    "own_slice",
    "staging",
]


class Staging:
    """Flat buffers, one per (dtype, device), that a group's collectives run in.

    Each grows to the largest collective it has carried and is then reused; `buffers` lists
    them for memory accounting (they are communication buffers, like the pipeline's pools).
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def area(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of `numel` elements of `like`'s dtype and device, valid until reuse."""
        key = (like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            flat = self._flat[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return flat[:numel]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._flat.values())


_STAGING: weakref.WeakKeyDictionary[dist.ProcessGroup, Staging] = weakref.WeakKeyDictionary()


def staging(group: dist.ProcessGroup) -> Staging:
    """The staging buffers of `group` (made on first use, gone with the group)."""
    found = _STAGING.get(group)
    if found is None:
        found = _STAGING[group] = Staging()
    return found


def forget_staging(group: dist.ProcessGroup) -> None:
    """Drop `group`'s staging buffers: its next collective makes new ones, sized by what it
    carries then (a closed engine's largest collective no longer sizes the next engine's)."""
    _STAGING.pop(group, None)


def all_reduce_fresh(
    tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Reduce over `group` into a fresh tensor (autograd may share the input with other nodes)."""
    shaped = staging(group).area(tensor.numel(), tensor).view(tensor.shape)
    shaped.copy_(tensor)
    with waiting("tp all-reduce wait", lambda: {"bytes": tensor_bytes([shaped])}):
        dist.all_reduce(shaped, op=op, group=group)
    return shaped.clone()


def all_reduce_together(
    grads: Sequence[torch.Tensor | None], group: dist.ProcessGroup
) -> list[torch.Tensor | None]:
    """Each tensor summed over `group` (None stays None), in one all-reduce of them all when
    they share a dtype (one per tensor otherwise: one per dtype is not worth it)."""
    present = [g for g in grads if g is not None]
    if len({g.dtype for g in present}) > 1:
        return [None if g is None else all_reduce_fresh(g, group) for g in grads]
    if not present:
        return list(grads)
    flat = all_reduce_fresh(torch.cat([g.reshape(-1) for g in present]), group)
    summed = iter(flat.split([g.numel() for g in present]))
    return [None if g is None else next(summed).view_as(g) for g in grads]


def all_gather_along(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, *, staged: bool = True
) -> torch.Tensor:
    """Concatenate every rank's equal-sized `tensor` along `dim`, in rank order (no autograd).

    `staged=False` gathers into fresh buffers, for one-off gathers (a checkpoint's whole
    weights) that should not leave a staging buffer of their size behind.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    n, stacked = tensor.numel(), (size * tensor.shape[0], *tensor.shape[1:])
    if staged:
        area = staging(group).area((size + 1) * n, tensor)
        rows, mine = area[: size * n].view(stacked), area[size * n :].view(tensor.shape)
        mine.copy_(tensor)
    else:
        rows, mine = tensor.new_empty(stacked), tensor.contiguous()
    with waiting("tp all-gather wait", lambda: {"bytes": tensor_bytes([mine])}):
        all_gather_flat(rows, mine, group=group)
    return torch.cat(rows.chunk(size), dim=dim)


def own_slice(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous 1/tp of `dim`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {tensor.shape[dim]} does not split over tp={size}; "
            f"give it a size divisible by {size}"
        )
    return tensor.chunk(size, dim=dim)[rank].contiguous()
