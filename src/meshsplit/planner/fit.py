"""Turn raw timings into the numbers a `Machine` holds: an alpha-beta line and a slowdown.

Pure arithmetic on lists of seconds; `calibrate.py` does the timing. The planner predicts the
step a user measures (`meshsplit compare` reports each plan's median step), and on a host
whose cores are shared a collective's typical time is well above its fastest, so repeats
collapse to their median, not their minimum.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from meshsplit.planner.machine import Link

__all__: list[str] = []

_HUBER_K = 1.345
"""Huber's constant: 95 % efficiency when the noise is normal, bounded pull when it is not."""
_MAD_TO_SIGMA = 1.4826
"""Median absolute deviation to standard deviation, for normal noise."""
_MAX_ITERATIONS = 50


def typical_per_size(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(nbytes, seconds) pairs reduced to the median repeat of each size, sorted by size.

    Refuses what no line can be fitted to: negative or non-finite sizes, non-positive or
    non-finite times, fewer than two distinct sizes.
    """
    repeats: dict[float, list[float]] = {}
    for nbytes, seconds in samples:
        if not math.isfinite(nbytes) or nbytes < 0:
            raise ValueError(f"sample nbytes={nbytes!r} must be a finite number >= 0")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(
                f"sample seconds={seconds!r} for nbytes={nbytes} must be finite and > 0; "
                "a timer that reads 0 is too coarse for this payload"
            )
        repeats.setdefault(nbytes, []).append(seconds)
    if len(repeats) < 2:
        raise ValueError(
            f"an alpha-beta fit needs at least two distinct payload sizes, got "
            f"{sorted(repeats)}; time the collective at a small and a large payload"
        )
    return sorted((nbytes, statistics.median(times)) for nbytes, times in repeats.items())


def fit_link(samples: Sequence[tuple[float, float]]) -> Link:
    """Fit seconds = alpha + nbytes / beta with alpha >= 0 and beta > 0.

    Minimises sum_i w_i r_i^2 over relative residuals r_i = (t_i - alpha - x_i / beta) / t_i:
    payloads span four orders of magnitude, and an absolute fit would ignore the small ones
    that fix alpha. The weights are Huber's, w_i = min(1, k s / |r_i|) with s the scaled
    median |r_i| and k = 1.345, found by iterated reweighting: a size that a busy core made
    slow pulls the line with bounded force instead of tilting it.
    Repeats of a size collapse to their median first (see `typical_per_size`).
    """
    points = typical_per_size(samples)
    alpha, slope = _least_squares(points, [1.0] * len(points))
    for _ in range(_MAX_ITERATIONS):
        residuals = [(t - alpha - slope * x) / t for x, t in points]
        scale = _MAD_TO_SIGMA * statistics.median(abs(r) for r in residuals)
        if scale <= 1e-12:  # (nearly) every point on the line already
            break
        weights = [min(1.0, _HUBER_K * scale / abs(r)) if r else 1.0 for r in residuals]
        refit = _least_squares(points, weights)
        moved = abs(refit[0] - alpha) + abs(refit[1] - slope) * points[-1][0]
        alpha, slope = refit
        if moved <= 1e-9 * (alpha + slope * points[-1][0]):
            break
    if slope <= 0:
        raise ValueError(
            f"time does not grow with payload size, (nbytes, seconds) = {points}; "
            "time larger payloads, where bandwidth rather than latency sets the cost"
        )
    return Link(alpha_s=alpha, bytes_per_s=1.0 / slope)


def _least_squares(points: list[tuple[float, float]], weights: list[float]) -> tuple[float, float]:
    """(alpha, slope) minimising sum w ((t - alpha - slope x) / t)^2, with alpha >= 0.

    Normal equations with weights w / t^2; when they give alpha < 0 the constrained optimum
    has alpha = 0 and slope = sum w x t / sum w x^2 (over the weights w / t^2).
    """
    w = [wi / (t * t) for wi, (_, t) in zip(weights, points, strict=True)]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    alpha = (sxx * st - sx * sxt) / det
    slope = (sw * sxt - sx * st) / det
    if alpha < 0:
        alpha, slope = 0.0, sxt / sxx
    return alpha, slope


def collective_seconds(per_rank: Sequence[Sequence[float]]) -> float:
    """One collective's time from per-rank repeats: median over repeats of the max over ranks.

    A collective ends when its slowest rank does (max over ranks); the typical repeat is
    what a step meets (median over repeats). `per_rank[rank][repeat]` seconds.
    """
    repeats = {len(times) for times in per_rank}
    if not per_rank or len(repeats) != 1 or 0 in repeats:
        raise ValueError(
            f"every rank needs the same number (>= 1) of repeats, got {sorted(repeats)}"
        )
    return statistics.median(max(column) for column in zip(*per_rank, strict=True))


def compute_slowdown(alone: Sequence[float], together: Sequence[Sequence[float]]) -> float:
    """How much longer a fixed compute takes with N workers at once: T_N / T_1.

    T_1 is the median of the lone worker's repeats; T_N the median over repeats of the
    slowest worker's time (a step waits for its slowest rank). `together[rank][repeat]`.
    """
    if not alone or not together or any(not times for times in together):
        raise ValueError("a slowdown needs at least one timing alone and one per worker together")
    times = [*alone, *(t for times in together for t in times)]
    if any(not math.isfinite(t) or t <= 0 for t in times):
        raise ValueError(f"compute timings must be finite and > 0, got {times}")
    slowest = [max(column) for column in zip(*together, strict=True)]
    return statistics.median(slowest) / statistics.median(alone)
