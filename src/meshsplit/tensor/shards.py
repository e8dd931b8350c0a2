"""Where each split tensor's pieces lie, and putting them back together.

A split tensor is cut along `dim` into `parts` equal consecutive parts (3: a fused q|k|v), each
into tp equal blocks; rank r holds block r of every part, side by side:

    full  = [P_0 | P_1 | ... | P_{parts-1}],   P_p = [B_p0 | B_p1 | ... | B_p,tp-1]
    local(r) = [B_0r | B_1r | ... | B_{parts-1},r]

Rationale: docs/internals.md#tensorshardspy
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.tensor.staged import all_gather_along

__all__ = ["ParallelLayer", "local_shard", "shard_dims", "shard_layouts", "unshard_state_dict"]


class ParallelLayer(nn.Module):
    """A layer whose parameters are (partly) split over the tp `group`."""

    shard_dims: ClassVar[dict[str, int]]
    """Local parameter name -> dimension split over tp; parameters not named are replicated."""

    def __init__(self, group: dist.ProcessGroup, *, parts: int = 1) -> None:
        super().__init__()
        self.group = group
        self.parts = parts
        """How many fused parts each split parameter has (1: contiguous blocks)."""

    @property
    def tp(self) -> int:
        return dist.get_world_size(self.group)

    def shard_layouts(self) -> dict[str, tuple[int, int]]:
        """Local parameter name -> (dim, parts) of every split parameter this layer holds."""
        return {
            name: (dim, self.parts)
            for name, dim in self.shard_dims.items()
            if getattr(self, name, None) is not None
        }


def local_shard(full: torch.Tensor, dim: int, parts: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s shard of the whole tensor `full`: block `rank` of each of `parts` parts.

    Raises ValueError when parts·tp does not divide `full`'s size along `dim`.
    """
    size = full.shape[dim]
    if size % (parts * tp):
        raise ValueError(
            f"dimension {dim} of size {size} does not split into {parts} parts of tp={tp} "
            f"blocks; it needs a size divisible by {parts * tp}"
        )
    blocks = [part.chunk(tp, dim=dim)[rank] for part in full.chunk(parts, dim=dim)]
    return torch.cat(blocks, dim=dim)


def _reassemble(gathered: torch.Tensor, dim: int, parts: int, tp: int) -> torch.Tensor:
    """The whole tensor from every rank's shard concatenated in rank order along `dim`."""
    if parts == 1:
        return gathered
    per_rank = [shard.chunk(parts, dim=dim) for shard in gathered.chunk(tp, dim=dim)]
    return torch.cat([per_rank[r][p] for p in range(parts) for r in range(tp)], dim=dim)


def shard_layouts(module: nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict name -> (dim, parts) for every split tensor under `module` (see the module doc).

    Every name not listed is replicated (the same on every tp rank). A tensor held under
    several names (tied weights, an alias such as BERT's `predictions.bias`) is listed under
    each, like the state dict lists it.
    """
    by_tensor = {
        id(layer.get_parameter(name)): layout
        for layer in module.modules()
        if isinstance(layer, ParallelLayer)
        for name, layout in layer.shard_layouts().items()
    }
    return {
        name: by_tensor[id(param)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if id(param) in by_tensor
    }


def shard_dims(module: nn.Module) -> dict[str, int]:
    """State-dict name -> the dimension split over tp, for every split tensor under `module`.

    For contiguous tensors (parts=1) rank r of tp holds the r-th of tp equal blocks along that
    dimension. Fused tensors (parts > 1, e.g. GPT-2's c_attn) are listed too, with their
    dimension, but their pieces are not contiguous: use `shard_layouts` and `local_shard` for
    them. Every name not listed is replicated.
    """
    return {name: dim for name, (dim, _) in shard_layouts(module).items()}


def unshard_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """The unsplit state dict: each split tensor all-gathered over tp, fused parts reordered.

    Every tp rank must call this (it runs one all-gather per split tensor, in key order);
    keys and order stay those of `state_dict`, shapes and layouts become the original model's.
    """
    layouts = shard_layouts(module)
    return {
        key: unshard_tensor(tensor, *layouts[key], group) if key in layouts else tensor
        for key, tensor in state_dict.items()
    }


def unshard_tensor(
    shard: torch.Tensor, dim: int, parts: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """The whole tensor from every tp rank's `shard` (all-gather, then fused parts reordered)."""
    gathered = all_gather_along(shard, dim, group, staged=False)
    return _reassemble(gathered, dim, parts, dist.get_world_size(group))
