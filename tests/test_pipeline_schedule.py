"""Schedules checked without processes: order, in-flight bound, no deadlock, the bubble, the
diagram (GPipe, 1F1B, interleaved 1F1B, zero bubble)."""

from __future__ import annotations

import pytest

import meshsplit as ms
from meshsplit.pipeline.schedules import (
    Action,
    bubble_fraction,
    diagram,
    idle_fraction,
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


INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (1, 2, 3)]


@pytest.mark.parametrize(("stages", "micro", "chunks"), INTERLEAVED)
def test_interleaved_runs_every_micro_batch_through_each_chunk_of_its_rank(
    stages: int, micro: int, chunks: int
) -> None:
    plan = schedule("interleaved", stages, micro, chunks)
    for rank, actions in enumerate(plan):
        assert len(actions) == 2 * micro * chunks
        position = {(a.kind, a.micro, a.chunk): i for i, a in enumerate(actions)}
        assert len(position) == len(actions)
        for j in range(micro):
            for c in range(rank, stages * chunks, stages):
                assert position[("F", j, c)] < position[("B", j, c)]
        # Megatron's warm-up: (p - r - 1) * 2 + (v - 1) * p forwards before the first B
        first_backward = next(i for i, a in enumerate(actions) if a.kind == "B")
        warmup = min((stages - rank - 1) * 2 + (chunks - 1) * stages, micro * chunks)
        assert first_backward == warmup + (warmup < micro * chunks)
    timeline(plan)  # blocking receives and non-blocking sends never deadlock


def test_interleaved_starts_through_its_chunks_in_groups_of_p() -> None:
    ranks = schedule("interleaved", 2, 4, 2)
    assert [str(a) for a in ranks[0][:6]] == ["F0:0", "F1:0", "F0:2", "F1:2", "F2:0", "B0:2"]
    assert [str(a) for a in ranks[1][:5]] == ["F0:1", "F1:1", "F0:3", "B0:3", "F1:3"]


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 8), (4, 16), (3, 6)])
def test_interleaving_shrinks_the_bubble(stages: int, micro: int) -> None:
    one = idle_fraction(schedule("1f1b", stages, micro))
    two = idle_fraction(schedule("interleaved", stages, micro, 2))
    assert one == pytest.approx(bubble_fraction(stages, micro))
    assert two == pytest.approx((stages - 1) / (2 * micro + stages - 1))
    assert two < one


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_zero_bubble_splits_each_backward_and_keeps_1f1bs_peak_memory(
    stages: int, micro: int
) -> None:
    plan = schedule("zero-bubble", stages, micro)
    for actions in plan:
        position = {(a.kind, a.micro): i for i, a in enumerate(actions)}
        assert len(position) == len(actions) == 3 * micro
        for j in range(micro):
            assert position[("F", j)] < position[("B", j)] < position[("W", j)]
        # every rank holds at most p micro-batches (F to W), as 1F1B's first stage does
        assert max_in_flight(actions) == min(stages, micro)
    timeline(plan)


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_fills_two_thirds_of_the_1f1b_bubble(stages: int, micro: int) -> None:
    # at F = B = W = 1 the bubble is (p-1)(F+B-W) = p-1 ticks of 3m + p-1; 1F1B's is 3(p-1)
    idle = idle_fraction(schedule("zero-bubble", stages, micro))
    assert idle == pytest.approx((stages - 1) / (3 * micro + stages - 1))
    assert idle < idle_fraction(schedule("1f1b", stages, micro))


def test_a_weight_gradient_before_its_backward_deadlocks() -> None:
    bad = schedule("zero-bubble", 2, 2)
    bad[1] = [Action("W", 0), *[a for a in bad[1] if a != Action("W", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        timeline(bad)


def test_diagram_draws_chunks_and_split_backwards() -> None:
    assert diagram(schedule("zero-bubble", 2, 2)) == (
        "stage 0 | F0 F1 .. B0 W0 B1 W1\nstage 1 | .. F0 B0 F1 B1 W0 W1"
    )
    assert diagram(schedule("interleaved", 2, 2, 2)) == (
        "stage 0 | F0:0 F1:0 F0:2 F1:2 ..   B0:2 ..   B1:2 B0:0 B1:0\n"
        "stage 1 | ..   F0:1 F1:1 F0:3 B0:3 F1:3 B1:3 B0:1 B1:1 .."
    )


def test_interleaved_needs_micro_batches_in_groups_of_p() -> None:
    with pytest.raises(ms.PlanError, match="micro_batches=3 to be a multiple of pp=2"):
        schedule("interleaved", 2, 3, 2)
