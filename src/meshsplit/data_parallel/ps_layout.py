"""Which part of the parameters each parameter server owns: the trainable parameters,
flattened in model order, cut into equal ranges at row boundaries (pure arithmetic on
shapes, tested without processes)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import nn

from meshsplit.plan import Plan, PlanError

__all__: list[str] = []


def cut_points(shapes: Sequence[tuple[int, ...]], servers: int) -> list[int]:
    """Where each server's range of the flattened parameters begins (and the last ends):
    `servers` + 1 offsets, each equal share moved to the nearest row boundary."""
    starts = [0]
    for shape in shapes:
        starts.append(starts[-1] + math.prod(shape))
    total, cuts = starts[-1], [0]
    for k in range(1, servers):
        target = round(k * total / servers)
        index = max(i for i in range(len(shapes)) if starts[i] <= target)
        row = math.prod(shapes[index][1:]) if shapes[index] else math.prod(shapes[index])
        cut = starts[index] + round((target - starts[index]) / row) * row
        cuts.append(min(max(cut, cuts[-1]), total))
    cuts.append(total)
    return cuts


def pieces(shapes: Sequence[tuple[int, ...]], low: int, high: int) -> list[tuple[int, tuple]]:
    """The parts of the parameters inside [low, high) of the flattened model, each as
    (offset from low, shape): whole tensors, or a run of rows of one cut at a boundary."""
    found, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        first, last = max(start, low), min(start + size, high)
        if first < last:
            rows = (last - first) // math.prod(shape[1:]) if shape else 1
            found.append((first - low, shape if last - first == size else (rows, *shape[1:])))
        start += size
    return found


def server_ranges(params: Sequence[nn.Parameter], plan: Plan) -> list[tuple[int, int]]:
    """Each server's [low, high) of the flattened trainable parameters: about 1/S each."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise PlanError(
            f"sync='ps' sends each server's part of the parameters as one message, so they "
            f"need one dtype and device; this model has {sorted(str(k) for k in kinds)}; "
            "cast the model (model.float()) or use sync='allreduce'"
        )
    cuts = cut_points([tuple(p.shape) for p in params], plan.server_count)
    ranges = list(itertools.pairwise(cuts))
    if any(low == high for low, high in ranges):
        raise PlanError(
            f"Plan.servers={plan.server_count} leaves a server without parameters: this "
            f"model's {cuts[-1]:,} trainable values split at row boundaries into fewer "
            "parts; use fewer servers"
        )
    return ranges
