"""`meshsplit compare`: every plan that fits N workers, run for real on the same data.

Each plan trains the same model from the same initial weights on the same global batches;
the first step (which builds and profiles the split) and the second (whose communication
is counted) are left out of the timing; each later step is timed alone and a plan's step
time is the median on its slowest rank. A single-process run of the same steps, under
the same autocast, is the reference every plan's losses must match.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from meshsplit import models
from meshsplit.cli import timeline
from meshsplit.experts.split import experts_in
from meshsplit.job.launch import WorkerError, launch
from meshsplit.job.traffic import count_traffic
from meshsplit.plan import Plan, PlanError, divisors
from meshsplit.planner.choose import pricing
from meshsplit.planner.cost import Prediction, predict
from meshsplit.planner.machine import Machine
from meshsplit.planner.simulate import estimate_memory
from meshsplit.planner.workload import Workload
from meshsplit.precision import Precision
from meshsplit.runtime.parallelize import parallelize

__all__: list[str] = []

LOSS_RTOL = 1e-4
"""Relative tolerance of the loss check over all steps (float summation order differs)."""
MIXED_LOSS_RTOL = 2e-2
"""The same under mixed precision: each split rounds its sums to bf16/fp16 (8 or 11 bits)
at different points."""


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """What every plan runs: the same model, data, optimizer and number of steps."""

    model: str
    """Reference model name: mlp, cnn, transformer or moe."""
    devices: int
    """Worker processes every plan uses."""
    steps: int = 8
    """Optimizer steps per plan; the first two are not timed (warm-up, and the one whose
    traffic is counted), the rest each are: a plan's time is their median."""
    batch_size: int = 64
    """Global batch size."""
    micro_batches: int = 4
    """Micro-batches per step for plans with a layer split."""
    memory_budget: str | None = None
    """Per-rank budget: plans whose estimate passes it are refused, not run."""
    include_ps: bool = False
    """Also run parameter-server plans: 1 or 2 of the devices serve, the rest work, both
    synchronous (staleness 0) and asynchronous (staleness 2)."""
    precision: str = "fp32"
    """Plan.precision of every plan (and the reference's autocast)."""
    reduce_dtype: str = "fp32"
    """Plan.reduce_dtype of every plan."""
    seed: int = 0

    @property
    def loss_rtol(self) -> float:
        """How closely every plan's losses must match the reference's."""
        return LOSS_RTOL if self.precision == "fp32" else MIXED_LOSS_RTOL

    def plan(self, **shape: Any) -> Plan:
        """A plan of `shape` with this comparison's precision and reduce dtype."""
        return Plan(precision=self.precision, reduce_dtype=self.reduce_dtype, **shape)


def candidate_plans(config: CompareConfig) -> list[Plan]:
    """Every dp x pp x tp that multiplies to `devices`, and for a model with experts every
    ep dividing dp and the experts: pure splits first, then hybrids."""
    experts = list(experts_in(_model(config)).values())
    plans = []
    for dp in divisors(config.devices):
        widths = [e for e in divisors(dp) if all(n % e == 0 for n in experts)] if experts else [1]
        for pp in divisors(config.devices // dp):
            tp = config.devices // (dp * pp)
            micro_batches = config.micro_batches if pp > 1 else 1
            plans += [
                config.plan(
                    dp=dp,
                    pp=pp,
                    tp=tp,
                    ep=ep,
                    micro_batches=micro_batches,
                    memory_budget=config.memory_budget,
                )
                for ep in widths
            ]
    plans.sort(key=lambda p: (sum(n > 1 for n in (p.dp, p.pp, p.tp, p.ep)), -p.dp, -p.pp, p.ep))
    if config.include_ps:
        plans += [
            config.plan(
                dp=config.devices - servers, sync="ps", servers=servers, staleness=staleness
            )
            for servers in (1, 2)
            if servers < config.devices
            for staleness in (0, 2)
        ]
    return plans


def batches(config: CompareConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed global batches every plan and the reference train on."""
    rows = config.batch_size * config.steps
    inputs, targets = models.reference(config.model).samples(rows, seed=config.seed)
    return list(zip(inputs.split(config.batch_size), targets.split(config.batch_size), strict=True))


def _loss_fn(config: CompareConfig) -> torch.nn.Module:
    return models.reference(config.model).loss()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _model(config: CompareConfig) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    return models.reference(config.model).model()


def _run_plan(config: CompareConfig, plan: Plan) -> dict[str, Any]:
    """Runs in every worker: train the fixed steps under `plan`; this rank's figures."""
    steps = batches(config)  # before the engine: loading data is not the plan's memory
    engine = parallelize(_model(config), plan, optimizer=_optimizer, loss_fn=_loss_fn(config))
    engine.memory.track = False  # the timed steps run as a user's would
    losses = [engine.train_step(*steps[0])]
    with count_traffic() as traffic:
        losses.append(engine.train_step(*steps[1]))
    timed = []
    for batch in steps[2:]:  # one step at a time: a median shrugs off a slow one
        started = time.perf_counter()
        losses.append(engine.train_step(*batch))
        timed.append(time.perf_counter() - started)
    seconds = statistics.median(timed)
    engine.memory.track = True  # one more step, untimed, to count its live tensors
    engine.train_step(*steps[-1])
    memory = engine.memory_report().as_dict()
    engine.close()
    return {"losses": losses, "seconds": seconds, "bytes": traffic.total_bytes, "memory": memory}


def reference_losses(config: CompareConfig) -> list[float]:
    """The same steps in this process, unsplit: the losses every plan must reproduce (fp16
    steps whose scaled gradients overflow are skipped, as every plan skips them)."""
    model, loss_fn = _model(config), _loss_fn(config)
    optimizer = _optimizer(model.parameters())
    precision = Precision(config.plan(), torch.device("cpu"))
    losses = []
    for inputs, targets in batches(config):
        optimizer.zero_grad()
        with precision.autocast():
            loss = loss_fn(model(inputs), targets)
        precision.backward(loss)
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in gradients)
        if finite:
            precision.unscale(gradients)
            optimizer.step()
        precision.stepped(finite)
        losses.append(loss.item())
    return losses


def compare(
    config: CompareConfig, *, show: bool = True, record: bool = False
) -> list[dict[str, Any]]:
    """Run every candidate plan; one row per plan (refused plans say why). With `record`,
    the plan the planner predicted fastest runs once more with one step recorded, and its
    row's "timeline" holds the measured and the predicted events."""
    if config.steps < 3:
        raise PlanError(
            f"steps={config.steps}: compare needs at least 3 (the first two are untimed)"
        )
    reference = reference_losses(config)
    plans = candidate_plans(config)
    rows: list[dict[str, Any]] = []
    with Progress(console=Console(stderr=True), disable=not show, transient=True) as progress:
        task = progress.add_task("measuring the model for the planner", total=len(plans))
        pricing = _pricing(config, plans)
        for plan in plans:
            progress.update(task, description=f"running {plan.describe()}")
            rows.append(_row(config, plan, reference, pricing))
            progress.advance(task)
        predicted = [row for row in rows if "predicted_step_s" in row]
        if record and predicted:
            chosen = min(predicted, key=lambda row: row["predicted_step_s"])
            progress.update(task, description=f"recording one step of {chosen['plan']}")
            chosen["timeline"] = _timeline(config, Plan(**chosen["shape"]), pricing)
    best = max((row["samples_per_second"] for row in rows if "refused" not in row), default=0.0)
    for row in rows:
        if "refused" not in row:
            row["ratio_to_best"] = row["samples_per_second"] / best
    return rows


def _timeline(
    config: CompareConfig, plan: Plan, pricing: tuple[Workload, Machine]
) -> dict[str, list[timeline.Event]]:
    measured = launch(_record_step, plan.world_size, args=(config, plan))[0]
    prediction = _predicted(pricing, plan)
    return {
        "measured": measured,
        "predicted": [] if prediction is None else timeline.predicted_events(prediction),
    }


def _record_step(config: CompareConfig, plan: Plan) -> list[timeline.Event]:
    """Runs in every worker: one warm-up step, then one recorded step of `plan`."""
    steps = batches(config)
    engine = parallelize(_model(config), plan, optimizer=_optimizer, loss_fn=_loss_fn(config))
    engine.memory.track = False
    engine.train_step(*steps[0])
    events = timeline.record_step(engine, *steps[1])
    engine.close()
    return events


def _pricing(
    config: CompareConfig, plans: list[Plan], machine: Machine | None = None
) -> tuple[Workload, Machine]:
    """The planner's view of the model and this machine (measured unless given), to predict
    each plan beside its run."""
    return pricing(
        _model(config),
        batches(config)[0],
        config.devices,
        widths=sorted({plan.tp for plan in plans}),
        sizes=[config.batch_size // (p.dp * p.micro_batches) for p in plans],
        optimizer=_optimizer,
        loss_fn=_loss_fn(config),
        precision=config.precision,
        machine=machine,
    )


def _predicted(pricing: tuple[Workload, Machine] | None, plan: Plan) -> Prediction | None:
    if pricing is None or plan.tp not in pricing[0].items:
        return None
    return predict(*pricing, plan)


def accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Step-time MAPE of the predictions, and whether the predicted best ran fastest (or
    within 5% of the fastest)."""
    ran = [row for row in rows if "refused" not in row and "predicted_step_s" in row]
    if not ran:
        return {}
    errors = [abs(r["predicted_step_s"] - r["step_s"]) / r["step_s"] for r in ran]
    memory = [
        abs(p - m) / m
        for r in ran
        if r["estimated_peak_bytes"] is not None  # servers' plans have no estimate
        for p, m in zip(r["estimated_peak_bytes"], r["tensor_peak_bytes"], strict=True)
    ]
    predicted_best = min(ran, key=lambda r: r["predicted_step_s"])
    fastest = min(r["step_s"] for r in ran)
    return {
        "step_time_mape": sum(errors) / len(errors),
        "largest_memory_error": max(memory, default=0.0),
        "predicted_best": predicted_best["plan"],
        "measured_best": min(ran, key=lambda r: r["step_s"])["plan"],
        "predicted_best_within_5pct": predicted_best["step_s"] <= 1.05 * fastest,
    }


def _row(
    config: CompareConfig,
    plan: Plan,
    reference: list[float],
    pricing: tuple[Workload, Machine] | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {"plan": plan.describe(), "shape": asdict(plan)}
    estimate = None
    try:
        plan.check_batch(config.batch_size)
        if plan.sync != "ps":  # the estimate covers the mesh's ranks, not servers
            estimate = estimate_memory(
                _model(config), plan, batches(config)[0], optimizer=_optimizer,
                loss_fn=_loss_fn(config),
            )  # fmt: skip
            estimate.check()
            plan = estimate.plan  # the workers cut the layers where the estimate's profile did
        results = launch(_run_plan, plan.world_size, args=(config, plan))
    except PlanError as error:
        return {**row, "refused": str(error)}
    except WorkerError as error:
        if error.error_type != "PlanError":
            raise
        return {**row, "refused": error.message}
    results, servers = results[: plan.mesh_size], results[plan.mesh_size :]
    losses = results[0]["losses"]
    slowest = max(result["seconds"] for result in results)
    # What training added on each rank: the process peak less what torch held before it.
    peaks = [m["peak_bytes"] - m["baseline_bytes"] for m in (r["memory"] for r in results)]
    matched = torch.allclose(
        torch.tensor(losses), torch.tensor(reference), rtol=config.loss_rtol, atol=1e-6
    )
    # the cost model prices synchronous servers (staleness 0), not asynchronous ones
    prediction = None if plan.staleness else _predicted(pricing, plan)
    if prediction is not None:
        row["predicted_step_s"] = prediction.step_time_s
        row["predicted_terms"] = prediction.terms
    if servers:
        peaks += [server["held_bytes"] for server in servers]
    return {
        **row,
        "step_s": slowest,
        "samples_per_second": config.batch_size / slowest,
        "peak_memory_bytes": peaks,
        "tensor_peak_bytes": [r["memory"]["tensor_peak_bytes"] for r in results],
        "estimated_peak_bytes": None
        if estimate is None
        else [r.peak_bytes for r in estimate.ranks],
        "bytes_per_step": sum(result["bytes"] for result in results),
        "final_loss": losses[-1],
        "reference_final_loss": reference[-1],
        "loss_matches": None if plan.staleness else bool(matched),
    }
