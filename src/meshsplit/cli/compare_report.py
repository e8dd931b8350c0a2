"""What `meshsplit compare` shows and writes: a table, compare.json, compare.md, compare.png."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from meshsplit.cli import timeline
from meshsplit.cli.compare import CompareConfig, accuracy

__all__: list[str] = []

_MIB = 2**20


def _cells(row: dict[str, Any]) -> list[str]:
    """One plan's figures as text, in the column order of HEADERS."""
    if "refused" in row:
        return [row["plan"], "refused"] + [""] * (len(HEADERS) - 2)
    predicted, estimated = row.get("predicted_step_s"), row.get("estimated_peak_bytes")
    error = (
        "" if predicted is None else f"{100 * (predicted - row['step_s']) / row['step_s']:+.0f}%"
    )
    return [
        row["plan"],
        f"{row['samples_per_second']:.0f}",
        f"{row['ratio_to_best']:.2f}",
        f"{row['step_s'] * 1e3:.1f}",
        "" if predicted is None else f"{predicted * 1e3:.1f}",
        error,
        "" if estimated is None else f"{max(estimated) / _MIB:.1f}",
        f"{max(row['tensor_peak_bytes']) / _MIB:.1f}",
        f"{max(row['peak_memory_bytes']) / _MIB:.0f}",
        f"{row['bytes_per_step'] / _MIB:.2f}",
        {True: "yes", False: "NO", None: "async"}[row["loss_matches"]],
    ]


HEADERS = [
    "plan",
    "samples/s",
    "vs best",
    "step ms",
    "predicted",
    "error",
    "tensors MiB est",
    "tensors MiB",
    "peak MiB",
    "MiB sent/step",
    "= 1 device",
]
"""step ms is measured (slowest rank), predicted is the planner's; tensors MiB is the largest
rank's peak of live tensor bytes in one step, estimated before launch (est) and measured;
peak MiB is the most training added to one rank's process memory; MiB sent sums all ranks."""


def summary(rows: list[dict[str, Any]]) -> str:
    """The planner against the runs, in one line."""
    figures = accuracy(rows)
    if not figures:
        return ""
    verdict = "was" if figures["predicted_best"] == figures["measured_best"] else "was not"
    within = "within 5% of it" if figures["predicted_best_within_5pct"] else "more than 5% slower"
    return (
        f"planner: step-time MAPE {100 * figures['step_time_mape']:.1f}%, largest per-rank "
        f"memory error {100 * figures['largest_memory_error']:.1f}%; predicted best "
        f"{figures['predicted_best']} {verdict} the measured best "
        f"({figures['measured_best']}), {within}"
    )


def table(config: CompareConfig, rows: list[dict[str, Any]]) -> Table:
    title = f"{config.model} on {config.devices} workers, global batch {config.batch_size}"
    refusals = [f"{row['plan']}: {row['refused']}" for row in rows if "refused" in row]
    notes = [line for line in [summary(rows), *refusals] if line]
    result = Table(title=title, caption="\n".join(notes) or None, caption_justify="left")
    for header in HEADERS:
        left = header == "plan"
        result.add_column(header, justify="left" if left else "right", no_wrap=left)
    for row in rows:
        result.add_row(*_cells(row))
    return result


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def write(config: CompareConfig, rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """compare.json (all figures), compare.md (the table), compare.png (throughput, memory),
    and timeline.json / timeline.png of the predicted best plan's step when it was recorded."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.json", out / "compare.md", out / "compare.png"]
    for row in rows:  # the chosen plan's recorded step: a trace and a Gantt chart of its own
        recorded = row.pop("timeline", None)
        if recorded is not None:
            paths.append(
                timeline.write_chrome_trace(
                    recorded["measured"], out / "timeline.json", recorded["predicted"]
                )
            )
            title = f"{config.model}, {row['plan']} (the predicted best): measured and predicted"
            paths.append(
                timeline.draw_gantt(
                    recorded["measured"], out / "timeline.png", recorded["predicted"], title=title
                )
            )
    document = {
        "config": vars(config),
        "machine": machine(),
        "loss_rtol": config.loss_rtol,
        "planner": accuracy(rows),
        "plans": rows,
    }
    paths[0].write_text(json.dumps(document, indent=2))
    paths[1].write_text(_markdown(config, rows))
    _figure(config, rows, paths[2])
    return paths


def _markdown(config: CompareConfig, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# meshsplit compare: {config.model} on {config.devices} workers",
        "",
        f"Global batch {config.batch_size}, {config.steps} SGD steps per plan (the first "
        f"untimed), {config.precision}, losses checked against one process "
        f"(rtol {config.loss_rtol}).",
        f"Machine: {machine()['platform']}, torch {torch.__version__}.",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    lines += ["", summary(rows)] + [
        f"- {row['plan']} refused: {row['refused']}" for row in rows if "refused" in row
    ]
    return "\n".join(lines) + "\n"


def _figure(config: CompareConfig, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [row for row in rows if "refused" not in row]
    labels = [row["plan"] for row in ran]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 0.5 * len(ran) + 2), sharey=True)
    speed.barh(labels, [row["samples_per_second"] for row in ran], color="tab:blue")
    speed.set_xlabel("samples / s (higher is better)")
    speed.invert_yaxis()
    peaks = [max(row["peak_memory_bytes"]) / _MIB for row in ran]
    lows = [min(row["peak_memory_bytes"]) / _MIB for row in ran]
    memory.barh(labels, peaks, color="tab:orange", label="max rank")
    memory.barh(labels, lows, color="tab:green", label="min rank")
    memory.set_xlabel("peak memory added by training, per rank, MiB")
    memory.legend(loc="lower right")
    figure.suptitle(
        f"meshsplit compare: {config.model} on {config.devices} workers, "
        f"global batch {config.batch_size}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
