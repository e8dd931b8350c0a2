"""What each rank will hold: the per-rank estimate, the budget check and the cheapest fix.

The figures come from a simulated step (`meshsplit.planner.simulate`); this module only holds them,
compares them with Plan.memory_budget and, when a plan does not fit, searches the nearby
plans — cheapest change first — for one that does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from meshsplit.memory.tracker import Sample, describe_breakdown, format_bytes
from meshsplit.plan import Plan, PlanError

__all__ = ["MemoryEstimate", "RankEstimate"]


@dataclass(frozen=True)
class RankEstimate:
    """The predicted peak of live tensor bytes of one global rank during one train_step."""

    rank: int
    coordinates: dict[str, int]
    """This rank's place on the mesh: {'dp': d, 'pp': s, 'tp': t}."""
    peak_bytes: int
    breakdown: dict[str, int]
    """Bytes by category at the peak: parameters (and module buffers), gradients, optimizer,
    activations (saved for backward), buffers (communication), temporaries."""
    phase: str
    """Where the peak falls, e.g. 'backward, micro-batch 3'."""
    timeline: list[Sample] = field(default_factory=list, compare=False, repr=False)
    """Live bytes by category after each allocation and free of the simulated step."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "coordinates": self.coordinates,
            "peak_bytes": self.peak_bytes,
            "breakdown": self.breakdown,
            "phase": self.phase,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Every rank's estimate under one plan, and what to change when it does not fit."""

    plan: Plan
    """The plan as estimated (pipeline stage sizes pinned to the ones the profile chose)."""
    ranks: list[RankEstimate]
    fix: str | None = None
    """The cheapest change that fits Plan.memory_budget, when the plan does not."""

    @property
    def peak_bytes(self) -> int:
        """The largest rank's peak: what a uniform budget must allow."""
        return max(rank.peak_bytes for rank in self.ranks)

    @property
    def fits(self) -> bool:
        """Whether every rank stays within Plan.memory_budget (True without a budget)."""
        budget = self.plan.budget_bytes
        return budget is None or self.peak_bytes <= budget

    def over_budget(self) -> list[RankEstimate]:
        budget = self.plan.budget_bytes
        return [] if budget is None else [r for r in self.ranks if r.peak_bytes > budget]

    def check(self) -> None:
        """Raise PlanError naming each rank over budget, its breakdown and the fix."""
        over = self.over_budget()
        if not over:
            return
        lines = [
            f"rank {r.rank} needs {format_bytes(r.peak_bytes)} at {r.phase} "
            f"({describe_breakdown(r.breakdown)})"
            for r in over
        ]
        raise PlanError(
            f"Plan {self.plan.describe()} does not fit Plan.memory_budget="
            f"{self.plan.memory_budget!r} ({format_bytes(self.plan.budget_bytes or 0)} per "
            f"rank): " + "; ".join(lines) + f". {self.fix or 'No nearby plan fits.'}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.as_dict(),
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "fix": self.fix,
            "ranks": [rank.as_dict() for rank in self.ranks],
        }


def candidate_fixes(plan: Plan, batch_rows: int) -> Iterator[tuple[str, Plan]]:
    """Plans near `plan` on the same processes and batch, roughly cheapest change first.

    Order: a schedule that holds fewer micro-batches, more micro-batches (smaller ones),
    recompute on more stages, then the same processes arranged with more layer or operator
    split (each halves what a rank holds of the model, at the price of traffic).
    """
    if plan.pp > 1 and plan.schedule != "1f1b":
        # GPipe holds every micro-batch, interleaving more chunks on the first ranks, zero
        # bubble each graph until its W; 1F1B's cuts are one per stage, not per chunk
        whole = plan.virtual_stages == 1
        yield (
            "schedule='1f1b'",
            replace(
                plan,
                schedule="1f1b",
                virtual_stages=1,
                stages=plan.stages if whole else None,
                split_points=plan.split_points if whole else None,
            ),
        )
    for factor in (2, 4):
        micro = plan.micro_batches * factor
        if batch_rows % (plan.dp * micro) == 0:
            yield f"micro_batches={micro}", replace(plan, micro_batches=micro)
    order = ("never", "except_last", "always")
    if plan.recompute in order:
        for policy in order[order.index(plan.recompute) + 1 :]:
            if policy != "except_last" or plan.pp > 1:
                yield f"recompute={policy!r}", replace(plan, recompute=policy)
    world = plan.world_size
    meshes = [
        (dp, pp, world // (dp * pp))
        for pp in range(1, world + 1)
        for dp in range(1, world + 1)
        if world % (dp * pp) == 0 and (dp, pp, world // (dp * pp)) != (plan.dp, plan.pp, plan.tp)
    ]
    meshes.sort(key=lambda m: (m[1] * m[2], m[2]))
    for dp, pp, tp in meshes:
        if pp * tp <= plan.pp * plan.tp or batch_rows % (dp * plan.micro_batches):
            continue
        micro = max(plan.micro_batches, pp)
        if batch_rows % (dp * micro):
            micro = plan.micro_batches
        yield (
            f"dp={dp}, pp={pp}, tp={tp}",
            replace(plan, dp=dp, pp=pp, tp=tp, micro_batches=micro, stages=None, split_points=None),
        )


def find_fix(
    plan: Plan, batch_rows: int, estimate: Callable[[Plan], MemoryEstimate], tries: int = 6
) -> str:
    """The first nearby plan whose estimate fits, said as a sentence; or the smallest need."""
    budget = plan.budget_bytes or 0
    best: tuple[int, str] | None = None
    for count, (change, candidate) in enumerate(candidate_fixes(plan, batch_rows)):
        if count >= tries:
            break
        try:
            result = estimate(candidate)
        except PlanError:
            continue
        if result.peak_bytes <= budget:
            return (
                f"With {change} the largest rank needs {format_bytes(result.peak_bytes)}: "
                f"that fits."
            )
        if best is None or result.peak_bytes < best[0]:
            best = (result.peak_bytes, change)
    if best is None:
        return "No nearby plan could be estimated."
    return (
        f"No nearby plan fits: the smallest per-rank need found is "
        f"{format_bytes(best[0])} (with {best[1]}); raise the budget or use more devices."
    )
