"""Schedules checked without processes: order, in-flight bound, no deadlock, the diagram."""

from __future__ import annotations

import pytest

from meshsplit.pipeline.schedules import (
    bubble_fraction,
    diagram,
    max_in_flight,
    schedule,
    timeline,
)

SHAPES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 4, 7)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_every_micro_batch_runs_forward_then_backward_once(
    name: str, stages: int, micro: int
) -> None:
    for actions in schedule(name, stages, micro):
        forwards = [a.micro for a in actions if a.kind == "F"]
        backwards = [a.micro for a in actions if a.kind == "B"]
        assert sorted(forwards) == sorted(backwards) == list(range(micro))
        position = {(a.kind, a.micro): i for i, a in enumerate(actions)}
        for j in range(micro):
            assert position[("F", j)] < position[("B", j)]


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_1f1b_keeps_at_most_p_minus_i_in_flight(stages: int, micro: int) -> None:
    for i, actions in enumerate(schedule("1f1b", stages, micro)):
        assert max_in_flight(actions) <= stages - i
        assert max_in_flight(actions) == min(stages - i, micro)


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_gpipe_holds_every_micro_batch(stages: int, micro: int) -> None:
    for actions in schedule("gpipe", stages, micro):
        assert max_in_flight(actions) == micro


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_schedules_never_deadlock_and_take_the_ideal_ticks(
    name: str, stages: int, micro: int
) -> None:
    ticks = timeline(schedule(name, stages, micro))
    # with F and B of one tick each, both finish in 2(m + p - 1) ticks: the textbook bubble
    assert len(ticks[0]) == 2 * (micro + stages - 1)
    busy = sum(a is not None for row in ticks for a in row)
    idle = 1 - busy / (stages * len(ticks[0]))
    assert idle == pytest.approx(bubble_fraction(stages, micro))


def test_a_schedule_that_waits_for_itself_is_reported() -> None:
    bad = schedule("1f1b", 2, 2)
    bad[1] = list(reversed(bad[1]))  # last stage runs B1 before any forward
    with pytest.raises(ValueError, match="deadlocks"):
        timeline(bad)


def test_diagram_draws_clock_cycles() -> None:
    assert diagram(schedule("1f1b", 2, 4)) == (
        "stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3\nstage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 .."
    )
    assert diagram(schedule("gpipe", 2, 4)) == (
        "stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3\nstage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 .."
    )
