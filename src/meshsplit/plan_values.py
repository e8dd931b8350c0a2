"""PlanError, the plan values shared by its checks (sizes, divisors) and the layer split's
checks (schedule, chunks, stage boundaries), below `Plan`."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["PlanError"]

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


class PlanError(ValueError):
    """A plan that cannot work; the message names the field, the values and a fix."""


def divisors(n: int) -> list[int]:
    """The sizes that divide n evenly, for error messages that list what would work."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_bytes(value: str | int, field_name: str) -> int:
    """'2GiB', '1.5 GB', '512MiB' or an int -> bytes; anything else is a PlanError."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), "B"
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match is None:
            raise PlanError(f"{field_name}={value!r} is not a size; write e.g. '2GiB' or '512MB'")
        number, unit = float(match.group(1)), match.group(2) or "B"
    else:
        raise PlanError(f"{field_name}={value!r} is not a size; write e.g. '2GiB' or '512MB'")
    if unit not in UNITS:
        raise PlanError(
            f"{field_name}={value!r} has the unknown unit {unit!r}; use one of "
            f"{', '.join(UNITS)}, e.g. '2GiB'"
        )
    size = int(number * UNITS[unit])
    if size <= 0:
        raise PlanError(f"{field_name}={value!r} must be positive; e.g. '2GiB'")
    return size


SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble", "zbv")


def check_layer_split(
    pp: int, micro_batches: int, schedule: str, virtual_stages: Any, stages: Any, points: Any
) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    """The schedule, its chunks per rank and the stage boundaries (one per chunk) checked;
    returns stages and split_points as tuples."""
    if schedule not in SCHEDULES:
        raise PlanError(f"Plan.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if not _positive(virtual_stages):
        raise PlanError(
            f"Plan.virtual_stages={virtual_stages!r} must be a positive integer: model chunks "
            "per pipeline rank; e.g. virtual_stages=2 with schedule='interleaved'"
        )
    if schedule == "zbv" and virtual_stages != 2:
        raise PlanError(
            f"Plan.schedule='zbv' runs two chunks per rank in a V, not virtual_stages="
            f"{virtual_stages}; leave virtual_stages=1 (it becomes 2), or use "
            "schedule='interleaved' for more chunks per rank"
        )
    if virtual_stages > 1 and schedule not in ("interleaved", "zbv"):
        raise PlanError(
            f"Plan.virtual_stages={virtual_stages} applies to schedule='interleaved' (and 'zbv', "
            "two chunks per rank) only; add schedule='interleaved' or leave virtual_stages=1 "
            f"(schedule={schedule!r})"
        )
    if schedule == "interleaved" and micro_batches % pp:
        raise PlanError(
            f"Plan.schedule='interleaved' needs micro_batches={micro_batches} to be a multiple "
            f"of pp={pp}; use micro_batches={max(pp, micro_batches // pp * pp)}"
        )
    chunks = pp * virtual_stages
    per = "stage" if virtual_stages == 1 else "chunk (pp*virtual_stages)"
    if stages is not None:
        if not isinstance(stages, list | tuple) or any(not _positive(n) for n in stages):
            raise PlanError(
                f"Plan.stages={stages!r} must be a tuple of positive layer counts, one per "
                f"pipeline {per}; e.g. stages={tuple([1] * chunks)} or leave it None"
            )
        if len(stages) != chunks:
            raise PlanError(
                f"Plan.stages={list(stages)} must give a positive layer count for each of "
                f"pp={pp} stages; e.g. stages={[1] * chunks} or leave it None"
                if virtual_stages == 1
                else f"Plan.stages={list(stages)} must give a positive layer count for each of "
                f"pp*virtual_stages = {chunks} chunks; e.g. stages={[1] * chunks} or leave it None"
            )
        stages = tuple(stages)
    if points is not None:
        listed = (points,) if isinstance(points, str) else points
        if not isinstance(listed, list | tuple) or not all(isinstance(n, str) for n in listed):
            raise PlanError(
                f"Plan.split_points={points!r} must be module paths (str) where "
                "a stage begins; e.g. split_points=('model.layers.2',) for pp=2"
            )
        points = tuple(listed)
        if len(points) != chunks - 1 or stages is not None:
            count = (
                f"pp-1 = {pp - 1}" if virtual_stages == 1 else f"pp*virtual_stages-1 = {chunks - 1}"
            )
            raise PlanError(
                f"Plan.split_points={list(points)} must name {count} module paths where a "
                f"{per.split()[0]} begins, without Plan.stages; e.g. "
                "split_points=('model.layers.2',) for pp=2"
            )
    return stages, points


def _positive(value: object) -> bool:
    """A positive int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
