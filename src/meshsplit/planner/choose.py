"""`choose_plan`: measure the model once, price every plan for N devices, rank and explain.

The model is measured in this process (`measure.py`), the machine's links come from the
calibration cache (or a cluster file in paper mode), every plan is priced (`search.py`),
and the fastest few are given the exact per-rank memory estimate of `simulate.py` (the
rest keep the cost model's memory). A plan whose estimate passes the budget moves to the
infeasible list with the estimate's numbers. Under mixed precision the model is measured
under the autocast its workers will run (a cluster on paper computes at that dtype's FLOP/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from meshsplit.batch import LossFn
from meshsplit.job.worker import threads_per_worker
from meshsplit.plan import Plan, PlanError, divisors
from meshsplit.planner.calibrate import cached_machine
from meshsplit.planner.cluster import load_cluster
from meshsplit.planner.cost import Prediction, predict
from meshsplit.planner.explain import reason
from meshsplit.planner.machine import Machine
from meshsplit.planner.measure import measure_workload
from meshsplit.planner.search import search
from meshsplit.planner.sharing import measure_sharing
from meshsplit.planner.simulate import estimate_memory, rank_coordinates
from meshsplit.planner.workload import Workload
from meshsplit.runtime.parallelize import OptimizerFactory

__all__ = ["PlanReport", "PlanRow", "choose_plan"]


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One feasible plan as the planner sees it."""

    plan: Plan
    step_time_s: float
    peak_bytes: list[int]
    """Predicted peak live tensor bytes per global rank."""
    terms: dict[str, float]
    """compute, recompute, communication_tp/pp/dp/ep, bubble, optimizer, sharing, overhead."""
    reason: str | None
    """Why it lost to the best plan (None for the best)."""
    memory_source: str
    """'estimate' (the per-rank simulation) or 'model' (the cost model's sum)."""
    prediction: Prediction = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.describe(),
            "shape": self.plan.as_dict(),
            "step_time_s": self.step_time_s,
            "peak_bytes": self.peak_bytes,
            "terms": self.terms,
            "reason": self.reason,
            "memory_source": self.memory_source,
            "stages": list(self.prediction.stages),
            "bytes_per_step": self.prediction.bytes_per_step,
        }


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Every plan for `devices` devices: the feasible ones fastest first, and the rest."""

    devices: int
    rows: list[PlanRow]
    infeasible: list[tuple[Plan, str]]
    machine: Machine

    @property
    def best(self) -> Plan:
        return self.rows[0].plan

    def as_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "best": self.best.describe(),
            "rows": [row.as_dict() for row in self.rows],
            "infeasible": [
                {"plan": plan.describe(), "shape": plan.as_dict(), "reason": why}
                for plan, why in self.infeasible
            ],
            "machine": self.machine.as_dict(),
        }


def choose_plan(
    model: nn.Module,
    example_batch: tuple[Any, Any],
    devices: int,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    memory_budget: str | int | None = None,
    cluster: str | None = None,
    machine: Machine | None = None,
    estimate_top: int = 3,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
) -> PlanReport:
    """Rank every plan for `devices` devices on the global `example_batch`, and explain.

    `cluster`: a cluster file or a shipped name ('dgx-a100', 'dgx-h100', 'dgx-h200'), to
    price a machine that is not here; `machine`: links and cores given as numbers.
    `precision` and `reduce_dtype` (as in Plan) hold for every plan ranked.
    """
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise PlanError(f"devices={devices!r} must be a positive integer; e.g. devices=4")
    # a bad budget or precision is refused before any work
    Plan(memory_budget=memory_budget, precision=precision, reduce_dtype=reduce_dtype)
    workload, machine = pricing(
        model,
        example_batch,
        devices,
        widths=divisors(devices),
        optimizer=optimizer,
        loss_fn=loss_fn,
        cluster=cluster,
        machine=machine,
        precision=precision,
    )
    ranking = search(
        workload, machine, devices, memory_budget=memory_budget, reduce_dtype=reduce_dtype
    )
    infeasible = list(ranking.infeasible)
    rows: list[PlanRow] = []
    for prediction in ranking.rows:
        plan = _pinned(prediction)
        memory, source = _per_rank(prediction), "model"
        if len(rows) < estimate_top and plan.sync != "ps":  # the estimate covers allreduce
            try:
                estimate = estimate_memory(
                    model, plan, example_batch, optimizer=optimizer, loss_fn=loss_fn
                )
            except PlanError as error:
                infeasible.append((plan, str(error)))
                continue
            if not estimate.fits:
                worst = max(estimate.ranks, key=lambda r: r.peak_bytes)
                infeasible.append(
                    (plan, f"memory: the estimate of rank {worst.rank} is {worst.peak_bytes} "
                     f"bytes at {worst.phase}, over the budget")
                )  # fmt: skip
                continue
            memory, source, plan = [r.peak_bytes for r in estimate.ranks], "estimate", estimate.plan
        rows.append(
            PlanRow(
                plan=plan,
                step_time_s=prediction.step_time_s,
                peak_bytes=memory,
                terms=dict(prediction.terms),
                reason=None,
                memory_source=source,
                prediction=prediction,
            )
        )
    if not rows:
        reasons = "; ".join(f"{plan.describe()}: {why}" for plan, why in infeasible[:6])
        raise PlanError(
            f"no plan runs this model on devices={devices}"
            + (f" within memory_budget={memory_budget!r}" if memory_budget else "")
            + f": {reasons}"
        )
    best = rows[0].prediction
    rows = [rows[0]] + [replace(r, reason=reason(r.prediction, best, machine)) for r in rows[1:]]
    return PlanReport(devices=devices, rows=rows, infeasible=infeasible, machine=machine)


def _pinned(prediction: Prediction) -> Plan:
    """The plan with the stage split the cost model priced, so workers cut there."""
    plan = prediction.plan
    return replace(plan, stages=prediction.stages) if plan.pp > 1 else plan


def _per_rank(prediction: Prediction) -> list[int]:
    """The modelled peak of each global rank (every rank of a stage holds the same)."""
    return [prediction.memory_bytes[pp] for _, pp, _ in rank_coordinates(prediction.plan)]


def predict_plan(
    model: nn.Module,
    batch: tuple[Any, Any],
    plan: Plan,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
) -> Prediction:
    """The planner's prediction of one plan on this machine (measures the model for it)."""
    workload, machine = pricing(
        model,
        batch,
        plan.world_size,
        widths=[plan.tp],
        optimizer=optimizer,
        loss_fn=loss_fn,
        precision=plan.precision,
    )
    return predict(workload, machine, plan)


def pricing(
    model: nn.Module,
    batch: tuple[Any, Any],
    devices: int,
    *,
    widths: list[int],
    sizes: list[int] | None = None,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    cluster: str | None = None,
    machine: Machine | None = None,
    precision: str = "fp32",
) -> tuple[Workload, Machine]:
    """What the cost model prices plans for `devices` devices with: the model measured at
    the tp `widths` (and micro-batch `sizes`) under Plan.precision `precision`, and the
    machine — `machine` as given, a cluster on paper, or this host's links with how its
    workers share its cores."""
    if machine is None:
        machine = machine_for(devices, cluster, precision)
        if cluster is None:
            machine = with_sharing(machine, model, batch, devices, optimizer, loss_fn)
    workload = measure_workload(
        model,
        batch,
        widths=widths,
        sizes=sizes,
        optimizer=optimizer,
        loss_fn=loss_fn,
        threads=None if machine.cores is None else threads_per_worker(devices),
        precision=precision,
    )
    return workload, machine


def with_sharing(
    machine: Machine,
    model: nn.Module,
    batch: tuple[Any, Any],
    devices: int,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
) -> Machine:
    """`machine` with how `devices` workers running this model slow each other down.

    At most MEASURED_WORKERS are started: past them every core is long since full, so the
    slowdown grows with the workers per core and a message costs what it did there.
    """
    if machine.cores is None or devices < 2:
        return machine
    workers = min(devices, MEASURED_WORKERS)
    sharing = measure_sharing(
        model, batch, workers, cores=machine.cores, optimizer=optimizer, loss_fn=loss_fn
    )
    return replace(
        machine,
        compute_slowdown={
            **machine.compute_slowdown,
            devices: sharing.slowdown * devices / workers,
        },
        message_s={**machine.message_s, devices: sharing.message_s},
        lockstep_s=sharing.lockstep_s,
    )


MEASURED_WORKERS = 8
"""The most local workers a calibration or a sharing measurement starts on this host."""


CLUSTER_DTYPES = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""Plan.precision -> the dtype whose FLOP/s a cluster on paper computes at."""


def machine_for(devices: int, cluster: str | None = None, precision: str = "fp32") -> Machine:
    """This host's measured links (cached; groups past MEASURED_WORKERS are priced as the
    largest measured one), or a cluster's on paper, computing at `precision`'s dtype."""
    if cluster is not None:
        return load_cluster(cluster).machine(dtype=CLUSTER_DTYPES[precision])
    sizes = sorted({d for d in divisors(devices) if 1 < d <= MEASURED_WORKERS} | {2})
    return cached_machine(tuple(sizes))
