"""The measured timeline of one step: every phase and wait, in the schedule's order, per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit import phases
from meshsplit.cli import timeline
from meshsplit.cli.timeline import Event
from meshsplit.pipeline.schedules import schedule
from meshsplit.pipeline.schedules import timeline as ticks

from cli_runner import run_meshsplit

PLANS = {
    "1f1b": ms.Plan(pp=2, micro_batches=4, schedule="1f1b"),
    "gpipe": ms.Plan(pp=2, micro_batches=4, schedule="gpipe"),
    "dp": ms.Plan(dp=2, micro_batches=2),
    "tp": ms.Plan(tp=2),
}


def _record_each_plan() -> dict[str, list[Event]]:
    recorded = {}
    for name, plan in PLANS.items():
        torch.manual_seed(0)
        engine = ms.parallelize(ms.models.mlp((784, 64, 32, 10)), plan)
        x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
        engine.train_step(x, y)  # warm: headers learnt, optimizer state made
        recorded[name] = timeline.record_step(engine, x, y)
        engine.close()
    return recorded


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[Event]]:
    per_rank = ms.launch(_record_each_plan, 2)
    assert per_rank[0] == per_rank[1]  # gathered: the same events on every rank
    return per_rank[0]


def _top(events: list[Event], rank: int) -> list[Event]:
    return [e for e in events if e.rank == rank and e.depth == 0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_each_stage_runs_every_micro_batch_in_its_schedules_order(recorded, name) -> None:
    events = recorded[name]
    for stage, actions in enumerate(schedule(name, 2, 4)):
        steps = [e for e in _top(events, stage) if e.kind in ("forward", "backward")]
        assert [f"{e.kind[0].upper()}{e.name.split()[-1]}" for e in steps] == [
            str(a) for a in actions
        ]
    first = [e.kind for e in _top(events, 0) if e.kind in ("forward", "backward")]
    if name == "gpipe":
        assert first == ["forward"] * 4 + ["backward"] * 4
    else:
        assert first[:4] == ["forward", "forward", "backward", "forward"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(PLANS))
def test_events_of_a_rank_do_not_overlap_and_the_optimizer_step_ends_it(recorded, name) -> None:
    events = recorded[name]
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        for depth in {e.depth for e in mine}:
            level = sorted((e for e in mine if e.depth == depth), key=lambda e: e.start_s)
            for before, after in zip(level, level[1:], strict=False):
                assert before.end_s <= after.start_s, (before, after)
        outer = _top(mine, rank)
        for inner in (e for e in mine if e.depth == 1):
            assert any(o.start_s <= inner.start_s <= inner.end_s <= o.end_s for o in outer)
        assert outer[-1].name == "optimizer step"
        assert all(0 <= e.start_s <= e.end_s for e in mine)


@pytest.mark.timeout(300)
def test_waits_name_what_each_rank_waited_for(recorded) -> None:
    for name in ("1f1b", "gpipe"):
        for rank in (0, 1):
            waits = [e for e in recorded[name] if e.rank == rank and e.kind == "wait"]
            receives = [e for e in waits if e.name == "p2p wait, receive"]
            assert receives and all(e.args["peers"] == [1 - rank] for e in receives)
            assert all(e.args["bytes"] > 0 for e in receives)
    for rank in (0, 1):
        mine = [e for e in recorded["dp"] if e.rank == rank]
        assert not any(e.name.startswith("p2p") for e in mine)
        (sync,) = [e for e in mine if e.kind == "sync"]
        reduces = [e for e in mine if e.name == "all-reduce wait"]
        assert reduces and all(sync.start_s <= e.start_s <= e.end_s <= sync.end_s for e in reduces)
        assert all(e.depth == 1 and e.args["bytes"] > 0 for e in reduces)
        # an operator split waits for its tp peer inside the forward (this MLP's backward
        # needs no collective: the first layer's input takes no gradient)
        tp = [e for e in recorded["tp"] if e.rank == rank]
        (forward,) = [e for e in tp if e.kind == "forward"]
        waits = [e for e in tp if e.kind == "wait"]
        assert waits and all(e.name == "tp all-reduce wait" for e in waits)
        assert all(forward.start_s <= e.start_s <= e.end_s <= forward.end_s for e in waits)
        assert all(e.depth == 1 and e.args["bytes"] > 0 for e in waits)


def _predicted(name: str, tick_s: float = 1e-3) -> list[Event]:
    return [
        Event(rank=stage, name=f"{'forward' if a.kind == 'F' else 'backward'}, micro-batch "
              f"{a.micro}", start_s=t * tick_s, end_s=(t + 1) * tick_s,
              kind="forward" if a.kind == "F" else "backward")
        for stage, row in enumerate(ticks(schedule(name, 2, 4)))
        for t, a in enumerate(row) if a is not None
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_the_trace_loads_with_what_perfetto_needs_and_the_gantt_is_drawn(
    recorded, tmp_path: Path
) -> None:
    events, predicted = recorded["1f1b"], _predicted("1f1b")
    path = timeline.write_chrome_trace(events, tmp_path / "step.json", predicted=predicted)
    trace: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    slices = [t for t in trace if t["ph"] == "X"]
    assert len(slices) == len(events) + len(predicted)
    for item in slices:
        assert {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"} <= item.keys()
    names = {t["pid"]: t["args"]["name"] for t in trace if t["name"] == "process_name"}
    assert sorted(names.values()) == ["measured", "predicted"]
    first = next(t for t in slices if names[t["pid"]] == "measured")
    assert first["ts"] == pytest.approx(events[0].start_s * 1e6)
    assert first["dur"] == pytest.approx(events[0].duration_s * 1e6)
    picture = timeline.draw_gantt(events, tmp_path / "step.png", predicted=predicted)
    assert picture.read_bytes()[:4] == b"\x89PNG" and picture.stat().st_size > 10_000


def test_a_wait_is_timed_inside_its_phase_and_leaves_the_phase_as_it_was() -> None:
    with timeline.record() as events:  # no process group: this process only
        with (
            phases.phase("forward, micro-batch 0"),
            phases.waiting("p2p wait, receive", lambda: {"bytes": 4}),
        ):
            assert phases.current() == "forward, micro-batch 0"  # memory labels unchanged
        with phases.phase("optimizer step"):
            pass
    assert [(e.name, e.depth, e.kind) for e in events] == [
        ("forward, micro-batch 0", 0, "forward"),
        ("p2p wait, receive", 1, "wait"),
        ("optimizer step", 0, "optimizer"),
    ]
    assert events[1].args == {"bytes": 4} and not phases._clocks


@pytest.mark.timeout(300)
def test_train_writes_the_timeline_of_one_step(tmp_path: Path) -> None:
    done = run_meshsplit(
        "train", "--model", "mlp", "--pp", "2", "--micro-batches", "2", "--epochs", "1",
        "--batch-size", "256", "--timeline", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    slices = [t for t in trace if t["ph"] == "X" and t["pid"] == 1]  # measured
    assert {t["tid"] for t in slices} == {0, 1}
    assert sum(t["name"].startswith("backward") for t in slices) == 4  # 2 per stage
    predicted = [t for t in trace if t["ph"] == "X" and t["pid"] == 2]  # the planner's
    assert sum(t["name"].startswith("backward") for t in predicted) == 4
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
