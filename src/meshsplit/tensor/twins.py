"""Pairs for the layers the example never ran, taken from their twins that it did.

A small example routes no token to most experts of a mixture-of-experts model with a list of
expert modules: the data flow sees those experts' layers never called and cannot pair them,
so they would stay whole on every rank beside split siblings. An item of a ModuleList or
ModuleDict of the same class and parameter shapes as one whose layers paired runs the same
code on the same shapes, so the proved pair holds for it, layer for layer.
Rationale: docs/internals.md#tensortwinspy
"""

from __future__ import annotations

import torch
from torch import nn

from meshsplit.tensor.dataflow import Pair
from meshsplit.tensor.units import Unit

__all__: list[str] = []


def twin_pairs(
    model: nn.Module, units: list[Unit], called: set[str], mended: set[str]
) -> list[tuple[Pair, str]]:
    """Each pair of `units` set so far (by a plan or the data flow) moved to every sibling
    of its owner whose layers the example never `called` and no rule split yet, with the
    module it was copied from; not a pair whose split values a whole layer reads (`mended`
    rows: their sums were found by running the example, which a twin's never ran)."""
    pairs = [
        Pair(
            columns={c.name: c.parts for c in u.feeders},
            row=u.name,
            per_rank=u.per_rank,
            shared={c.name: c.shared for c in u.feeders if c.shared},
        )
        for u in units
        if u.split == "row" and u.feeders and u.name not in mended
    ]
    free = {
        u.name
        for u in units
        if u.kind == "linear" and not u.split and not u.tied and u.name not in called
    }
    found: list[tuple[Pair, str]] = []
    for pair in pairs:
        names = [*pair.columns, pair.row]
        owner = _owner(names)
        if owner is None or not all(n.startswith(owner + ".") for n, _ in pair.per_rank):
            continue
        parent_name, _, key = owner.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(parent, nn.ModuleList | nn.ModuleDict):
            continue
        original = parent.get_submodule(key)
        shapes = _shapes(original)
        for other, sibling in parent.named_children():
            if other == key or type(sibling) is not type(original) or _shapes(sibling) != shapes:
                continue
            start = f"{parent_name}.{other}" if parent_name else other
            paths = [name for name, _ in pair.per_rank]
            moved = {name: start + name[len(owner) :] for name in [*names, *paths]}
            layers = [moved[name] for name in names]
            if not free.issuperset(layers):
                continue
            free.difference_update(layers)  # a layer joins one pair
            twin = Pair(
                columns={moved[c]: parts for c, parts in pair.columns.items()},
                row=moved[pair.row],
                per_rank=tuple((moved[name], divisor) for name, divisor in pair.per_rank),
                shared={moved[c]: kv for c, kv in pair.shared.items()},
            )
            found.append((twin, owner))
    return found


def _owner(names: list[str]) -> str | None:
    """The deepest module holding all `names` (None: the model itself)."""
    paths = [name.split(".") for name in names]
    common = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    common = common[: min(len(p) for p in paths) - 1]
    return ".".join(common) or None


def _shapes(module: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(name, p.shape, p.dtype) for name, p in module.named_parameters()]
