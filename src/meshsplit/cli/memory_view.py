"""`meshsplit memory`: each rank's estimate beside what its worker measured, and a picture.

The estimate is made in this process before launch (`estimate_memory`); the workers then
train the same steps and count their live tensors. The table gives, per rank, both peaks,
the error, the phase of the peak and the categories; memory.png draws every rank's live
bytes by category over one step, memory.json holds all figures. Under mixed precision a
line below the table sets each rank's most activation bytes in a step beside the same plan's
in fp32 (both estimated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from meshsplit.batch import LossFn
from meshsplit.job.launch import launch
from meshsplit.memory.estimate import MemoryEstimate, RankEstimate
from meshsplit.memory.tracker import CATEGORIES
from meshsplit.plan import Plan
from meshsplit.planner.simulate import estimate_memory
from meshsplit.runtime.parallelize import OptimizerFactory, parallelize

__all__: list[str] = []

_MIB = 2**20
_STEPS = 2
"""Steps each worker trains; the last is the one counted (optimizer state exists by then)."""


def measure(
    build: Callable[[], torch.nn.Module],
    plan: Plan,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
) -> tuple[MemoryEstimate, list[dict[str, Any]]]:
    """The estimate, then every worker's measured figures for the same steps."""
    estimate = estimate_memory(build(), plan, batch, optimizer=optimizer, loss_fn=loss_fn)
    estimate.check()
    measured = launch(
        _worker, plan.world_size, args=(build, estimate.plan, batch, optimizer, loss_fn)
    )
    return estimate, measured


def against_fp32(
    plan: Plan,
    build: Callable[[], torch.nn.Module],
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
) -> str | None:
    """Each rank's most activation bytes over one step, estimated under `plan` and under
    the same plan (same stages) in fp32; None for an fp32 plan: what mixed precision saves."""
    if plan.precision == "fp32":
        return None
    fp32 = replace(plan, precision="fp32", reduce_dtype="fp32")
    low, full = (
        estimate_memory(build(), p, batch, optimizer=optimizer, loss_fn=loss_fn, timeline=True)
        for p in (plan, fp32)
    )
    return f"most activations in a step, {plan.precision} / fp32 (MiB): " + ", ".join(
        f"rank {a.rank} {_most_activations(a) / _MIB:.2f} / {_most_activations(b) / _MIB:.2f}"
        for a, b in zip(low.ranks, full.ranks, strict=True)
    )


def _most_activations(rank: RankEstimate) -> int:
    column = CATEGORIES.index("activations")
    return max((sample.bytes_by_category[column] for sample in rank.timeline), default=0)


def _worker(
    build: Callable[[], torch.nn.Module],
    plan: Plan,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
) -> dict[str, Any]:
    engine = parallelize(build(), plan, optimizer=optimizer, loss_fn=loss_fn)
    for step in range(_STEPS):
        if step == _STEPS - 1:
            engine.memory.timeline = []
        engine.train_step(*batch)
    report = engine.memory_report()
    samples = engine.memory.timeline or []
    engine.close()
    return {
        "report": report.as_dict(),
        "timeline": [sample.bytes_by_category for sample in samples],
    }


def table(estimate: MemoryEstimate, measured: list[dict[str, Any]]) -> Table:
    """One row per rank: estimated and measured peak (MiB), error, phase, each category."""
    result = Table(
        title=f"memory per rank, {estimate.plan.describe()} (MiB of live tensors in one step)",
        caption="each category: estimated / measured at the peak; RSS: the process's resident peak",
    )
    headers = ["rank", "estimate", "measured", "error", "phase", *CATEGORIES, "RSS"]
    for header in headers:
        result.add_column(header, justify="left" if header == "phase" else "right")
    for rank, worker in zip(estimate.ranks, measured, strict=True):
        report = worker["report"]
        real = report["tensor_peak_bytes"]
        breakdown = report["tensor_breakdown"] or {}
        result.add_row(
            str(rank.rank),
            f"{rank.peak_bytes / _MIB:.2f}",
            f"{real / _MIB:.2f}",
            f"{(rank.peak_bytes - real) / real:+.1%}",
            rank.phase,
            *(
                f"{rank.breakdown[c] / _MIB:.2f} / {breakdown.get(c, 0) / _MIB:.2f}"
                for c in CATEGORIES
            ),
            f"{report['peak_bytes'] / _MIB:.0f}",
        )
    return result


def write(estimate: MemoryEstimate, measured: list[dict[str, Any]], out: Path) -> list[Path]:
    """memory.json (every figure) and memory.png (each rank's live bytes over one step)."""
    out.mkdir(parents=True, exist_ok=True)
    figures = out / "memory.json"
    figures.write_text(
        json.dumps(
            {"estimate": estimate.as_dict(), "measured": [m["report"] for m in measured]}, indent=2
        )
    )
    return [figures, _picture(estimate, measured, out / "memory.png")]


def _picture(estimate: MemoryEstimate, measured: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(measured)
    figure, axes = plt.subplots(count, 1, figsize=(9, 2.2 * count + 1.2), squeeze=False)
    for rank, (axis, worker) in enumerate(zip(axes[:, 0], measured, strict=True)):
        timeline = worker["timeline"]
        if timeline:
            series = [[sample[c] / _MIB for sample in timeline] for c in range(len(CATEGORIES))]
            axis.stackplot(range(len(timeline)), series, labels=CATEGORIES, linewidth=0)
        axis.axhline(
            estimate.ranks[rank].peak_bytes / _MIB, color="black", linestyle="--", label="estimate"
        )
        if estimate.plan.budget_bytes:
            axis.axhline(estimate.plan.budget_bytes / _MIB, color="red", label="budget")
        axis.set_ylabel(f"rank {rank}\nMiB")
        axis.margins(x=0)
    axes[-1, 0].set_xlabel("allocations and frees during one train_step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.suptitle(f"live tensors by category, {estimate.plan.describe()}")
    figure.tight_layout(rect=(0, 0, 1, 0.92))
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=7,
                  fontsize="small", frameon=False)  # fmt: skip
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
