"""Pipeline schedules as pure action lists, one per stage, and the clock-cycle diagram.

GPipe runs every forward F(j), then every backward B(j); 1F1B (PipeDream-flush) runs p-s-1
warm-up forwards on stage s, then alternates, so at most p-s micro-batches are in flight, for
the same bubble of (p-1)/(m+p-1). p=2, m=4, one tick per action (`diagram(schedule(name, 2, 4))`):

    1f1b   stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3
           stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 ..
    gpipe  stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3
           stage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 ..

Rationale: docs/internals.md#pipelineschedulespy
"""

from __future__ import annotations

from dataclasses import dataclass

from meshsplit.plan import PlanError

__all__: list[str] = []


@dataclass(frozen=True)
class Action:
    """Forward ('F') or backward ('B') of one micro-batch on one stage."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


Schedule = list[list[Action]]
"""One ordered action list per stage."""


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards, on every stage."""
    forwards = [Action("F", j) for j in range(micro_batches)]
    backwards = [Action("B", j) for j in range(micro_batches)]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        actions = [Action("F", j) for j in range(warmup)]
        for j in range(warmup, micro_batches):
            actions += [Action("F", j), Action("B", j - warmup)]
        actions += [Action("B", j) for j in range(micro_batches - warmup, micro_batches)]
        schedule.append(actions)
    return schedule


def forward_only(stages: int, micro_batches: int) -> Schedule:
    """Inference: every stage runs the forwards in order."""
    return [[Action("F", j) for j in range(micro_batches)] for _ in range(stages)]


def schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    """The named schedule ('gpipe' or '1f1b') for `stages` x `micro_batches`."""
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name not in builders:
        raise PlanError(f"Plan.schedule={name!r} is unknown; use one of {', '.join(builders)}")
    return builders[name](stages, micro_batches)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a step in theory: (p-1)/(m+p-1), for equal stages and F, B of one tick."""
    return (stages - 1) / (micro_batches + stages - 1)


def timeline(plan: Schedule) -> list[list[Action | None]]:
    """When each stage runs each action if every action takes one tick; None is idle.

    Raises ValueError if the schedule deadlocks (a stage waits for a message never sent).
    """
    stages = len(plan)
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * stages
    ticks: list[list[Action | None]] = [[] for _ in range(stages)]
    while any(cursor[s] < len(plan[s]) for s in range(stages)):
        ready = [
            s
            for s in range(stages)
            if cursor[s] < len(plan[s]) and _ready(plan[s][cursor[s]], s, stages, done)
        ]
        if not ready:
            waiting = {s: str(plan[s][c]) for s, c in enumerate(cursor) if c < len(plan[s])}
            raise ValueError(f"schedule deadlocks: stages wait at {waiting}")
        for s in range(stages):
            ticks[s].append(plan[s][cursor[s]] if s in ready else None)
        for s in ready:
            action = plan[s][cursor[s]]
            done.add((s, action.kind, action.micro))
            cursor[s] += 1
    return ticks


def _ready(action: Action, stage: int, stages: int, done: set[tuple[int, str, int]]) -> bool:
    if action.kind == "F":
        return stage == 0 or (stage - 1, "F", action.micro) in done
    own_forward = (stage, "F", action.micro) in done
    return own_forward and (stage == stages - 1 or (stage + 1, "B", action.micro) in done)


def diagram(plan: Schedule) -> str:
    """The schedule as text, one row per stage and one column per tick ('..' is idle)."""
    rows = []
    for stage, ticks in enumerate(timeline(plan)):
        cells = " ".join(str(a) if a is not None else ".." for a in ticks)
        rows.append(f"stage {stage} | {cells}")
    return "\n".join(rows)


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches a stage holds activations for at once (forwarded, not yet backward)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak
