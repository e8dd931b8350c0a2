"""What `meshsplit plan` shows: the ranked plans with their terms, why each lost, and why
the others cannot run; and the report as JSON. `choose` makes the report for a reference
model, the same one `meshsplit train --plan auto` follows."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from meshsplit import models
from meshsplit.memory.tracker import format_bytes
from meshsplit.planner.choose import PlanReport, choose_plan
from meshsplit.runtime.parallelize import default_optimizer

__all__: list[str] = []

_COLUMNS = (
    ("compute", "compute"),
    ("recompute", "recomp"),
    ("communication_tp", "tp comm"),
    ("communication_pp", "pp comm"),
    ("communication_dp", "dp comm"),
    ("communication_ep", "ep comm"),
    ("bubble", "bubble"),
    ("optimizer", "optim"),
    ("sharing", "shared cores"),
)


def choose(
    model: str,
    devices: int,
    batch_size: int,
    memory_budget: str | None = None,
    cluster: str | None = None,
    *,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
) -> PlanReport:
    """The planner's report for the reference model `model` on `devices` devices, priced on
    the first `batch_size` training rows (`cluster`: a machine that is not this one) with
    every plan at `precision` and `reduce_dtype`."""
    reference = models.reference(model)
    return choose_plan(
        reference.model(),
        reference.example_batch(batch_size),
        devices,
        optimizer=default_optimizer,
        loss_fn=reference.loss(),
        memory_budget=memory_budget,
        cluster=cluster,
        precision=precision,
        reduce_dtype=reduce_dtype,
    )


def table(report: PlanReport, top: int = 12) -> Group:
    """The `top` fastest plans (ms per step and its terms), then the reasons."""
    result = Table(title=f"predicted step time on {report.devices} devices ({report.machine.name})")
    result.add_column("#", justify="right")
    result.add_column("plan")
    result.add_column("step ms", justify="right")
    for _, header in _COLUMNS:
        result.add_column(header, justify="right")
    result.add_column("peak/rank", justify="right")
    for index, row in enumerate(report.rows[:top], start=1):
        result.add_row(
            str(index),
            row.plan.describe(),
            f"{row.step_time_s * 1e3:.1f}",
            *[_ms(row.terms[term]) for term, _ in _COLUMNS],
            format_bytes(max(row.peak_bytes)) + ("" if row.memory_source == "estimate" else "*"),
        )
    lines = [Text(f"best: {report.best.describe()}", style="bold")]
    lines += [Text(f"  {row.reason}") for row in report.rows[1:top] if row.reason]
    if len(report.rows) > top:
        lines.append(Text(f"  ... and {len(report.rows) - top} slower plans in the JSON report"))
    if report.infeasible:
        lines.append(Text("cannot run:", style="bold"))
        lines += [Text(f"  {plan.describe()}: {why}") for plan, why in report.infeasible]
    lines.append(Text("* peak from the cost model; others from the per-rank estimate"))
    return Group(result, *lines)


def _ms(seconds: float) -> str:
    return "" if seconds <= 0 else f"{seconds * 1e3:.1f}"


def write(report: PlanReport, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.as_dict(), indent=2))
    return path
