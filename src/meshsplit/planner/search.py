"""Every plan for N devices, priced and pruned: numbers in, a ranking out.

The space: dp x pp x tp = N over the tp widths the model can take; for a model with experts,
ep over every divisor of dp that divides the experts; micro-batches (pp, 2pp, 4pp, ... while
they divide the replica's rows; 1 without a pipeline); schedules 1f1b, gpipe, zero-bubble,
interleaved with v = 2 or 4 chunks per rank and zbv (2 in a V) where the model has a
trainable item for each of the pp * v chunks (counted between the places a stage may begin);
recompute never, except the last stage, always; optimizer state whole or sharded over dp
(whole under ep). Beside them, parameter servers at staleness 0: dp = N - S workers (at
least two) and S = 1 or 2 servers (`ps_cost.py`), whole models with no layer or operator
split.
A plan is dropped, with its reason, when a factor cannot apply (the batch does not divide,
the model has fewer trainable items than stages, a layer does not split that wide) or when
its modelled memory passes the budget. The rest are priced by `cost.predict` and ranked.
Every plan, priced or refused, carries the precision the workload was measured under and
the dp reduce dtype asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshsplit.memory.tracker import format_bytes
from meshsplit.plan import Plan, divisors
from meshsplit.planner.cost import Prediction, predict
from meshsplit.planner.expert_cost import ep_widths
from meshsplit.planner.machine import Machine
from meshsplit.planner.schedule_cost import VIRTUAL_STAGES
from meshsplit.planner.workload import Workload

__all__: list[str] = []


@dataclass(frozen=True)
class Ranking:
    """Priced plans fastest first, and the plans that cannot run with why."""

    rows: list[Prediction]
    infeasible: list[tuple[Plan, str]] = field(default_factory=list)


def micro_batch_options(plan: Plan, replica_rows: int, budget: bool) -> list[int]:
    """Micro-batch counts worth pricing for a plan's (dp, pp) on `replica_rows` rows."""
    alone = [1, 2, 4, 8] if budget else [1]
    wanted = alone if plan.pp == 1 else [plan.pp * k for k in (1, 2, 4)]
    return [m for m in wanted if m <= replica_rows and replica_rows % m == 0]


SERVERS = (1, 2)
"""Parameter-server counts the search tries (each takes one of the devices, and at least two
workers are left: servers serve several)."""


def _variants(plan: Plan, trainable: int) -> list[Plan]:
    """Schedules (with chunks per rank), recompute and zero for one (dp, pp, tp, ep, m) of a
    model with `trainable` trainable items; zero only without ep or servers."""
    schedules = [(s, 1) for s in ("1f1b", "gpipe", "zero-bubble")] if plan.pp > 1 else [("1f1b", 1)]
    if plan.pp > 1 and plan.micro_batches % plan.pp == 0:
        schedules += [("interleaved", v) for v in VIRTUAL_STAGES if plan.pp * v <= trainable]
    if plan.pp > 1 and 2 * plan.pp <= trainable:
        schedules.append(("zbv", 2))
    checkpoints = ("never", "except_last", "always") if plan.pp > 1 else ("never", "always")
    zeros = (0, 1, 2, 3) if plan.dp > 1 and plan.ep == 1 and plan.sync != "ps" else (0,)
    return [
        replace(plan, schedule=s, virtual_stages=v, recompute=c, zero=z)
        for s, v in schedules
        for c in checkpoints
        for z in zeros
    ]


def search(
    workload: Workload,
    machine: Machine,
    devices: int,
    *,
    memory_budget: str | int | None = None,
    reduce_dtype: str = "fp32",
) -> Ranking:
    """Price every plan for `devices` devices under the workload's precision; fastest first."""
    common = Plan(
        memory_budget=memory_budget, precision=workload.precision, reduce_dtype=reduce_dtype
    )
    budget = common.budget_bytes
    rows: list[Prediction] = []
    infeasible: list[tuple[Plan, str]] = []
    for shape in _shapes(common, devices):
        dp, pp = shape.dp, shape.pp
        reason = _shape_refusal(workload, shape)
        if reason is not None:
            infeasible.append((shape, reason))
            continue
        replica_rows = workload.global_rows // dp
        options = micro_batch_options(shape, replica_rows, budget is not None)
        if not options:
            infeasible.append(
                (shape, f"{replica_rows} rows per replica do not split into micro-batches "
                 f"for pp={pp}; use a global batch divisible by {dp * pp}")
            )  # fmt: skip
            continue
        trainable = workload.trainable_segments(shape.tp)
        widths = [] if shape.sync == "ps" else ep_widths(workload, dp)
        least = None  # the smallest per-rank need of this shape, for the refusal
        for m in _runnable(workload, shape, options, replica_rows, infeasible):
            for ep in [1, *widths]:
                for plan in _variants(replace(shape, micro_batches=m, ep=ep), trainable):
                    prediction = predict(workload, machine, plan)
                    need = max(*prediction.memory_bytes, prediction.server_bytes)
                    least = need if least is None else min(least, need)
                    if budget is None or need <= budget:
                        rows.append(prediction)
        if budget is not None and least is not None and least > budget:
            infeasible.append(
                (shape, f"memory: needs at least {format_bytes(least)} per rank, over the "
                 f"budget of {format_bytes(budget)}")
            )  # fmt: skip
    rows.sort(key=lambda p: (p.step_time_s, _simplicity(p.plan)))
    return Ranking(rows=rows, infeasible=infeasible)


def _shapes(common: Plan, devices: int) -> list[Plan]:
    """Every dp x pp x tp = devices, then dp = devices - S >= 2 workers beside S servers."""
    shapes = [
        replace(common, dp=dp, pp=pp, tp=devices // (dp * pp))
        for dp in divisors(devices)
        for pp in divisors(devices // dp)
    ]
    return shapes + [
        replace(common, dp=devices - s, sync="ps", servers=s) for s in SERVERS if devices - s >= 2
    ]


def _runnable(
    workload: Workload,
    shape: Plan,
    options: list[int],
    replica_rows: int,
    infeasible: list[tuple[Plan, str]],
) -> list[int]:
    """The micro-batch counts whose micro-batches are big enough for the model; the others
    go to `infeasible` with what the model said."""
    kept = []
    for m in options:
        if replica_rows // m >= workload.min_rows:
            kept.append(m)
            continue
        plan = replace(shape, micro_batches=m, memory_budget=None)
        infeasible.append(
            (plan, f"micro-batch size: {replica_rows // m} rows per micro-batch, and the model "
             f"needs at least {workload.min_rows} ({workload.min_rows_reason}); use fewer "
             f"micro-batches or a bigger batch")
        )  # fmt: skip
    return kept


def _simplicity(plan: Plan) -> tuple[int, int, int, int]:
    """Ties go to the plan with fewer moving parts (servers are one more)."""
    return (
        sum(n > 1 for n in (plan.dp, plan.pp, plan.tp, plan.ep)) + (plan.sync == "ps"),
        plan.recompute != "never",
        int(plan.zero),
        plan.micro_batches,
    )


def _shape_refusal(workload: Workload, plan: Plan) -> str | None:
    """Why (dp, pp, tp) cannot run this model on this batch at all, or None."""
    if plan.tp in workload.refused:
        return f"divisibility: {workload.refused[plan.tp]}"
    if plan.tp not in workload.items:
        return f"tp={plan.tp} was not measured (widths {workload.widths})"
    if workload.global_rows % plan.dp:
        return (
            f"divisibility: the global batch of {workload.global_rows} rows does not split over "
            f"dp={plan.dp}; use a batch divisible by {plan.dp}"
        )
    trainable = workload.trainable_segments(plan.tp)
    if plan.pp > trainable:
        where = "" if workload.cut_starts is None else " between the places a stage may begin"
        return (
            f"layer count: pp={plan.pp} needs a trainable layer per stage and the model has "
            f"{trainable}{where}; use pp <= {trainable}"
        )
    return None
