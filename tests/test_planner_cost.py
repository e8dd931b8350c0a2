"""The planner's pure parts on made-up numbers: pipeline simulation, cost terms, search, reasons."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

import meshsplit as ms
from meshsplit.pipeline.schedules import schedule
from meshsplit.planner.cost import TERMS, predict, simulate_pipeline
from meshsplit.planner.explain import reason
from meshsplit.planner.machine import Link, Machine
from meshsplit.planner.search import search
from meshsplit.planner.workload import Item, Line, Traffic, Workload

MiB = 2**20


def _machine(alpha: float = 1e-4, rate: float = 1e9, cores: int | None = None) -> Machine:
    links = {
        op: {size: Link(alpha, rate) for size in (2, 4, 8, 16, 32, 64)}
        for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
    }
    return Machine(name="synthetic", links=links, cores=cores)


def _workload(items: int = 8, widths: tuple[int, ...] = (1, 2, 4), rows: int = 64) -> Workload:
    """`items` equal layers; at width k each computes 1/k as long and all-reduces 4 KiB/row."""
    per_width = {}
    for k in widths:
        traffic = (Traffic("all_reduce", 1, 4096.0),) if k > 1 else ()
        per_width[k] = tuple(
            Item(
                name=f"layer{i}",
                forward=Line(((1, 1e-4 + 1e-5 / k), (64, 1e-4 + 64e-5 / k))),
                backward=Line(((1, 2e-4 + 2e-5 / k), (64, 2e-4 + 128e-5 / k))),
                parameter_bytes=4 * MiB // k,
                output_bytes_per_row=4096.0,
                saved_bytes_per_row=8192.0 / k,
                forward_traffic=traffic,
                backward_traffic=traffic,
            )
            for i in range(items)
        )
    return Workload(
        items=per_width,
        loss_forward=Line.per_row(1e-6),
        loss_backward=Line.per_row(1e-6),
        optimizer_s_per_byte=1e-10,
        optimizer_state_per_byte=1.0,
        global_rows=rows,
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 4), (4, 8), (3, 1)])
def test_equal_stages_take_m_plus_p_minus_one_ticks(name: str, stages: int, micro: int) -> None:
    intervals = simulate_pipeline(
        schedule(name, stages, micro), [1.0] * stages, [2.0] * stages, [0.0] * stages
    )
    assert max(i.end_s for i in intervals) == pytest.approx((micro + stages - 1) * 3.0)
    for s in range(stages):  # a stage never runs two actions at once
        mine = sorted((i.start_s, i.end_s) for i in intervals if i.stage == s)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def test_a_message_delays_the_next_stage() -> None:
    quiet = simulate_pipeline(schedule("1f1b", 2, 2), [1.0, 1.0], [1.0, 1.0], [0.0, 0.0])
    slow = simulate_pipeline(schedule("1f1b", 2, 2), [1.0, 1.0], [1.0, 1.0], [0.5, 0.5])
    assert max(i.end_s for i in slow) > max(i.end_s for i in quiet) + 0.9


@pytest.mark.parametrize(
    "plan",
    [
        ms.Plan(),
        ms.Plan(dp=4),
        ms.Plan(tp=4),
        ms.Plan(pp=4, micro_batches=8),
        ms.Plan(dp=2, pp=2, micro_batches=4, schedule="gpipe", recompute="always"),
        ms.Plan(dp=2, tp=2, zero=True),
    ],
)
def test_terms_sum_to_the_step_time(plan: ms.Plan) -> None:
    for cores in (None, 2):
        prediction = predict(_workload(), _machine(cores=cores), plan)
        assert set(prediction.terms) == set(TERMS)
        assert all(value >= 0 for value in prediction.terms.values())
        assert sum(prediction.terms.values()) == pytest.approx(prediction.step_time_s)


def test_each_term_answers_its_own_cause() -> None:
    work, machine = _workload(), _machine()
    few = predict(work, machine, ms.Plan(pp=4, micro_batches=4))
    many = predict(work, machine, ms.Plan(pp=4, micro_batches=16))
    assert many.terms["bubble"] < few.terms["bubble"]
    cheap = predict(work, _machine(alpha=1e-5), ms.Plan(tp=4))
    dear = predict(work, _machine(alpha=1e-2), ms.Plan(tp=4))
    assert dear.terms["communication_tp"] > 10 * cheap.terms["communication_tp"] > 0
    assert predict(work, machine, ms.Plan(dp=4)).terms["communication_dp"] > 0
    again = predict(work, machine, ms.Plan(pp=2, micro_batches=2, recompute="always"))
    assert again.terms["recompute"] > 0
    shared = predict(work, _machine(cores=2), ms.Plan(dp=4))
    own = predict(work, _machine(cores=None), ms.Plan(dp=4))
    assert shared.terms["sharing"] > 0 and own.terms["sharing"] == 0
    assert shared.step_time_s > own.step_time_s
    sharded = predict(work, machine, ms.Plan(dp=4, zero=True))
    whole = predict(work, machine, ms.Plan(dp=4))
    assert sharded.terms["optimizer"] < whole.terms["optimizer"]
    assert max(sharded.memory_bytes) < max(whole.memory_bytes)


def test_each_zero_stage_trades_memory_for_dp_traffic_as_the_paper_says() -> None:
    work, machine = _workload(), _machine()
    stages = [predict(work, machine, ms.Plan(dp=4, zero=z)) for z in range(4)]
    memory = [max(p.memory_bytes) for p in stages]
    assert memory[0] > memory[1] > memory[2] > memory[3]
    sent = [p.bytes_per_step["dp"] for p in stages]
    # all-reduce 2Ψ(dp-1)/dp; zero 1 adds the gather of the updated shards; zero 2 scatters
    # the gradients and gathers the parameters once, zero 3 gathers them for backward too
    parameters = sum(item.parameter_bytes for item in work.items[1]) * 3 / 4
    assert sent == pytest.approx([2 * parameters, 3 * parameters, 2 * parameters, 3 * parameters])
    assert stages[3].terms["communication_dp"] > stages[2].terms["communication_dp"]


def test_memory_follows_the_split_and_the_schedule() -> None:
    work, machine = _workload(), _machine()
    whole = max(predict(work, machine, ms.Plan()).memory_bytes)
    assert max(predict(work, machine, ms.Plan(tp=4)).memory_bytes) < 0.5 * whole
    gpipe = predict(work, machine, ms.Plan(pp=2, micro_batches=8, schedule="gpipe"))
    one_f = predict(work, machine, ms.Plan(pp=2, micro_batches=8))
    assert gpipe.memory_bytes[0] > one_f.memory_bytes[0]


def test_search_ranks_and_says_why_each_plan_cannot_run() -> None:
    work = _workload(items=3, widths=(1, 2))
    work = Workload(**{**work.__dict__, "refused": {4: "head count 2 does not split over 4"}})
    ranking = search(work, _machine(), 4)
    times = [row.step_time_s for row in ranking.rows]
    assert times == sorted(times) and times
    reasons = {(plan.dp, plan.pp, plan.tp): why for plan, why in ranking.infeasible}
    assert "divisibility" in reasons[(1, 1, 4)]
    assert "layer count" in reasons[(1, 4, 1)]
    tight = search(work, _machine(), 4, memory_budget=1)
    assert not tight.rows
    assert all("memory" in why for _, why in tight.infeasible if "divisibility" not in why
               and "layer count" not in why)  # fmt: skip


def test_a_budget_prunes_plans_that_need_more() -> None:
    work, machine = _workload(), _machine()
    everything = search(work, machine, 4)
    limit = sorted(max(r.memory_bytes) for r in everything.rows)[len(everything.rows) // 2]
    pruned = search(work, machine, 4, memory_budget=limit)
    assert pruned.rows and len(pruned.rows) < len(everything.rows)
    assert all(max(r.memory_bytes) <= limit for r in pruned.rows)


def test_sixty_four_devices_are_searched_in_under_ten_seconds() -> None:
    work = _workload(items=24, widths=(1, 2, 4, 8, 16, 32, 64), rows=512)
    started = time.perf_counter()
    ranking = search(work, _machine(), 64)
    assert time.perf_counter() - started < 10
    assert len(ranking.rows) > 100
    shapes = {(r.plan.dp, r.plan.pp, r.plan.tp) for r in ranking.rows}
    assert (64, 1, 1) in shapes and (1, 1, 64) in shapes and (4, 4, 4) in shapes


def test_a_losing_plan_is_told_its_losing_term() -> None:
    work, machine = _workload(), _machine(alpha=5e-3)
    best = predict(work, machine, ms.Plan(dp=4))
    tp = predict(work, machine, ms.Plan(tp=4))
    sentence = reason(tp, best, machine)
    assert (
        sentence.startswith("dp1 pp1 tp4: ")
        and "all-reduce" in sentence
        and "over tp=4" in sentence
    )
    assert (" ms" in sentence or " us" in sentence) and ("KiB" in sentence or "MiB" in sentence)
    same = reason(best, best, machine)
    assert "as fast as the best" in same


def test_the_predicted_schedule_is_drawn_as_each_stage_runs_it() -> None:
    from meshsplit.cli.timeline import predicted_events

    plan = ms.Plan(pp=2, micro_batches=4)
    prediction = predict(_workload(), _machine(cores=2), plan)
    events = predicted_events(prediction)
    for stage, actions in enumerate(schedule("1f1b", 2, 4)):
        mine = sorted((e for e in events if e.rank == stage), key=lambda e: e.start_s)
        names = [e.name for e in mine if e.kind in ("forward", "backward")]
        kinds = {"F": "forward", "B": "backward"}
        assert names == [f"{kinds[a.kind]}, micro-batch {a.micro}" for a in actions]
        assert mine[-1].name == "optimizer step"
    assert max(e.end_s for e in events) <= prediction.step_time_s * (1 + 1e-9)


def test_the_optimizer_is_timed_stepping_every_parameter() -> None:
    """The step drops the gradients after using them; timed on its own afterwards, an
    optimizer would skip every parameter and be priced at nothing."""
    import torch

    from meshsplit.planner.measure import measure_workload

    stepped: list[tuple[int, int]] = []  # (parameters with a gradient, parameters) per step

    class Counting(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            params = [p for g in self.param_groups for p in g["params"]]
            stepped.append((sum(p.grad is not None for p in params), len(params)))
            return super().step(closure)

    model = ms.models.mlp((16, 32, 8))
    batch = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    work = measure_workload(
        model, batch, widths=[1], optimizer=lambda p: Counting(p, lr=0.1), sizes=[8]
    )
    parameters = len(list(model.parameters()))
    whole = [given for given, held in stepped if held == parameters]
    assert whole and set(whole) == {parameters}, stepped  # each step saw every gradient
    assert work.optimizer_s_per_byte > 0


def test_a_blocking_collective_costs_what_one_of_its_payload_did_in_lockstep() -> None:
    """Busy ranks wake each other at every hop of a collective: a 512 KiB all-reduce between
    bursts of work took 2.5-2.8 ms here against 0.8 ms between idle ranks, and operator
    splits ran 25-40% over predictions that priced its bytes at the idle link's bandwidth."""
    work = _workload(items=8, widths=(1, 2))  # 16 all-reduces of 256 KiB a step at tp2
    idle = _machine(alpha=1e-4, rate=1e9)
    idle_s = 1e-4 + 256 * 1024 / 1e9
    table = ((4.0, 1e-3), (64 * 1024.0, 2e-3), (512 * 1024.0, 3e-3))
    cases = {
        table: 2e-3 + 1e-3 * (256 - 64) / (512 - 64),  # between two points
        table[:2]: 2e-3 + (256 - 64) * 1024 / 1e9,  # past the last: the link's bandwidth
        ((4.0, 1e-5),): idle_s,  # cheaper in lockstep than idle: the idle price
    }
    plan = ms.Plan(tp=2)
    before = predict(work, idle, plan).terms["communication_tp"]
    assert before == pytest.approx(16 * idle_s, rel=1e-6)
    for points, each in cases.items():
        busy = replace(idle, lockstep_s={2: points})
        assert predict(work, busy, plan).terms["communication_tp"] == pytest.approx(
            16 * each, rel=1e-6
        )


def test_the_exchange_that_ends_a_step_is_priced_unless_it_rides_the_gradients() -> None:
    """Every step ends in one small all-reduce over the mesh (the mean loss, the non-finite
    flags, the batch check), 4-7 ms on 4 workers sharing 2 cores here; under data parallel
    alone in float32 it rides the first gradient bucket instead."""
    work = _workload(items=8, widths=(1, 2))
    busy = replace(_machine(alpha=1e-4, rate=1e9), lockstep_s={2: ((4.0, 5e-3),)})
    paying = 5e-3 + (8 * 11 - 4) / 1e9
    for plan, extra in (
        (ms.Plan(), 0.0),
        (ms.Plan(dp=2), 0.0),
        (ms.Plan(dp=2, zero=1), 0.0),
        (ms.Plan(dp=2, zero=2), paying),  # FSDP2's reductions carry nothing
        (ms.Plan(dp=2, reduce_dtype="bf16"), paying),  # the loss would lose its digits
        (ms.Plan(tp=2), paying),
        (ms.Plan(pp=2, micro_batches=2), paying),
    ):
        assert predict(work, busy, plan).terms["overhead"] == pytest.approx(extra, rel=1e-6), plan


def test_batchnorm_over_dp_waits_for_its_collectives_in_each_micro_batch() -> None:
    """Each BatchNorm under dp all-gathers its statistics in forward and all-reduces two sums
    in backward, blocking, per micro-batch: a ResNet-style model's dp2 step ran 20-40%
    over its prediction while none of them was priced."""
    plain = _workload(items=4, widths=(1,))
    normed = replace(
        plain,
        items={1: tuple(replace(item, batch_norm_channels=(64, 64)) for item in plain.items[1])},
    )
    # links fast enough that the gradient all-reduce hides behind backward either way
    machine = replace(_machine(alpha=1e-3, rate=1e12), lockstep_s={2: ((4.0, 2e-3),)})
    for plan in (ms.Plan(), ms.Plan(pp=2, micro_batches=4)):  # no dp: nothing to wait for
        assert (
            predict(normed, machine, plan).step_time_s == predict(plain, machine, plan).step_time_s
        )
    for plan, m in ((ms.Plan(dp=2), 1), (ms.Plan(dp=2, micro_batches=4), 4)):
        extra = (
            predict(normed, machine, plan).step_time_s - predict(plain, machine, plan).step_time_s
        )
        # 8 BatchNorms, two collectives each at the lockstep price, plus their bytes
        per = 2e-3 + 4 * 3 * 64 / 1e12 + 2e-3 + 4 * 2 * 64 / 1e12
        assert extra == pytest.approx(m * 8 * per, rel=1e-6)
        terms = predict(normed, machine, plan).terms
        assert terms["communication_dp"] >= m * 8 * per
