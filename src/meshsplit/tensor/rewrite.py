"""The operator-split rule: which layer splits how, checked before any process does work.

`plan_splits(model, tp, tp_plan, example=...)` walks the model with no processes and returns
one `Decision` per layer with parameters; `parallelize(model, mesh, tp_plan, example=...)`
applies them. The idea is Megatron's pairing, generalised to convolutions: a column split
feeding a row split costs one all-reduce each way; a lone layer splits only when it is big
enough to pay for its collective. Rationale: docs/internals.md#tensorrewritepy
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from meshsplit.mesh import Mesh
from meshsplit.plan import PlanError
from meshsplit.tensor.collectives import InputCopies
from meshsplit.tensor.conv import CONVOLUTIONS
from meshsplit.tensor.dataflow import Realize, as_it_is, find_pairs
from meshsplit.tensor.experts import experts_decisions
from meshsplit.tensor.fallback import check_ties, choose_rest, set_split, wire
from meshsplit.tensor.forms import parallel_form
from meshsplit.tensor.heads import divide, head_counts
from meshsplit.tensor.hfplan import STYLES, model_plan
from meshsplit.tensor.inside import summed_or_whole
from meshsplit.tensor.layers import tp_group
from meshsplit.tensor.reads import outside_reads
from meshsplit.tensor.twins import twin_pairs
from meshsplit.tensor.units import Decision, Unit, describe, split_sizes, walk

__all__ = ["Decision", "plan_splits", "parallelize"]

SPLITS = {
    "linear": ("column", "row", "replicate"),
    "conv": ("column", "row", "replicate"),
    "embedding": ("vocab", "replicate"),
    "attention": ("heads", "replicate"),
}


def _user_plan(by_name: dict[str, Unit], tp_plan: Mapping[str, str]) -> None:
    for name, split in tp_plan.items():
        if name not in by_name:
            raise PlanError(
                f"Plan.tp_plan names '{name}', which is not a splittable layer of this model; "
                f"use one of {', '.join(sorted(by_name)) or '(none)'}"
            )
        unit = by_name[name]
        if split not in SPLITS[unit.kind]:
            raise PlanError(
                f"Plan.tp_plan['{name}']={split!r} does not fit {describe(unit.module)}; "
                f"use one of {', '.join(SPLITS[unit.kind])}"
            )
        set_split(unit, split, "user plan")


def _refusal(unit: Unit, style: str, tp: int) -> str:
    """Why the model's plan entry `style` cannot be honoured for `unit` ('' when it can)."""
    if unit.split:
        return "Plan.tp_plan sets it or its partner"
    if style not in STYLES:
        return f"the model's plan says {style!r}, which meshsplit has no layer for"
    split = STYLES[style][0]
    if split not in SPLITS[unit.kind] or unit.tied:
        return f"the model's plan says {style!r}, which does not fit {describe(unit.module)}"
    what, size = split_sizes(unit)[split]
    return f"tp={tp} does not divide {what}={size}" if size % tp else ""


def _model_plan(model: nn.Module, by_name: dict[str, Unit], tp: int) -> None:
    """Take the model's own plan, one group of sibling column/row layers at a time."""
    groups: dict[str, list[tuple[Unit, str]]] = {}
    for name, style in model_plan(model).items():
        unit = by_name.get(name)
        if unit is None:
            continue
        if style in ("colwise", "rowwise"):
            groups.setdefault(name.rpartition(".")[0], []).append((unit, style))
            continue
        why = _refusal(unit, style, tp)
        if why:
            unit.note = unit.note or f"model's plan not taken: {why}"
            continue
        split, gather = STYLES[style]
        set_split(unit, split, f"model's tp plan: {style}")
        unit.wiring = {"gather_output": gather} if split == "column" else {}
    for parent, members in groups.items():
        columns = [unit for unit, style in members if style == "colwise"]
        rows = [unit for unit, style in members if style == "rowwise"]
        why = next((w for unit, style in members if (w := _refusal(unit, style, tp))), "")
        if not why and (len(rows) != 1 or not columns):
            why = f"'{parent}' has {len(columns)} colwise and {len(rows)} rowwise entries"
        per_rank, heads, shared = head_counts(model, [parent], tp)
        if shared and not why:  # kv heads ranks share: the data flow finds which layers
            for unit, _ in members:
                unit.note = unit.note or f"model's plan not taken: {shared} kv heads, tp={tp}"
            continue
        if heads and not why:
            for unit, _ in members:
                set_split(
                    unit, "replicate", f"{heads}: attention kept whole (model's plan not taken)"
                )
            continue
        if why:
            for unit, _ in members:
                unit.note = unit.note or f"model's plan not taken: {why}"
            continue
        _pair(columns, rows[0], {}, tuple(per_rank), "model's tp plan")


def _pair(
    columns: list[Unit],
    row: Unit,
    parts: dict[str, int],
    per_rank: tuple[tuple[str, int], ...],
    source: str,
    shared: dict[str, int] | None = None,
) -> None:
    names = ", ".join(f"'{c.name}'" for c in columns)
    for column in columns:
        set_split(column, "column", f"{source}: pairs with '{row.name}'")
        column.parts = parts.get(column.name, 1)
        column.shared = (shared or {}).get(column.name, 0)
        column.after, column.wiring = row, {"gather_output": False}
        if column.parts > 1:
            column.reason += f", fused in {column.parts} parts, each split by heads"
        if column.shared:
            column.reason += (
                f"; its {column.shared} kv heads are shared by the ranks: kept whole, each "
                "rank computes its head, gradients summed over tp"
            )
    set_split(row, "row", f"{source}: pairs with {names}: one all-reduce")
    row.feeders, row.per_rank, row.wiring = list(columns), per_rank, {"scatter_input": False}


_PARAMETRIZED = "its weight is made by a parametrization (torch.nn.utils.parametrize): kept whole"


def _whole_where_read_outside(model: nn.Module, example: Any, units: list[Unit]) -> None:
    """Keep whole every undecided layer whose weight an op reads while no module holding it
    runs (nn.MultiheadAttention's out_proj, a position table added as `pos.weight[:T]`): a
    shard read as the whole tensor fails or trains on wrong rows."""
    free = {unit.name: unit.module for unit in units if not unit.split}
    for name in outside_reads(model, example, free):
        why = "its weight is read outside its own forward, as a whole tensor: kept whole"
        set_split(next(unit for unit in units if unit.name == name), "replicate", why)


def _data_flow(
    model: nn.Module, example: Any, units: list[Unit], tp: int, realize: Realize
) -> set[str]:
    """Pair the Linear/Conv1D layers and plain convolutions no plan set, through the data
    flow of `example`; the names of those the example called."""
    free = [u for u in _flowing(units) if not u.split and not u.tied]
    for unit in free:  # the data flow replaces Sequential neighbours for these layers
        if unit.after is not None:
            unit.after.feeders.remove(unit)
        for feeder in unit.feeders:
            feeder.after = None
        unit.after, unit.feeders = None, []
    by_name = {unit.name: unit for unit in free}
    pairs, refused, called = find_pairs(
        model, example, {u.name: u.module for u in free}, tp, realize
    )
    for pair in pairs:
        columns = [by_name[name] for name in pair.columns]
        _pair(columns, by_name[pair.row], pair.columns, pair.per_rank, "data flow", pair.shared)
    for refusal in refused:
        for name in refusal.names:
            if refusal.replicate:
                set_split(by_name[name], "replicate", f"{refusal.reason}: attention kept whole")
            else:
                by_name[name].note = f"data-flow pair not taken: {refusal.reason}"
    return called


def _flowing(units: list[Unit]) -> list[Unit]:
    """The layers the data flow pairs: Linear/Conv1D, and plain convolutions except those
    linked, as nn.Sequential neighbours (directly or through others), to a transposed one,
    which pairs with its neighbours only."""
    held: set[int] = set()
    for unit in units:
        if unit.kind == "conv" and not isinstance(unit.module, CONVOLUTIONS):
            stack, seen = [unit], {id(unit)}
            while stack:
                current = stack.pop()
                for linked in [*current.feeders, current.after]:
                    if linked is not None and id(linked) not in seen:
                        seen.add(id(linked))
                        stack.append(linked)
            held |= seen
    return [u for u in units if u.kind in ("linear", "conv") and id(u) not in held]


def _summed_inside_pairs(
    model: nn.Module, example: Any, units: list[Unit], others: list[Decision]
) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Layer kept whole that reads a pair's split values -> (the pair's row, its parameters),
    their gradients summed over tp; a pair that reads what no such sum mends is kept whole."""
    pairs = {u.name: [c.name for c in u.feeders] for u in units if u.split == "row" and u.feeders}
    names = [d.name for d in others] + [u.name for u in units if u.split == "replicate"]
    holders = {name: model.get_submodule(name) for name in names}
    if not pairs:  # nothing to look for: no forward
        return {}
    decided = {unit.name for unit in units} | {d.name for d in others}
    summed, whole = summed_or_whole(model, example, pairs, holders, decided)
    by_name = {unit.name: unit for unit in units}
    for row_name, reason in whole.items():
        row = by_name[row_name]
        for unit in [*row.feeders, row]:
            set_split(unit, "replicate", f"kept whole with its partners: {reason}")
            unit.after, unit.feeders, unit.per_rank, unit.wiring = None, [], (), {}
            unit.parts, unit.shared = 1, 0
    return summed


def _working(sizes: list[int]) -> str:
    """The tp values that divide every size, as '{1, 2, 4, 8, ...}'."""
    common = math.gcd(*sizes)
    values = [d for d in range(1, common + 1) if common % d == 0]
    shown = ", ".join(map(str, values[:6]))
    return "{" + shown + (", ...}" if len(values) > 6 else "}")


def plan_splits(
    model: nn.Module,
    tp: int,
    tp_plan: Mapping[str, str] | None = None,
    *,
    example: Any = None,
    realize: Realize = as_it_is,
) -> list[Decision]:
    """Decide every layer's split for `tp` ranks without processes (raises PlanError).

    `example`: one input of the model (called as `batch.call_model(model, example)`), to find
    column/row pairs through its data flow; without it only nn.Sequential neighbours pair.
    """
    units, others = walk(model)
    by_name = {unit.name: unit for unit in units}
    summed: dict[str, tuple[str, tuple[str, ...]]] = {}
    total = sum(p.numel() for p in model.parameters())
    _user_plan(by_name, tp_plan or {})
    for unit in units:  # a parallel layer would hold the computed weight and drop the rule
        if not unit.split and parametrize.is_parametrized(unit.module):
            set_split(unit, "replicate", _PARAMETRIZED)
    if tp > 1:
        _model_plan(model, by_name, tp)
        if example is not None:
            _whole_where_read_outside(model, example, units)
            called = _data_flow(model, example, units, tp, realize)
            summed = _summed_inside_pairs(model, example, units, others)
            mended = {row for row, _ in summed.values()}
            for twin, original in twin_pairs(model, units, called, mended):
                columns = [by_name[name] for name in twin.columns]
                source = f"as in '{original}', its twin that the example ran"
                _pair(columns, by_name[twin.row], twin.columns, twin.per_rank, source, twin.shared)
            others = experts_decisions(model, example, others, tp, realize, set(summed))
    choose_rest(units, tp, total)
    check_ties(units)
    required = [(unit, unit.required) for unit in units if unit.required is not None]
    for unit, (what, size) in required:
        if size % tp:
            sizes = [size for _, (_, size) in required]
            raise PlanError(
                f"Plan.tp={tp} does not divide {type(unit.module).__name__} '{unit.name}' "
                f"{what}={size}; use tp in {_working(sizes)}"
            )
    wire(units)
    decisions = [
        Decision(
            name=unit.name,
            layer=describe(unit.module),
            split=unit.split,
            reason=unit.reason,
            gather_output=unit.wiring.get("gather_output", False),
            scatter_input=unit.wiring.get("scatter_input", False),
            parts=unit.parts,
            per_rank=unit.per_rank if unit.split == "row" else (),
            shared=unit.shared if unit.split == "column" else 0,
            summed=_whole_weights(unit) if unit.split == "column" and unit.shared else (),
            tied=", ".join(o.name for o in unit.tied) if unit.split != "replicate" else "",
        )
        for unit in units
    ]
    if tp > 1 and all(d.split == "replicate" for d in decisions):
        why = "; ".join(f"{d.name}: {d.reason}" for d in decisions + others)
        raise PlanError(
            f"Plan.tp={tp} splits no layer of {type(model).__name__}: "
            f"{why or 'no Linear or convolution'}; use tp=1"
        )
    decisions = [
        _with_sum(d, summed[d.name]) if d.name in summed else d for d in decisions + others
    ]
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(decisions, key=lambda d: order.get(d.name, len(order)))


def _whole_weights(unit: Unit) -> tuple[str, ...]:
    """A layer's own parameters, by their names in the model (a column sharing kv heads keeps
    them whole and sums their gradients over tp)."""
    return tuple(f"{unit.name}.{name}" for name, _ in unit.module.named_parameters(recurse=False))


def _with_sum(decision: Decision, inside: tuple[str, tuple[str, ...]]) -> Decision:
    row, parameters = inside
    why = f"; runs inside the pair of '{row}' on split values: gradients summed over tp"
    return replace(decision, reason=decision.reason + why, summed=parameters)


def parallelize(
    model: nn.Module,
    mesh: Mesh | dist.ProcessGroup,
    tp_plan: Mapping[str, str] | None = None,
    *,
    example: Any = None,
    realize: Realize = as_it_is,
) -> list[Decision]:
    """Split `model` in place over the tp group; every tp rank must call it on the same model.

    Returns one Decision per layer with parameters, in model order. Tied layers end up holding
    one shared shard parameter; the per-rank head counts the row layers name are divided.
    `realize(layer)` holds the layer's weights while its shard is cut from them (a model each
    rank builds in parts keeps them elsewhere).
    """
    group = tp_group(mesh)
    tp = dist.get_world_size(group)
    decisions = plan_splits(model, tp, tp_plan, example=example, realize=realize)
    aliased = _held_twice(model)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id: original, its shard
    copies = InputCopies()  # columns reading one tensor enter the region through one copy
    for decision in decisions:
        if decision.split == "replicate":
            continue
        parent_name, _, child_name = decision.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        original = parent.get_submodule(child_name)
        own = dict(original.named_parameters(recurse=False))  # before realize lends copies
        with realize(original):
            split = parallel_form(original, decision, group)
        if decision.tied and id(own["weight"]) in replaced:
            split.weight = replaced[id(own["weight"])][1]
        for name, param in own.items():
            if id(param) in aliased and isinstance(getattr(split, name, None), nn.Parameter):
                replaced.setdefault(id(param), (param, getattr(split, name)))
        if decision.split == "column":
            split.input_copies = copies  # type: ignore[assignment]
        setattr(parent, child_name, split)
        divide(model, decision.per_rank)
    _repoint(model, replaced)
    return decisions


def _held_twice(model: nn.Module) -> set[int]:
    """Ids of the parameters held under more than one name (tied weights, aliases)."""
    seen: set[int] = set()
    twice: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (twice if id(param) in seen else seen).add(id(param))
    return twice


def _repoint(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Every other holder of a parameter a split replaced now holds its shard: BERT's
    `predictions.bias`, the same tensor as its decoder's bias, follows the decoder's split."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            original, shard = replaced.get(id(param), (None, None))
            if original is param and shard is not None:
                setattr(module, name, shard)
