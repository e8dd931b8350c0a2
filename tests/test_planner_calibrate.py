"""Calibration: the alpha-beta fit on made-up timings, the machine cache, one real measurement."""

from __future__ import annotations

import json
import math
import os
import random
import statistics

import pytest
import torch
from torch import nn

from meshsplit.plan import PlanError
from meshsplit.planner import calibrate
from meshsplit.planner.calibrate import cache_file, cached_machine, machine_key, measure_machine
from meshsplit.planner.fit import collective_seconds, compute_slowdown, fit_link
from meshsplit.planner.machine import OPERATIONS, Link, Machine
from meshsplit.planner.sharing import LOCKSTEP_PAYLOADS, measure_sharing, trials_slowdown

ALPHA, BETA = 80e-6, 1.5e9
SIZES = [int(2 ** (10 + 13 * i / 7)) for i in range(8)]


def _line(nbytes: float) -> float:
    return ALPHA + nbytes / BETA


def _close(link: Link, rel: float) -> bool:
    return math.isclose(link.alpha_s, ALPHA, rel_tol=rel) and math.isclose(
        link.bytes_per_s, BETA, rel_tol=rel
    )


def test_fit_recovers_an_exact_line() -> None:
    assert _close(fit_link([(x, _line(x)) for x in SIZES]), 1e-9)


def test_fit_keeps_the_median_repeat_of_noise_that_only_adds_time() -> None:
    rng = random.Random(0)
    samples = [(x, _line(x) * (1 + abs(rng.gauss(0, 0.1)))) for x in SIZES for _ in range(11)]
    typical = 1 + 0.1 * statistics.NormalDist().inv_cdf(0.75)  # the median of 1 + |N(0, 0.1)|
    link = fit_link(samples)
    assert math.isclose(link.bytes_per_s, BETA / typical, rel_tol=0.04)
    assert math.isclose(link.alpha_s, ALPHA * typical, rel_tol=0.15)


def test_fit_of_symmetric_noise_is_within_a_few_percent() -> None:
    rng = random.Random(1)
    for _ in range(20):
        samples = [(x, _line(x) * (1 + rng.gauss(0, 0.01))) for x in SIZES]
        assert _close(fit_link(samples), 0.04)


@pytest.mark.parametrize("slow", [0, 3, 7])
def test_fit_shrugs_off_one_slow_size(slow: int) -> None:
    samples = [(x, _line(x) * (3.0 if i == slow else 1.0)) for i, x in enumerate(SIZES)]
    assert _close(fit_link(samples), 0.01)


def test_fit_never_returns_a_negative_alpha() -> None:
    samples = [(x, x / BETA * (1.02 if i == 0 else 1.0)) for i, x in enumerate(SIZES)]
    samples[0] = (SIZES[0], SIZES[0] / BETA * 0.5)  # pulls an unconstrained alpha below 0
    link = fit_link(samples)
    assert link.alpha_s == 0.0 and math.isclose(link.bytes_per_s, BETA, rel_tol=0.05)


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([], "two distinct payload sizes"),
        ([(1024, 1e-4), (1024, 2e-4)], "two distinct payload sizes"),
        ([(1024, 1e-4), (2048, 0.0)], "seconds=0.0"),
        ([(1024, 1e-4), (2048, math.nan)], "seconds=nan"),
        ([(-1, 1e-4), (2048, 1e-4)], "nbytes=-1"),
        ([(1024, 2e-4), (8192, 1e-4), (65536, 5e-5)], "does not grow"),
    ],
)
def test_fit_refuses_degenerate_input(samples: list[tuple[float, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_link(samples)


def test_a_collective_takes_its_slowest_rank_in_its_median_repeat() -> None:
    assert collective_seconds([[3.0, 1.0, 2.0], [1.5, 2.5, 1.0]]) == 2.5
    with pytest.raises(ValueError, match="same number"):
        collective_seconds([[1.0], [1.0, 2.0]])


def test_slowdown_is_the_slowest_workers_median_over_the_lone_median() -> None:
    together = [[2.0, 2.2, 9.0], [2.4, 1.8, 2.0]]  # slowest per repeat: 2.4, 2.2, 9.0
    assert compute_slowdown([1.0, 1.1, 0.9], together) == pytest.approx(2.4)
    with pytest.raises(ValueError, match="at least one timing"):
        compute_slowdown([], together)


def _machine(groups: list[int], name: str = "made up") -> Machine:
    links = {op: {g: Link(1e-4 * g, 1e9 / g) for g in groups} for op in OPERATIONS}
    return Machine(name=name, links=links, cores=2, compute_slowdown={g: g / 2 for g in groups})


def test_machine_round_trips_through_json() -> None:
    machine = _machine([2, 4])
    assert Machine.from_dict(json.loads(machine.to_json())) == machine


def test_bad_arguments_are_refused_before_any_worker_starts() -> None:
    with pytest.raises(PlanError, match="group_sizes"):
        measure_machine((0, 2))
    with pytest.raises(PlanError, match="sizes"):
        measure_machine((2,), sizes=(1024,))
    with pytest.raises(PlanError, match="repeats"):
        measure_machine((2,), repeats=0)


def test_a_group_of_one_is_not_measured() -> None:
    machine = measure_machine((1,))
    assert machine.links == {op: {} for op in OPERATIONS} and machine.compute_slowdown == {}
    assert machine.seconds("all_reduce", 1, 1e6) == 0.0


def test_cache_measures_only_missing_sizes_and_merges(tmp_path, monkeypatch) -> None:
    asked: list[list[int]] = []

    def fake(groups: list[int], *, backend: str | None = None) -> Machine:
        asked.append(list(groups))
        return _machine(list(groups), name=machine_key(backend))

    monkeypatch.setattr(calibrate, "measure_machine", fake)
    first = cached_machine((1, 2), cache_dir=tmp_path, backend="gloo")
    both = cached_machine((2, 4), cache_dir=tmp_path, backend="gloo")
    again = cached_machine((4, 2), cache_dir=tmp_path, backend="gloo")
    assert asked == [[2], [4]]
    assert set(first.links["all_reduce"]) == {2}
    assert set(both.links["all_gather"]) == {2, 4} and set(both.compute_slowdown) == {2, 4}
    assert again == both
    assert [p.name for p in tmp_path.iterdir()] == [cache_file(tmp_path, "gloo").name]
    cached_machine((2,), cache_dir=tmp_path, backend="gloo", refresh=True)
    assert asked[-1] == [2]


def test_cache_folder_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MESHSPLIT_CACHE_DIR", str(tmp_path))
    path = cache_file(backend="gloo")
    assert path.parent == tmp_path and path.name.startswith("machine-")
    assert cache_file(backend="gloo") != cache_file(backend="nccl")


def test_unreadable_cache_names_the_file_and_the_fix(tmp_path) -> None:
    cache_file(tmp_path, "gloo").write_text("{not json")
    with pytest.raises(PlanError, match="refresh=True"):
        cached_machine((2,), cache_dir=tmp_path, backend="gloo")


@pytest.mark.timeout(180)
def test_measures_this_machine_once_then_reads_the_cache(tmp_path, monkeypatch) -> None:
    machine = cached_machine((2,), cache_dir=tmp_path, backend="gloo")
    for op in OPERATIONS:
        link = machine.links[op][2]
        assert link.alpha_s > 0 and link.bytes_per_s > 0, (op, link)
    slowdown = machine.compute_slowdown[2]
    assert math.isfinite(slowdown) and slowdown > 0
    assert machine.cores == len(os.sched_getaffinity(0))
    assert cache_file(tmp_path, "gloo").exists()

    def no_measuring(*args: object, **kwargs: object) -> Machine:
        raise AssertionError("the cached machine should have been read, not measured")

    monkeypatch.setattr(calibrate, "measure_machine", no_measuring)
    assert cached_machine((2,), cache_dir=tmp_path, backend="gloo") == machine


def test_sharing_times_a_blocking_all_reduce_at_every_payload_in_real_workers() -> None:
    """What a collective costs busy ranks is measured per payload (the price per byte in
    lockstep is not the idle link's), and a larger payload is never priced below a smaller.
    The optimizer is a lambda, as users write it: the workers fork instead of unpickling it."""
    model = nn.Sequential(nn.Linear(8, 8))
    batch = (torch.randn(16, 8), torch.randint(0, 8, (16,)))
    sharing = measure_sharing(
        model, batch, 2, cores=2, window_s=0.02,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )  # fmt: skip
    points = sharing.lockstep_s[2]
    assert [nbytes for nbytes, _ in points] == [float(n) for n in LOCKSTEP_PAYLOADS]
    seconds = [s for _, s in points]
    assert seconds == sorted(seconds) and seconds[-1] > 0
    assert sharing.slowdown >= 1.0
    machine = Machine(name="busy", links={}, lockstep_s=sharing.lockstep_s)
    assert Machine.from_dict(json.loads(machine.to_json())) == machine


def test_the_sharing_slowdown_is_the_median_trial_of_the_slowest_worker() -> None:
    alone = [10.0, 10.0, 20.0]  # the third trial's lone steps ran in a burst of other load
    together = [[12.0, 30.0, 22.0], [13.0, 11.0, 21.0]]  # worker 0's second window too
    assert trials_slowdown(alone, together) == pytest.approx(1.3)  # of 1.3, 3.0, 1.1
    assert trials_slowdown([10.0], [[9.0], [8.0]]) == 1.0  # never faster than alone
