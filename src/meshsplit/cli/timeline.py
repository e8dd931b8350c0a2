"""One training step as measured events, per rank: a Chrome trace and a Gantt chart.

Where a step's time goes — compute, a stage waiting for its peer, gradient sync backward did
not hide — is hard to read from numbers and plain in a picture. While `record` runs, every
phase and wait (phases.py) is timed with `time.perf_counter` from a start that a barrier
lines up on all ranks (on GPU the clock first lets the device finish its queued work, so a
phase's span is its device time); at the end every rank's events are gathered to all ranks.
A predicted schedule (the same Event, from the planner) can be drawn beside the measured one.

    events = timeline.record_step(engine, inputs, targets)    # every rank, same list back
    timeline.write_chrome_trace(events, "step.json")          # Perfetto / chrome://tracing
    timeline.draw_gantt(events, "step.png")
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshsplit import phases

if TYPE_CHECKING:
    from meshsplit.planner.cost import Prediction
    from meshsplit.runtime.engine import Engine

__all__ = [
    "KINDS",
    "Event",
    "draw_gantt",
    "predicted_events",
    "record",
    "record_step",
    "write_chrome_trace",
]

KINDS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "weights": "#da8bc3",
    "wait": "#c44e52",
    "sync": "#8172b3",
    "optimizer": "#55a868",
    "other": "#937860",
}
"""What an event is -> its colour: a forward or backward of one micro-batch (under zero bubble
the backward's input half), its weight gradients (zero bubble's W), a wait for other ranks
(p2p, all-reduce), gradient sync, the optimizer step, anything else."""

_PHASE_KINDS = {
    "forward": "forward",
    "backward": "backward",
    "weight gradients": "weights",
    "gradient sync": "sync",
    "optimizer step": "optimizer",
}
"""A phase name's first part ("forward, micro-batch 3") -> its kind."""


@dataclass(frozen=True)
class Event:
    """One phase or wait on one rank: seconds from the step's start, and how many phases
    enclose it (a wait inside a forward has depth 1)."""

    rank: int
    name: str
    start_s: float
    end_s: float
    depth: int = 0
    kind: str = "other"
    """One of KINDS."""
    args: dict[str, Any] = field(default_factory=dict)
    """What else is known (a wait's peers and bytes); shown by trace viewers."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class _Clock:
    """Hears this rank's phases and waits; on GPU, lets the device finish before each reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: list[phases.Span] = []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def hear(self, span: phases.Span) -> None:
        self.spans.append(span)


@contextmanager
def record(device: torch.device | None = None) -> Iterator[list[Event]]:
    """Time every phase and wait in the body; when it ends, the list holds every rank's events.

    Every rank of the job enters and leaves together: a barrier starts the clock, the events
    are gathered (all_gather_object) at the end, the same sorted list on every rank. Outside
    a process group only this process's events are kept.
    """
    clock = _Clock(device or torch.device("cpu"))
    together = dist.is_initialized()
    if together:
        dist.barrier()
    origin = clock.now()
    events: list[Event] = []
    with phases.clocked(clock):
        yield events
    rank = dist.get_rank() if together else 0
    mine = [
        Event(
            rank=rank,
            name=span.name,
            start_s=span.start - origin,
            end_s=span.end - origin,
            depth=span.depth,
            kind="wait" if span.wait else _PHASE_KINDS.get(span.name.split(",")[0], "other"),
            args=span.args,
        )
        for span in clock.spans
    ]
    everyone: list[Any] = [mine]
    if together:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    events.extend(sorted((e for part in everyone for e in part), key=_order))


def _order(event: Event) -> tuple[int, float, int]:
    return event.rank, event.start_s, event.depth


def record_step(engine: Engine, inputs: Any, targets: Any) -> list[Event]:
    """Run one `engine.train_step(inputs, targets)` and return every rank's events of it.

    Every rank calls this, with the same global batch, and gets the same list. The model is
    split first, so the step holds only the step. The live-tensor count is off for this step
    (it slows compute and would skew the times); a memory budget still holds. A warm step —
    after the first, when buffers and optimizer state exist — shows the steady schedule.
    """
    engine.prepare(inputs)
    track, engine.memory.track = engine.memory.track, False
    try:
        with record(engine.mesh.device) as events:
            engine.train_step(inputs, targets)
    finally:
        engine.memory.track = track
    return events


def write_chrome_trace(
    events: Sequence[Event],
    path: str | os.PathLike[str],
    predicted: Sequence[Event] | None = None,
) -> Path:
    """Write `events` (and `predicted`) as a Chrome trace: one complete ('X') event each, in
    microseconds, process 'measured' (pid 1) or 'predicted' (pid 2), one thread per rank."""
    trace: list[dict[str, Any]] = []
    for pid, label, part in ((1, "measured", events), (2, "predicted", predicted)):
        if part is None:
            continue
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        trace.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        for rank in sorted({e.rank for e in part}):
            trace.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                 "args": {"name": f"rank {rank}"}}
            )  # fmt: skip
        trace += [
            {
                "ph": "X",
                "name": e.name,
                "cat": e.kind,
                "pid": pid,
                "tid": e.rank,
                "ts": e.start_s * 1e6,
                "dur": e.duration_s * 1e6,
                "args": {"depth": e.depth, **e.args},
            }
            for e in part
        ]
    target = Path(path)
    target.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return target


def draw_gantt(
    events: Sequence[Event],
    path: str | os.PathLike[str],
    predicted: Sequence[Event] | None = None,
    title: str = "one training step",
) -> Path:
    """Draw one row per rank, a bar per event coloured by kind (nested events thinner, on
    top), forwards and backwards labelled F3/B3; `predicted` below, on the same time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("measured", events)] + ([("predicted", predicted)] if predicted is not None else [])
    ranks = max([e.rank for _, part in panels for e in part], default=0) + 1
    figure, axes = plt.subplots(
        len(panels), 1, sharex=True, squeeze=False, figsize=(11, 0.45 * ranks * len(panels) + 1.6)
    )
    span_ms = max([e.end_s for _, part in panels for e in part], default=0.0) * 1e3
    for axis, (label, part) in zip(axes[:, 0], panels, strict=True):
        for event in sorted(part, key=lambda e: e.depth):
            height = 0.8 * 0.55**event.depth
            start, width = event.start_s * 1e3, event.duration_s * 1e3
            axis.barh(event.rank, width, left=start, height=height, linewidth=0,
                      color=KINDS.get(event.kind, KINDS["other"]))  # fmt: skip
            micro = re.search(r"micro-batch (\d+)", event.name)
            if micro and event.depth == 0 and width > 0.025 * span_ms:
                text = f"{event.name[0].upper()}{micro.group(1)}"
                axis.text(start + width / 2, event.rank, text, ha="center", va="center",
                          fontsize=7, color="white")  # fmt: skip
        axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        axis.set_ylim(ranks - 0.5, -0.5)
        axis.set_ylabel(label)
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the start of the step")
    present = {e.kind for _, part in panels for e in part}
    handles = [Patch(color=c, label=k) for k, c in KINDS.items() if k in present]
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    figure.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.95),
                  ncol=len(KINDS), fontsize="small", frameon=False)  # fmt: skip
    target = Path(path)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def predicted_events(prediction: Prediction) -> list[Event]:
    """The planner's schedule of one step as events on the first rank of each stage: its
    forwards and backwards, then gradient sync and the optimizer step (stretched, like the
    predicted step, by the cores the workers share)."""
    plan, terms = prediction.plan, prediction.terms
    stretch = prediction.step_time_s / max(1e-12, prediction.step_time_s - terms["sharing"])
    events = []
    for interval in prediction.intervals:
        kind = {"F": "forward", "W": "weights"}.get(interval.kind, "backward")
        events.append(
            Event(
                rank=interval.stage * plan.tp,
                name=f"{kind}, micro-batch {interval.micro}",
                start_s=interval.start_s * stretch,
                end_s=interval.end_s * stretch,
                kind=kind,
            )
        )
    for stage in range(plan.pp):
        end = max(e.end_s for e in events if e.rank == stage * plan.tp)
        sync = end + terms["communication_dp"] * stretch
        events.append(Event(stage * plan.tp, "gradient sync", end, sync, kind="sync"))
        optimizer = sync + terms["optimizer"] * stretch
        events.append(Event(stage * plan.tp, "optimizer step", sync, optimizer, kind="optimizer"))
    return events
