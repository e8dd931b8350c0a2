"""The rule for the layers no plan and no data flow decided, applied last: attention by heads,
Sequential neighbours as pairs, tied embeddings together, then lone layers when big enough to
pay for their collective; and the wiring each split implies for its neighbours."""

from __future__ import annotations

from meshsplit.plan import PlanError
from meshsplit.tensor.units import Unit, split_sizes

__all__: list[str] = []

SMALL_FRACTION = 0.01
"""A lone layer with less than this share of the model's parameters is replicated."""


def set_split(unit: Unit, split: str, reason: str) -> None:
    """Record a unit's split and why; a split also records the size tp must divide."""
    unit.split, unit.reason = split, reason
    if split != "replicate":
        unit.required = split_sizes(unit)[split]


def choose_rest(units: list[Unit], tp: int, total: int) -> None:
    """Fill in the splits no plan set: attention, Sequential pairs, ties, then lone layers."""
    for unit in units:
        if unit.split:
            continue
        if unit.kind == "attention":
            set_split(unit, "heads", "by heads: q/k/v column, out row")
        elif unit.after is not None and unit.after.split in ("", "row"):
            partner = unit.after
            set_split(unit, "column", f"pairs with '{partner.name}'")
            if not partner.split:
                set_split(partner, "row", f"pairs with '{unit.name}': one all-reduce")
    for unit in units:
        if unit.tied and not unit.split:
            _choose_tie([unit, *unit.tied], tp)
    for unit in units:
        if not unit.split:
            _choose_lone(unit, tp, total)


def _choose_tie(group: list[Unit], tp: int) -> None:
    """The tied embeddings by vocab rows and their Linear column-split over the same rows
    (one shard), or none of them."""
    embeddings = [unit for unit in group if unit.kind == "embedding"]
    rows = split_sizes(embeddings[0])["vocab"][1]
    fits = all(
        unit.split in ("", "vocab" if unit.kind == "embedding" else "column") for unit in group
    )
    if rows % tp or not fits:
        why = f"tp={tp} does not divide num_embeddings={rows}" if rows % tp else "a plan keeps it"
        for member in group:
            if not member.split:
                set_split(member, "replicate", f"tied weight kept whole: {why}")
        return
    for unit in group:
        others = ", ".join(f"'{other.name}'" for other in unit.tied)
        if unit.kind == "embedding":
            set_split(unit, "vocab", f"by vocabulary rows, tied to {others}: one shared shard")
        else:
            set_split(unit, "column", f"tied to {others}: the same vocabulary rows, gathered")
            unit.wiring = {"gather_output": True}


def check_ties(units: list[Unit]) -> None:
    """Tied layers split together or not at all: one weight cannot be both a shard and whole."""
    for unit in units:
        splits = {member.name: member.split for member in [unit, *unit.tied]}
        if unit.tied and len({split == "replicate" for split in splits.values()}) > 1:
            said = ", ".join(f"'{name}': {split!r}" for name, split in splits.items())
            raise PlanError(
                f"Plan.tp_plan splits layers that share one weight differently ({said}); "
                "give the embeddings 'vocab' and the output layer 'column', or all 'replicate'"
            )


def _choose_lone(unit: Unit, tp: int, total: int) -> None:
    """A layer nothing paired: split alone (output gathered) when tp divides it and it holds
    at least SMALL_FRACTION of the model, else replicated."""
    split = "vocab" if unit.kind == "embedding" else "column"
    what, size = split_sizes(unit)[split]
    count = sum(p.numel() for p in unit.module.parameters())
    note = f"{unit.note}; " if unit.note else ""
    if size % tp:
        unit.split, unit.reason = "replicate", f"{note}tp={tp} does not divide {what}={size}"
    elif count < SMALL_FRACTION * total:
        unit.split = "replicate"
        unit.reason = f"{note}small ({count} of {total} parameters); a split would not pay"
    else:
        unit.split = split
        lone = "no partner: output gathered" if split == "column" else "by vocabulary rows"
        unit.reason = note + lone


def wire(units: list[Unit]) -> None:
    """A column gathers unless a row consumes it; a row slices unless columns feed it split."""
    for unit in units:
        if unit.split == "column" and "gather_output" not in unit.wiring:
            unit.wiring["gather_output"] = not (unit.after and unit.after.split == "row")
        if unit.split == "column" and unit.after is not None and unit.after.split != "row":
            unit.wiring["gather_output"] = True
        if unit.split == "row" and "scatter_input" not in unit.wiring:
            fed = bool(unit.feeders) and all(f.split == "column" for f in unit.feeders)
            unit.wiring["scatter_input"] = not fed
        if unit.split == "column" and unit.wiring["gather_output"]:
            unit.parts = 1
