"""A pipeline schedule run on priced chunks: the planner replays the runtime's own action lists.

Numbers in, numbers out, so every schedule is priced without processes. A plan's model is cut
into C = pp * v chunks (v = Plan.virtual_stages; rank r holds chunks r, r+pp, ..., or under
ZB-V r and 2pp-1-r), each with
per-micro-batch times F_c, B_c (and W_c when the schedule splits backward) and a message
time to chunk c+1. Interleaving makes each chunk 1/v of a stage, so the bubble shrinks to
about (p-1)/(v*m) of the compute for v times the messages; zero bubble (ZB-H1) prices B as the
input-gradient half of backward (with its collectives and any recompute) and W as the
weight-gradient half, run late to fill the cool-down.
Rationale: docs/planner.md#schedules-and-parameter-servers
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshsplit.pipeline.partition import balance_runs
from meshsplit.pipeline.schedules import Action, Schedule, chunk_ranks, schedule
from meshsplit.plan import Plan
from meshsplit.planner.workload import Item

__all__: list[str] = []

WEIGHT_SHARE = 0.5
"""Of a chunk's backward compute, what the weight gradients take (W under zero bubble): a
Linear's backward is two matmuls of the forward's size, one for each gradient."""

VIRTUAL_STAGES = (2, 4)
"""Chunks per rank the search tries under schedule='interleaved', where the model has a
trainable item for each of the pp * v chunks."""


@dataclass(frozen=True)
class Interval:
    """One predicted action of the pipeline: rank, 'F', 'B' or 'W', micro-batch, start and
    end, and the chunk (None: the rank's only one)."""

    stage: int
    kind: str
    micro: int
    start_s: float
    end_s: float
    chunk: int | None = None


def stage_sizes(
    items: Sequence[Item], plan: Plan, rows: float, runs: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """The plan's stages (chunks when interleaved), or the split the engine balances on
    these costs, cutting only between `runs` (of items a stage takes whole: from one place a
    stage may begin to the next, `Workload.segments`)."""
    if plan.stages is not None:
        return tuple(plan.stages)
    if plan.pp == 1:
        return (len(items),)
    costs = tuple(item.forward.at(rows) + item.backward.at(rows) for item in items)
    trainable = tuple(item.trainable for item in items)
    chunks = plan.pp * plan.virtual_stages
    return _balanced(costs, tuple(runs), chunks, trainable, plan.virtual_stages)


@functools.lru_cache(maxsize=256)
def _balanced(
    costs: tuple[float, ...],
    runs: tuple[tuple[int, int], ...],
    chunks: int,
    trainable: tuple[bool, ...],
    virtual_stages: int,
) -> tuple[int, ...]:
    """`balance_runs`, once per split: the search prices many plans on the same one."""
    return balance_runs(costs, runs, chunks, trainable, virtual_stages=virtual_stages)


def _pipeline(plan: Plan) -> tuple[str, int, int, int]:
    """(schedule, ranks, micro-batches, chunks per rank) as the runtime runs the plan: without
    a pipeline one chunk, whatever the schedule says (`stage_sizes` cuts one)."""
    if plan.pp == 1:
        return ("1f1b", 1, plan.micro_batches, 1)
    return (plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)


def chunk_placement(plan: Plan) -> list[int]:
    """The rank of each chunk (r, r+pp, ... hold rank r; r and 2pp-1-r under 'zbv')."""
    name, ranks, _, virtual_stages = _pipeline(plan)
    return chunk_ranks(ranks, virtual_stages, name)


def chunks_held(plan: Plan, rank: int) -> list[int]:
    """The chunks pipeline rank `rank` runs."""
    return [chunk for chunk, held in enumerate(chunk_placement(plan)) if held == rank]


def plan_actions(plan: Plan) -> Schedule:
    """Each rank's actions in the order the runtime runs them (`pipeline/schedules.py`)."""
    return _actions(*_pipeline(plan))


@functools.lru_cache(maxsize=256)
def _actions(name: str, stages: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """The named schedule, built once (the search prices it under many options)."""
    return schedule(name, stages, micro_batches, virtual_stages)


def replay(
    plan: Plan,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    send_s: Sequence[float],
    weight_s: Sequence[float],
    slowdown: Sequence[float] | None = None,
) -> tuple[Interval, ...]:
    """`simulate_pipeline` of the plan's schedule on these chunk times, once per times (ZeRO
    stages and other options that leave them alone share it)."""
    return _replayed(
        _pipeline(plan),
        tuple(forward_s),
        tuple(backward_s),
        tuple(send_s),
        tuple(weight_s),
        None if slowdown is None else tuple(slowdown),
    )


@functools.lru_cache(maxsize=256)
def _replayed(
    key: tuple[str, int, int, int],
    forward_s: tuple[float, ...],
    backward_s: tuple[float, ...],
    send_s: tuple[float, ...],
    weight_s: tuple[float, ...],
    slowdown: tuple[float, ...] | None,
) -> tuple[Interval, ...]:
    """The cached body of `replay`: its arguments hashable."""
    actions = _actions(*key)
    return tuple(simulate_pipeline(actions, forward_s, backward_s, send_s, weight_s, slowdown))


def splits_backward(actions: Schedule) -> bool:
    """Whether the schedule runs weight gradients (W) apart from the input gradients (B)."""
    return any(action.kind == "W" for row in actions for action in row)


def simulate_pipeline(
    actions: Schedule,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    send_s: Sequence[float],
    weight_s: Sequence[float] | None = None,
    slowdown: Sequence[float] | None = None,
) -> list[Interval]:
    """Run each rank's action list in order, with times per chunk: F(c, j) after F(c-1, j)
    and the message from chunk c-1, B(c, j) after B(c+1, j) and its message back (the last
    chunk after its own F(c, j)), W(c, j) after B(c, j). A rank's only chunk is its own index.
    With `slowdown` (its [n - 1]: how much slower each of n ranks computing at once runs),
    the ranks share the host's cores (`_time_shared`)."""
    chunks = len(forward_s)
    weights = [0.0] * chunks if weight_s is None else weight_s
    lengths = {"F": forward_s, "B": backward_s, "W": weights}
    if slowdown is not None:
        return _time_shared(actions, lengths, send_s, slowdown)
    done: dict[tuple[int, str, int], float] = {}
    clock, position = [0.0] * len(actions), [0] * len(actions)
    intervals: list[Interval] = []
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for rank, row in enumerate(actions):
            while position[rank] < len(row):
                action = row[position[rank]]
                c, ready = _next(action, rank, chunks, send_s, done)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                clock[rank] = start + lengths[action.kind][c]
                done[(c, action.kind, action.micro)] = clock[rank]
                intervals.append(
                    Interval(rank, action.kind, action.micro, start, clock[rank], action.chunk)
                )
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule waits on an action that never runs")
    return intervals


def _time_shared(
    actions: Schedule,
    lengths: dict[str, Sequence[float]],
    send_s: Sequence[float],
    slowdown: Sequence[float],
) -> list[Interval]:
    """`simulate_pipeline` on a host whose cores the ranks share: while n ranks compute, each
    runs at 1/slowdown[n - 1] of its own speed, and a rank waiting for a message takes no core
    (so a pipeline's idle ranks lend theirs to the busy ones). Messages take their time."""
    chunks = len(lengths["F"])
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * len(actions)
    running: dict[int, tuple[Action, int, float, float]] = {}  # rank: action, chunk, start, left
    intervals: list[Interval] = []
    now, remaining = 0.0, sum(len(a) for a in actions)
    while remaining:
        arrival = math.inf  # the next message that lets a waiting rank start
        for rank, row in enumerate(actions):
            if rank in running or position[rank] == len(row):
                continue
            action = row[position[rank]]
            c, ready = _next(action, rank, chunks, send_s, done)
            if ready is None:
                continue
            if ready > now:
                arrival = min(arrival, ready)
                continue
            running[rank] = (action, c, now, lengths[action.kind][c])
        if not running:
            if arrival == math.inf:
                raise ValueError("the schedule waits on an action that never runs")
            now = arrival
            continue
        rate = 1.0 / slowdown[len(running) - 1]
        elapsed = min(min(left for *_, left in running.values()) / rate, arrival - now)
        now += elapsed
        for rank, (action, c, start, left) in list(running.items()):
            left -= elapsed * rate
            if left > _FINISHED_S:
                running[rank] = (action, c, start, left)
                continue
            del running[rank]
            done[(c, action.kind, action.micro)] = now
            intervals.append(Interval(rank, action.kind, action.micro, start, now, action.chunk))
            position[rank] += 1
            remaining -= 1
    return intervals


_FINISHED_S = 1e-12
"""Work left below this (seconds) is done: what rounding leaves of an action's time."""


def shared_slowdowns(full: float, workers: int, cores: int, width: int) -> list[float]:
    """[n - 1]: how much slower each of n busy pipeline ranks (each one of `width` replicas)
    computes than alone, when `workers` processes on `cores` cores slow a step by `full`
    while all compute: the cores split among the busy (a waiting rank takes none), and every
    core-second goes as far as it does in that crowd (switching, shared caches)."""
    crowd = full / max(1.0, workers / cores)
    return [max(1.0, crowd * n * width / cores, crowd) for n in range(1, workers // width + 1)]


def ends(intervals: Sequence[Interval], ranks: int) -> list[float]:
    """When each rank's last action ends, in one pass (the search prices thousands)."""
    finish = [0.0] * ranks
    for interval in intervals:
        finish[interval.stage] = max(finish[interval.stage], interval.end_s)
    return finish


def _next(
    action: Action,
    rank: int,
    chunks: int,
    send_s: Sequence[float],
    done: dict[tuple[int, str, int], float],
) -> tuple[int, float | None]:
    """The chunk `action` runs on, and when its input is there (None: not made yet)."""
    chunk = rank if action.chunk is None else action.chunk
    before, delay = _after(action, chunk, chunks, send_s)
    if before is None:
        return chunk, 0.0
    return chunk, done[before] + delay if before in done else None


def _after(
    action: Action, chunk: int, chunks: int, send_s: Sequence[float]
) -> tuple[tuple[int, str, int] | None, float]:
    """The action `action` on `chunk` waits for, and the message time after it."""
    if action.kind == "F":
        return ((chunk - 1, "F", action.micro), send_s[chunk - 1]) if chunk else (None, 0.0)
    if action.kind == "W":
        return (chunk, "B", action.micro), 0.0
    if chunk == chunks - 1:
        return (chunk, "F", action.micro), 0.0
    return (chunk + 1, "B", action.micro), send_s[chunk]


def peak_held(
    actions: list[Action], rank: int, held: Sequence[float], kept: Sequence[float] = ()
) -> float:
    """Most bytes `rank` holds for micro-batches in flight, `held[c]` for each on chunk c
    (chunk `rank` when the rank has one): from F until B, or until W when the schedule has
    one, B then adding `kept[c]` (the gradients W reads) until W frees it all."""
    weights = {(a.chunk, a.micro) for a in actions if a.kind == "W"}
    live = peak = 0.0
    for action in actions:
        chunk = rank if action.chunk is None else action.chunk
        size, extra = held[chunk], (kept[chunk] if kept else 0.0)
        deferred = (action.chunk, action.micro) in weights
        if action.kind == "F":
            live += size
        elif action.kind == "B" and deferred:
            live += extra
        elif (action.kind == "W") == deferred:
            live -= size + (extra if deferred else 0.0)
        peak = max(peak, live)
    return peak
