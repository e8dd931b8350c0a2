"""The operator-split rule: which layer splits how, checked before any process does work.

`plan_splits(model, tp, tp_plan)` is pure (no processes): it walks the model and returns one
`Decision` per layer that holds parameters. `parallelize(model, mesh, tp_plan)` applies them.

The rule, Megatron's pairing generalised to convolutions:
1. Attention (a module with Linear children q, k, v, out and an int `n_heads`) splits by heads:
   one all-reduce in forward, one in backward.
2. In an `nn.Sequential`, a Linear followed by a Linear (or a Conv2d by a Conv2d) with only
   elementwise layers between them (ReLU, GELU, dropout, ...; pooling too between convs) is a
   pair: the first splits by columns (output), the second by rows (input). The split activation
   flows between them untouched: one all-reduce in forward, one in backward, per pair.
3. A layer left alone (no partner) splits by columns with its output gathered (Linear, Conv2d)
   or by vocabulary (Embedding) when tp divides it and it holds at least 1% of the model's
   parameters; otherwise it is replicated, since a split would save little and still cost a
   collective. Norms and any other layer with parameters are replicated.
4. A user plan {"name": "column" | "row" | "vocab" | "heads" | "replicate"} overrides the rule
   for the layers it names.

Layers of rules 1, 2 and 4 must split: a tp that does not divide them raises `PlanError`
naming the layer, its size and the tp values that divide every such layer.

Replicated parameters (norms, row layers' biases, layers kept whole) get no gradient
all-reduce over tp. We chose that over averaging because they see the same inputs and output
gradients on every tp rank — every region boundary is an all-reduce or all-gather, which hands
each rank the same bits — so their gradients are equal by construction and an average would
be a collective per step that changes nothing (the tests check the bits stay equal). It holds
while the replicated layers are deterministic given their inputs: dropout outside a split
region needs the same RNG state on every tp rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.plan import PlanError
from meshsplit.tensor.attention import HeadParallelAttention, split_heads
from meshsplit.tensor.layers import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelLayer,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_group,
)

__all__ = ["Decision", "plan_splits", "parallelize"]

SMALL_FRACTION = 0.01
"""A lone layer with less than this share of the model's parameters is replicated."""

ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Hardswish,
    nn.Dropout,
    nn.Identity,
)
CHANNELWISE = (*ELEMENTWISE, nn.MaxPool2d, nn.AvgPool2d, nn.Dropout2d)

SPLITS = {
    "linear": ("column", "row", "replicate"),
    "conv": ("column", "row", "replicate"),
    "embedding": ("vocab", "replicate"),
    "attention": ("heads", "replicate"),
}


@dataclass(frozen=True, kw_only=True)
class Decision:
    """How one layer is split over tp, and why."""

    name: str
    """The layer's module name in the model, e.g. 'block0.attn'."""
    layer: str
    """What the layer is, e.g. 'Linear(784->1024)'."""
    split: str
    """'column', 'row', 'vocab', 'heads' or 'replicate'."""
    reason: str
    """One line of why."""
    gather_output: bool = False
    """Column split only: gather the split output, since no row layer consumes it."""
    scatter_input: bool = False
    """Row split only: slice a replicated input, since no column layer feeds it split."""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layer": self.layer, "split": self.split, "reason": self.reason}


@dataclass
class _Unit:
    """A layer the rule can split, with its neighbours inside an nn.Sequential."""

    name: str
    module: nn.Module
    kind: str
    before: _Unit | None = None
    after: _Unit | None = None
    split: str = ""
    reason: str = ""
    required: tuple[str, int] | None = None
    """(what, size) that tp must divide, for a split that must happen."""
    extra: dict[str, bool] = field(default_factory=dict)


def _is_attention(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return isinstance(getattr(module, "n_heads", None), int) and all(
        isinstance(children.get(name), nn.Linear) for name in ("q", "k", "v", "out")
    )


def _kind(module: nn.Module) -> str | None:
    if _is_attention(module):
        return "attention"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros":
        return "conv"
    if isinstance(module, nn.Embedding) and not (
        module.padding_idx is not None or module.max_norm is not None or module.sparse
    ):
        return "embedding"
    return None


def _describe(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return f"Linear({module.in_features}->{module.out_features})"
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return f"Conv2d({module.in_channels}->{module.out_channels}, {kh}x{kw})"
    if isinstance(module, nn.Embedding):
        return f"Embedding({module.num_embeddings}x{module.embedding_dim})"
    if _is_attention(module):
        return f"{type(module).__name__}({module.n_heads} heads)"
    return type(module).__name__


def _split_sizes(unit: _Unit) -> dict[str, tuple[str, int]]:
    """For each split of this unit: the dimension it divides, as (name, size)."""
    m: Any = unit.module
    if unit.kind == "linear":
        return {"column": ("out_features", m.out_features), "row": ("in_features", m.in_features)}
    if unit.kind == "conv":
        return {"column": ("out_channels", m.out_channels), "row": ("in_channels", m.in_channels)}
    if unit.kind == "embedding":
        return {"vocab": ("num_embeddings", m.num_embeddings)}
    return {"heads": ("n_heads", m.n_heads)}


def _walk(model: nn.Module) -> tuple[list[_Unit], list[Decision]]:
    """Every splittable layer (linked to its Sequential neighbours) and every other holder."""
    shared = _shared_parameters(model)
    units: list[_Unit] = []
    others: list[Decision] = []

    def visit(module: nn.Module, prefix: str) -> None:
        chain = isinstance(module, nn.Sequential)
        previous: _Unit | None = None  # the last Linear/Conv2d, with only elementwise since
        for child_name, child in module.named_children():
            name = prefix + child_name
            if isinstance(child, ParallelLayer | HeadParallelAttention):
                raise PlanError(f"'{name}' is already split over tp; split a model only once")
            kind = _kind(child)
            if kind is not None and any(id(p) in shared for p in child.parameters()):
                others.append(_replicated(name, child, "shares a parameter with another layer"))
                kind = None
            elif kind is not None:
                unit = _Unit(name=name, module=child, kind=kind)
                units.append(unit)
                if chain and previous is not None and previous.kind == kind:
                    previous.after, unit.before = unit, previous
                previous = unit if kind in ("linear", "conv") else None
                continue
            after_conv = previous is not None and previous.kind == "conv"
            if not isinstance(child, CHANNELWISE if after_conv else ELEMENTWISE):
                previous = None
            if kind is None and any(True for _ in child.parameters(recurse=False)):
                others.append(_replicated(name, child, "norm or other layer kept whole"))
            visit(child, name + ".")

    visit(model, "")
    return units, others


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _replicated(name: str, module: nn.Module, why: str) -> Decision:
    return Decision(name=name, layer=_describe(module), split="replicate", reason=why)


def _choose(units: list[_Unit], tp: int, tp_plan: Mapping[str, str], total: int) -> None:
    """Fill in each unit's split and reason: user plan, attention, pairs, then lone layers."""
    by_name = {unit.name: unit for unit in units}
    for name, split in tp_plan.items():
        if name not in by_name:
            raise PlanError(
                f"Plan.tp_plan names '{name}', which is not a splittable layer of this model; "
                f"use one of {', '.join(sorted(by_name)) or '(none)'}"
            )
        unit = by_name[name]
        if split not in SPLITS[unit.kind]:
            raise PlanError(
                f"Plan.tp_plan['{name}']={split!r} does not fit {_describe(unit.module)}; "
                f"use one of {', '.join(SPLITS[unit.kind])}"
            )
        unit.split, unit.reason = split, "user plan"
        if split != "replicate":
            unit.required = _split_sizes(unit)[split]
    for unit in units:
        if unit.split:
            continue
        if unit.kind == "attention":
            unit.split, unit.reason = "heads", "by heads: q/k/v column, out row"
            unit.required = _split_sizes(unit)["heads"]
        elif unit.after is not None and unit.after.split in ("", "row"):
            partner = unit.after
            unit.split, unit.reason = "column", f"pairs with '{partner.name}'"
            if not partner.split:
                partner.split, partner.reason = "row", f"pairs with '{unit.name}': one all-reduce"
                partner.required = _split_sizes(partner)["row"]
            unit.required = _split_sizes(unit)["column"]
    for unit in units:
        if not unit.split:
            _choose_lone(unit, tp, total)


def _choose_lone(unit: _Unit, tp: int, total: int) -> None:
    split = "vocab" if unit.kind == "embedding" else "column"
    what, size = _split_sizes(unit)[split]
    count = sum(p.numel() for p in unit.module.parameters())
    if size % tp:
        unit.split, unit.reason = "replicate", f"tp={tp} does not divide {what}={size}"
    elif count < SMALL_FRACTION * total:
        unit.split = "replicate"
        unit.reason = f"small ({count} of {total} parameters); a split would not pay"
    else:
        unit.split = split
        unit.reason = "no partner: output gathered" if split == "column" else "by vocabulary rows"


def _wire(units: list[_Unit]) -> None:
    """A column gathers unless a row consumes it; a row slices unless a column feeds it."""
    for unit in units:
        if unit.split == "column":
            unit.extra["gather_output"] = not (unit.after and unit.after.split == "row")
        if unit.split == "row":
            unit.extra["scatter_input"] = not (unit.before and unit.before.split == "column")


def _working(sizes: list[int]) -> str:
    """The tp values that divide every size, as '{1, 2, 4, 8, ...}'."""
    common = math.gcd(*sizes)
    values = [d for d in range(1, common + 1) if common % d == 0]
    shown = ", ".join(map(str, values[:6]))
    return "{" + shown + (", ...}" if len(values) > 6 else "}")


def plan_splits(
    model: nn.Module, tp: int, tp_plan: Mapping[str, str] | None = None
) -> list[Decision]:
    """Decide every layer's split for `tp` ranks without touching processes (raises PlanError)."""
    units, others = _walk(model)
    total = sum(p.numel() for p in model.parameters())
    _choose(units, tp, tp_plan or {}, total)
    required = [(unit, unit.required) for unit in units if unit.required is not None]
    for unit, (what, size) in required:
        if size % tp:
            sizes = [size for _, (_, size) in required]
            raise PlanError(
                f"Plan.tp={tp} does not divide {type(unit.module).__name__} '{unit.name}' "
                f"{what}={size}; use tp in {_working(sizes)}"
            )
    _wire(units)
    decisions = [
        Decision(
            name=unit.name,
            layer=_describe(unit.module),
            split=unit.split,
            reason=unit.reason,
            gather_output=unit.extra.get("gather_output", False),
            scatter_input=unit.extra.get("scatter_input", False),
        )
        for unit in units
    ]
    if tp > 1 and all(d.split == "replicate" for d in decisions):
        raise PlanError(
            f"Plan.tp={tp} splits no layer of {type(model).__name__}: "
            f"{'; '.join(f'{d.name}: {d.reason}' for d in decisions) or 'no Linear/Conv2d'}; "
            "use tp=1"
        )
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(decisions + others, key=lambda d: order.get(d.name, len(order)))


def _split_module(module: nn.Module, decision: Decision, group: dist.ProcessGroup) -> nn.Module:
    if decision.split == "heads":
        return split_heads(module, group)
    if decision.split == "vocab":
        return VocabParallelEmbedding.from_module(module, group)  # type: ignore[arg-type]
    conv = isinstance(module, nn.Conv2d)
    if decision.split == "column":
        column = ColumnParallelConv2d if conv else ColumnParallelLinear
        return column.from_module(module, group, gather_output=decision.gather_output)  # type: ignore[arg-type]
    row = RowParallelConv2d if conv else RowParallelLinear
    return row.from_module(module, group, scatter_input=decision.scatter_input)  # type: ignore[arg-type]


def parallelize(
    model: nn.Module, mesh: Mesh | dist.ProcessGroup, tp_plan: Mapping[str, str] | None = None
) -> list[Decision]:
    """Split `model` in place over the tp group; every tp rank must call it on the same model.

    Returns one Decision per layer with parameters, in model order.
    """
    group = tp_group(mesh)
    decisions = plan_splits(model, dist.get_world_size(group), tp_plan)
    for decision in decisions:
        if decision.split == "replicate":
            continue
        parent_name, _, child_name = decision.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        split = _split_module(parent.get_submodule(child_name), decision, group)
        setattr(parent, child_name, split)
    return decisions
