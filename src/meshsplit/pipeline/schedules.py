"""Pipeline schedules as pure action lists, one per rank, and the clock-cycle diagram.

GPipe runs every forward F(j), then every backward B(j); 1F1B (PipeDream-flush) runs p-s-1
warm-up forwards on stage s, then alternates, so at most p-s micro-batches are in flight, for
the same bubble of (p-1)/(m+p-1). p=2, m=4, one tick per action (`diagram(schedule(name, 2, 4))`):

    1f1b   stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3
           stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 ..
    gpipe  stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3
           stage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 ..

Interleaved 1F1B (Megatron-LM, arXiv 2104.04473) cuts the model into p*v chunks, rank r holding
chunks r, r+p, ...; an action names its chunk (`F3:2` is micro-batch 3 through chunk 2). Each
chunk is 1/v of a stage, so the bubble shrinks to about (p-1)/(v*m+p-1) for more messages.
Zero bubble (ZB-H1, arXiv 2401.10241) splits backward into B (the input gradient, sent on at
once) and W (the weight gradient), and runs W late to fill the cool-down's idle ticks. ZB-V
(same paper) puts 2p chunks in a V, rank r holding chunks r and 2p-1-r, and fills the ticks
with B and W at 1F1B's activations (about half ZB-H1's bubble).

Rationale: docs/internals.md#pipelineschedulespy
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from meshsplit.plan import PlanError

__all__: list[str] = []


@dataclass(frozen=True)
class Action:
    """Forward ('F'), backward ('B'; the input gradient alone when the schedule has W) or
    weight gradient ('W') of one micro-batch on one chunk (None: the rank's only chunk)."""

    kind: str
    micro: int
    chunk: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + ("" if self.chunk is None else f":{self.chunk}")


Schedule = list[list[Action]]
"""One ordered action list per rank."""

PAPER_TICKS = {"F": 1, "B": 2, "W": 1}
"""Costs the papers draw with: a backward is two forwards, B and W one each once split."""


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


def zero_bubble(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1: 1F1B's forwards and input-gradient backwards, stage s running each W s
    backwards late (every stage then holds at most p micro-batches, as 1F1B's first)."""
    schedule = []
    for stage, actions in enumerate(one_f_one_b(stages, micro_batches)):
        split: list[Action] = []
        pending: deque[int] = deque()
        for action in actions:
            split.append(action)
            if action.kind == "B":
                pending.append(action.micro)
                if len(pending) > stage:
                    split.append(Action("W", pending.popleft()))
        schedule.append(split + [Action("W", j) for j in pending])
    return schedule


def interleaved(stages: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: rank r runs (p-r-1)*2 + (v-1)*p warm-up forwards, then
    one forward and one backward in turn, then the last backwards. Micro-batches go in groups
    of p through each of the rank's chunks in turn (backwards through the last chunk first)."""
    if micro_batches % stages:
        raise PlanError(
            f"Plan.schedule='interleaved' needs micro_batches={micro_batches} to be a multiple "
            f"of pp={stages}; use micro_batches={max(stages, micro_batches // stages * stages)}"
        )
    group = stages * virtual_stages
    total = micro_batches * virtual_stages

    def action(kind: str, rank: int, k: int) -> Action:
        batch, within = divmod(k, group)
        local = within // stages if kind == "F" else virtual_stages - 1 - within // stages
        return Action(kind, batch * stages + within % stages, local * stages + rank)

    schedule = []
    for rank in range(stages):
        warmup = min((stages - rank - 1) * 2 + (virtual_stages - 1) * stages, total)
        actions = [action("F", rank, k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [action("F", rank, k + warmup), action("B", rank, k)]
        actions += [action("B", rank, k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zbv(stages: int, micro_batches: int) -> Schedule:
    """ZB-V: 2p chunks in a V (`chunk_ranks`), backward split into B and W, found by running
    the ranks tick by tick at one tick an action. An idle rank takes a ready B first (it frees
    memory and unblocks the rank before it), else a ready F (the V's second arm first: it
    leads to the loss), else its oldest W. A rank holds at most 2p chunk micro-batches (from
    F until W), 1F1B's activations as a chunk is half a stage; a first-arm F leaves room for
    one of the second arm, which always leads on to a B, so no rank waits for good. At the
    papers' costs the idle share is about half of ZB-H1's (p=4, m=8: 0.059 against 0.111).
    """
    chunks, ranks = 2 * stages, chunk_ranks(stages, 2, "zbv")
    held = [[c for c in range(chunks) if ranks[c] == rank] for rank in range(stages)]
    done: set[tuple[str, int, int]] = set()
    next_micro = {(kind, c): 0 for kind in "FB" for c in range(chunks)}
    weights: list[deque[Action]] = [deque() for _ in range(stages)]
    live = [0] * stages
    rows: Schedule = [[] for _ in range(stages)]
    left = 3 * micro_batches * chunks
    while left:
        finished = []
        for rank in range(stages):
            action = _zbv_pick(
                held[rank], next_micro, done, weights[rank], live[rank], (stages, micro_batches)
            )
            if action is None:
                continue
            rows[rank].append(action)
            finished.append(action)
            if action.kind == "W":
                live[rank] -= 1
                continue
            next_micro[(action.kind, action.chunk or 0)] += 1
            if action.kind == "F":
                live[rank] += 1
            else:
                weights[rank].append(Action("W", action.micro, action.chunk))
        if not finished:
            raise AssertionError(f"zbv({stages}, {micro_batches}) stalls")  # no such case
        left -= len(finished)
        done |= {(a.kind, a.micro, a.chunk or 0) for a in finished}
    return rows


def _zbv_pick(
    chunks: list[int],
    next_micro: dict[tuple[str, int], int],
    done: set[tuple[str, int, int]],
    weights: deque[Action],
    live: int,
    shape: tuple[int, int],
) -> Action | None:
    """The action a ZB-V rank holding `chunks` starts now (see `zbv`), or None to idle;
    `shape` is (stages, micro_batches)."""
    stages, micro_batches = shape
    for kind in "BF":
        for c in sorted(chunks, reverse=True):
            j = next_micro[(kind, c)]
            if j >= micro_batches:
                continue
            if kind == "B":
                ready = ("F", j, c) in done and (c == 2 * stages - 1 or ("B", j, c + 1) in done)
            else:
                room = 2 * stages if c >= stages else 2 * stages - 1
                ready = (c == 0 or ("F", j, c - 1) in done) and live < room
            if ready:
                return Action(kind, j, c)
    return weights.popleft() if weights else None


def chunk_ranks(stages: int, virtual_stages: int = 1, name: str = "1f1b") -> list[int]:
    """The rank each chunk runs on: chunk c on rank c % p (interleaved: rank r holds r, r+p,
    ...), or under 'zbv' in a V, down the ranks and back up (rank r holds r and 2p-1-r, so
    rank 0 runs the first chunk and the last, and rank p-1 hands chunk p-1 to itself)."""
    chunks = stages * virtual_stages
    if name == "zbv":
        return [c if c < stages else chunks - 1 - c for c in range(chunks)]
    return [c % stages for c in range(chunks)]


def forward_only(
    stages: int, micro_batches: int, virtual_stages: int = 1, name: str = "1f1b"
) -> Schedule:
    """Inference: every rank runs the forwards in order, through each of its chunks."""
    if virtual_stages == 1:
        return [[Action("F", j) for j in range(micro_batches)] for _ in range(stages)]
    ranks = chunk_ranks(stages, virtual_stages, name)
    return [
        [
            Action("F", j, c)
            for j in range(micro_batches)
            for c in range(len(ranks))
            if ranks[c] == rank
        ]
        for rank in range(stages)
    ]


def schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The named schedule (Plan.schedule) for `stages` x `micro_batches`."""
    if name == "interleaved":
        return interleaved(stages, micro_batches, virtual_stages)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero-bubble": zero_bubble, "zbv": zbv}
    if name not in builders:
        known = ", ".join([*builders, "interleaved"])
        raise PlanError(f"Plan.schedule={name!r} is unknown; use one of {known}")
    return builders[name](stages, micro_batches)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a step in theory: (p-1)/(m+p-1), for equal stages and F, B of one tick."""
    return (stages - 1) / (micro_batches + stages - 1)


def idle_fraction(plan: Schedule) -> float:
    """Idle share of the schedule's timeline at the papers' costs (PAPER_TICKS; B is one tick
    when W takes the other), for equal chunks."""
    split = any(a.kind == "W" for actions in plan for a in actions)
    rows = timeline(plan, {**PAPER_TICKS, "B": 1} if split else PAPER_TICKS)
    busy = sum(a is not None for row in rows for a in row)
    return 1 - busy / (len(rows) * len(rows[0])) if rows and rows[0] else 0.0


def timeline(plan: Schedule, ticks: Mapping[str, int] | None = None) -> list[list[Action | None]]:
    """When each rank runs each action if an action of kind k takes ticks[k] (default 1)
    ticks and a message arrives at once; None is idle.

    Sends never block and receives do, as in `p2p.py`, so this is also the proof that the
    schedule's traffic cannot deadlock: raises ValueError if a rank waits for a message
    never sent.
    """
    ranks = len(plan)
    chunks = 1 + max((a.chunk for row in plan for a in row if a.chunk is not None), default=-1)
    chunks = chunks or ranks
    done: set[tuple[int, str, int]] = set()
    cursor, left = [0] * ranks, [0] * ranks
    rows: list[list[Action | None]] = [[] for _ in range(ranks)]
    while any(cursor[r] < len(plan[r]) for r in range(ranks)):
        for r in range(ranks):
            if not left[r] and cursor[r] < len(plan[r]):
                action = plan[r][cursor[r]]
                if _ready(action, _chunk(action, r), chunks, done):
                    left[r] = (ticks or {}).get(action.kind, 1)
        if not any(left):
            waiting = {r: str(plan[r][c]) for r, c in enumerate(cursor) if c < len(plan[r])}
            raise ValueError(f"schedule deadlocks: ranks wait at {waiting}")
        finished = []
        for r in range(ranks):
            rows[r].append(plan[r][cursor[r]] if left[r] else None)
            if left[r]:
                left[r] -= 1
                if not left[r]:
                    finished.append(r)
        for r in finished:  # what finishes this tick is received from the next one on
            action = plan[r][cursor[r]]
            done.add((_chunk(action, r), action.kind, action.micro))
            cursor[r] += 1
    return rows


def _chunk(action: Action, rank: int) -> int:
    return rank if action.chunk is None else action.chunk


def _ready(action: Action, chunk: int, chunks: int, done: set[tuple[int, str, int]]) -> bool:
    if action.kind == "F":
        return chunk == 0 or (chunk - 1, "F", action.micro) in done
    if action.kind == "W":
        return (chunk, "B", action.micro) in done
    own_forward = (chunk, "F", action.micro) in done
    return own_forward and (chunk == chunks - 1 or (chunk + 1, "B", action.micro) in done)


def diagram(plan: Schedule) -> str:
    """The schedule as text, one row per rank and one column per tick ('..' is idle)."""
    rows = [[str(a) if a is not None else ".." for a in ticks] for ticks in timeline(plan)]
    width = max((len(cell) for row in rows for cell in row), default=2)
    return "\n".join(
        f"stage {rank} | " + " ".join(cell.ljust(width) for cell in row).rstrip()
        for rank, row in enumerate(rows)
    )


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch-chunks a rank holds activations for at once: from F until B, or
    until W when the schedule has one (B has then freed only part of them)."""
    weights = {(a.chunk, a.micro) for a in actions if a.kind == "W"}
    live = peak = 0
    for action in actions:
        if action.kind == "F":
            live += 1
        elif (action.kind == "W") == ((action.chunk, action.micro) in weights):
            live -= 1
        peak = max(peak, live)
    return peak
