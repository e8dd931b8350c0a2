"""A fused tensor (qkv) that the operator split cuts within each of its parts, checkpointed
part by part: rank r holds block r of every part, so each part alone is a plain split over
tp that DCP writes and reads rank by rank. Gathered whole instead, every fused tensor of the
model and its optimizer moments sat whole on every rank at once during each save.

A part's checkpoint key is the tensor's own with `#part{k}of{parts}dim{dim}` appended;
checkpoints that hold the tensor whole under its own key are read too.
Rationale: docs/internals.md#runtimecheckpointpy
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__: list[str] = []

_MARK = "#part"


def keys(key: str, dim: int, parts: int) -> list[str]:
    """The checkpoint keys of `key`'s parts, in order."""
    return [f"{key}{_MARK}{k}of{parts}dim{dim}" for k in range(parts)]


def layout_of(key: str) -> tuple[str, int, int] | None:
    """(the tensor's key, dim, parts) of a part's key; None for any other key."""
    base, mark, tail = key.partition(_MARK)
    if not mark:
        return None
    _, _, rest = tail.partition("of")
    parts, _, dim = rest.partition("dim")
    return base, int(dim), int(parts)


def layouts(saved: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Tensor key -> (dim, parts) of every tensor held as parts among the keys `saved`."""
    return {found[0]: found[1:] for key in saved if (found := layout_of(key)) is not None}


def as_parts(key: str, shard: torch.Tensor, dim: int, parts: int, mesh: DeviceMesh) -> dict:
    """This rank's fused `shard` as one DTensor per part, each split along `dim` over the tp
    `mesh` (block r of part k is this rank's k-th piece)."""
    pieces = shard.chunk(parts, dim=dim)
    return {
        name: DTensor.from_local(piece.contiguous(), mesh, [Shard(dim)], run_check=False)
        for name, piece in zip(keys(key, dim, parts), pieces, strict=True)
    }


def placed_like(whole: torch.Tensor, like: DTensor) -> DTensor:
    """`whole` cut as `like` is sharded (this rank's experts, its ZeRO slice): no messages."""
    mesh = like.device_mesh
    every = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return every.redistribute(mesh, like.placements)


def assembled(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Parts (or this rank's blocks of them, read as DTensors) back into one tensor."""
    return torch.cat([p.to_local() if isinstance(p, DTensor) else p for p in pieces], dim=dim)


def joined(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (whole tensors, as one process reads a checkpoint) with each fused tensor's
    parts made one again, where its first part was."""
    whole: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        found = layout_of(key)
        if found is None:
            whole[key] = value
            continue
        base, dim, count = found
        names = keys(base, dim, count)
        if key == names[0]:
            whole[base] = assembled([state[name] for name in names], dim)
    return whole


def ask_as_saved(
    state: dict[str, Any],
    saved: Mapping[str, Any],
    device: torch.device,
) -> tuple[dict[str, tuple[int, int, bool]], dict[str, DTensor]]:
    """Make `state` ask for each fused tensor as the checkpoint holds it: this rank's blocks
    of each part where both split it alike, else the whole parts, or the whole tensor (the
    format before parts, or a plan that did not fuse it), to be split here after the read.
    Returns key -> (dim, parts, whether the parts are this rank's blocks) of what is read
    as parts, and key -> the sharded tensor a whole one read must be cut like
    (`placed_like`)."""
    read: dict[str, tuple[int, int, bool]] = {}
    placed: dict[str, DTensor] = {}
    shapes: dict[str, torch.Size] = {}  # each tensor's whole shape here, for the fit check
    for key, (dim, count) in layouts(state).items():
        names = keys(key, dim, count)
        if all(name in saved for name in names):
            read[key] = (dim, count, True)
            continue
        whole = list(state[names[0]].shape)
        whole[dim] *= count
        shapes[key] = torch.Size(whole)
        for name in names:
            del state[name]
        state[key] = None  # asked for below in the form the checkpoint holds
    for key, (dim, count) in layouts(saved).items():
        if key in state and key not in read:
            like = state.pop(key)
            shape = like.shape if isinstance(like, torch.Tensor) else shapes.get(key)
            for name in keys(key, dim, count):
                piece = None if shape is None else _part_shape(shape, dim, count)
                state[name] = _empty_like(saved[name], device, piece)
            read[key] = (dim, count, False)
            if isinstance(like, DTensor):  # sharded here (experts over ep, ZeRO over dp)
                placed[key] = like
    for key in [k for k, v in state.items() if v is None and k in saved]:
        state[key] = _empty_like(saved[key], device, shapes.get(key))
    return read, placed  # a key in neither form stays None: the fit check names it


def _part_shape(shape: torch.Size, dim: int, count: int) -> torch.Size:
    part = list(shape)
    part[dim] //= count
    return torch.Size(part)


def _empty_like(item: Any, device: torch.device, shape: torch.Size | None) -> torch.Tensor | None:
    """A tensor to read a saved one into whole: of this model's `shape` where known, so
    that a checkpoint of another model fails the fit check, not the copy after the read."""
    if not isinstance(item, TensorStorageMetadata):
        return None
    return torch.empty(shape or item.size, dtype=item.properties.dtype, device=device)
