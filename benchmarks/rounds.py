"""Timing shared by the multi-process benchmarks: runs take turns in rounds, A B B A.

Alternating the order round by round spreads a slow moment of a shared machine over every
run instead of one; each run's time is then its median round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def seconds_per_step(step: Callable[[], Any], steps: int) -> float:
    """Mean seconds of `steps` steps after one warm-up step, between barriers on all ranks."""
    step()  # warm-up (first shapes, buffers)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - started) / steps


def take_turns(
    runs: dict[str, Callable[[], Any]], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step of every run in every round, the order reversed each other round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(seconds_per_step(runs[name], steps))
    return times


def median_step(train_step: Callable[[], Any], steps: int, untimed: int) -> float:
    """The median seconds of `steps` calls of `train_step` after `untimed` ones (first
    shapes, buffers, the heap grown), each timed alone: a median shrugs off a slow one."""
    for _ in range(untimed):
        train_step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def paired_ratios(first: Callable[[], Any], second: Callable[[], Any], pairs: int) -> list[float]:
    """`second`'s seconds over `first`'s in each of `pairs` pairs of single steps, run back to
    back between barriers (the order swapped every other pair): the two steps of a pair see
    the machine in the same state, so the ratios spread by what the runs do, not by the
    drift of a shared host over the seconds a round takes."""
    ratios = []
    for index in range(pairs):
        order = (first, second) if index % 2 == 0 else (second, first)
        seconds = {}
        for run in order:
            dist.barrier()
            started = time.perf_counter()
            run()
            seconds[run] = time.perf_counter() - started
        ratios.append(seconds[second] / seconds[first])
    return ratios
