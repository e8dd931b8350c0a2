"""The planner prices every pipeline schedule and parameter servers, on made-up numbers.

Interleaving and zero bubble are priced by replaying the runtime's own action lists; the
parameter servers by their push, pull and optimizer step. No worker processes: pure pricing
(one `choose_plan` measures a small model in this process).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace

import pytest
import torch

import meshsplit as ms
from meshsplit.pipeline.schedules import schedule
from meshsplit.planner.cost import Prediction, predict
from meshsplit.planner.explain import reason
from meshsplit.planner.machine import OPERATIONS, Link, Machine
from meshsplit.planner.schedule_cost import shared_slowdowns, simulate_pipeline
from meshsplit.planner.search import search
from meshsplit.planner.sharing import Bursts, _mean_step_s, _message_s_matching
from meshsplit.planner.workload import Item, Line, Workload

MiB = 2**20


def _machine(alpha: float = 0.0, rate: float = 1e15) -> Machine:
    """Every link alike; by default free, so the step is compute alone (compute-bound)."""
    link = Link(alpha, rate)
    return Machine(name="made-up", links={op: {2: link, 4: link, 8: link} for op in OPERATIONS})


def _workload(items: int = 16, rows: int = 64) -> Workload:
    """`items` equal layers, backward twice forward (B and W one forward each), no loss."""
    layers = tuple(
        Item(
            name=f"layer{i}",
            forward=Line.per_row(1e-5),
            backward=Line.per_row(2e-5),
            parameter_bytes=MiB,
            output_bytes_per_row=4096.0,
            saved_bytes_per_row=8192.0,
        )
        for i in range(items)
    )
    return Workload(
        items={1: layers},
        loss_forward=Line.per_row(0.0),
        loss_backward=Line.per_row(0.0),
        optimizer_s_per_byte=1e-10,
        optimizer_state_per_byte=2.0,
        global_rows=rows,
    )


def _bubble_share(prediction: Prediction) -> float:
    return prediction.terms["bubble"] / prediction.terms["compute"]


@pytest.mark.parametrize("virtual_stages", [2, 4])
def test_interleaving_shrinks_the_bubble_v_times_for_more_messages(virtual_stages: int) -> None:
    p, m, v = 4, 8, virtual_stages
    plain = ms.Plan(pp=p, micro_batches=m)
    chunked = ms.Plan(pp=p, micro_batches=m, schedule="interleaved", virtual_stages=v)
    work = _workload()
    one_f = predict(work, _machine(), plain)
    inter = predict(work, _machine(), chunked)
    assert _bubble_share(one_f) == pytest.approx((p - 1) / m, rel=0.02)
    assert _bubble_share(inter) == pytest.approx((p - 1) / (v * m), rel=0.02)
    assert inter.terms["compute"] == pytest.approx(one_f.terms["compute"])
    assert inter.stages == (16 // (p * v),) * (p * v)  # one balanced split per chunk
    # messages that cost: v times the bytes between stages and more time waiting on them
    dear = _machine(alpha=1e-3, rate=1e9)
    one_f, inter = predict(work, dear, plain), predict(work, dear, chunked)
    assert inter.bytes_per_step["pp"] >= v * one_f.bytes_per_step["pp"]
    assert inter.terms["communication_pp"] > one_f.terms["communication_pp"] > 0
    # early ranks hold more micro-batches' activations at once
    assert inter.memory_bytes[0] > one_f.memory_bytes[0]


def test_zero_bubble_leaves_a_third_of_the_bubble_for_what_w_keeps() -> None:
    work, machine = _workload(), _machine()
    shapes = {name: ms.Plan(pp=4, micro_batches=8, schedule=name) for name in ("1f1b", "gpipe")}
    one_f, gpipe = (predict(work, machine, plan) for plan in shapes.values())
    zb = predict(work, machine, ms.Plan(pp=4, micro_batches=8, schedule="zero-bubble"))
    assert zb.terms["bubble"] == pytest.approx(one_f.terms["bubble"] / 3, rel=0.02)
    assert zb.step_time_s < one_f.step_time_s
    assert zb.terms["compute"] == pytest.approx(one_f.terms["compute"])  # B + W = backward
    # the first rank holds what 1F1B's does; later ones also the graphs W has not read yet
    assert zb.memory_bytes[0] == one_f.memory_bytes[0]
    assert zb.memory_bytes[-1] > one_f.memory_bytes[-1]
    assert max(zb.memory_bytes) <= max(gpipe.memory_bytes)


def test_zbv_halves_zero_bubbles_bubble_at_the_activations_of_1f1b() -> None:
    work, machine = _workload(), _machine()
    plans = {
        name: ms.Plan(pp=4, micro_batches=8, schedule=name)
        for name in ("1f1b", "zero-bubble", "zbv")
    }
    one_f, zb, zbv = (predict(work, machine, plan) for plan in plans.values())
    assert zbv.stages == (2,) * 8  # two half-stage chunks per rank
    assert zbv.terms["bubble"] < 0.6 * zb.terms["bubble"] < one_f.terms["bubble"]
    assert zbv.terms["compute"] == pytest.approx(one_f.terms["compute"])
    # every rank holds up to p micro-batches of a stage (1F1B's first rank) and what W reads:
    # more than ZB-H1's, less than interleaving's warm-up or GPipe's m micro-batches
    chunked = ms.Plan(pp=4, micro_batches=8, schedule="interleaved", virtual_stages=2)
    gpipe = ms.Plan(pp=4, micro_batches=8, schedule="gpipe")
    peaks = {name: max(predict(work, machine, plan).memory_bytes) for name, plan in
             [("zb", plans["zero-bubble"]), ("il", chunked), ("gpipe", gpipe)]}  # fmt: skip
    assert peaks["zb"] < max(zbv.memory_bytes) < min(peaks["il"], peaks["gpipe"])
    assert any(r.plan.schedule == "zbv" for r in search(work, machine, 4).rows)


@pytest.mark.parametrize(
    ("name", "v"),
    [("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1), ("interleaved", 2), ("zbv", 2)],
)
def test_the_simulated_order_is_the_order_each_rank_runs(name: str, v: int) -> None:
    actions = schedule(name, 2, 4, v)
    chunks = 2 * v
    intervals = simulate_pipeline(
        actions, [1.0] * chunks, [1.0] * chunks, [0.1] * chunks, [1.0] * chunks
    )
    for rank, row in enumerate(actions):
        mine = sorted((i for i in intervals if i.stage == rank), key=lambda i: i.start_s)
        assert [(i.kind, i.micro, i.chunk) for i in mine] == [
            (a.kind, a.micro, a.chunk) for a in row
        ]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def test_the_search_prices_every_interleaving_the_model_can_cut() -> None:
    work = _workload(items=8)
    ranking = search(work, _machine(), 4)
    found = {(r.plan.pp, r.plan.micro_batches, r.plan.virtual_stages) for r in ranking.rows
             if r.plan.schedule == "interleaved"}  # fmt: skip
    # 8 trainable items: pp * v chunks up to 8, m a multiple of pp
    assert found == {(2, m, v) for m in (2, 4, 8) for v in (2, 4)} | {(4, m, 2) for m in (4, 8, 16)}
    assert any(r.plan.schedule == "zero-bubble" for r in ranking.rows)
    for row in ranking.rows:
        assert len(row.stages) == row.plan.pp * row.plan.virtual_stages
        replace(row.plan, stages=row.stages)  # the split choose_plan pins is a valid plan
    assert not [why for _, why in ranking.infeasible if "interleaved" in why or "chunk" in why]


def test_parameter_servers_are_priced_beside_the_all_reduce() -> None:
    work = _workload()
    machine = _machine(alpha=1e-4, rate=1e9)  # one link for every collective and message
    allreduce = predict(work, machine, ms.Plan(dp=2))
    served = predict(work, machine, ms.Plan(dp=2, sync="ps", servers=1))
    assert 0 < served.step_time_s < math.inf
    # a worker sends what a two-way all-reduce sends, 2(n-1)/n of its gradients, but also
    # waits for all the parameters to come back, and nothing hides either behind backward
    assert served.bytes_per_step["dp"] == allreduce.bytes_per_step["dp"] == 16 * MiB
    assert served.terms["communication_dp"] > 2 * allreduce.terms["communication_dp"] > 0
    assert served.step_time_s > allreduce.step_time_s
    # servers share the traffic and the optimizer; workers hold no optimizer state
    one = predict(work, machine, ms.Plan(dp=4, sync="ps", servers=1))
    two = predict(work, machine, ms.Plan(dp=4, sync="ps", servers=2))
    assert two.terms["communication_dp"] < one.terms["communication_dp"]
    assert two.terms["optimizer"] == pytest.approx(one.terms["optimizer"] / 2)
    assert two.server_bytes == pytest.approx(one.server_bytes / 2, rel=1e-6)
    whole = predict(work, machine, ms.Plan(dp=4)).memory_bytes[0]
    assert one.memory_bytes[0] == whole - 2 * 16 * MiB  # Adam's two moments are on the server
    assert "pushed to 1 parameter server" in reason(served, allreduce, machine)
    # on two cores, two workers beside two servers waiting in a receive do not crowd them
    two_cores = replace(machine, cores=2)
    crowded = predict(work, two_cores, ms.Plan(dp=4))
    assert predict(work, two_cores, ms.Plan(dp=2, sync="ps", servers=2)).terms["sharing"] == 0
    assert crowded.terms["sharing"] > 0


def test_the_search_ranks_parameter_servers_and_refuses_what_does_not_divide() -> None:
    work = _workload()
    ranking = search(work, _machine(alpha=1e-4, rate=1e9), 4)
    served = [r for r in ranking.rows if r.plan.sync == "ps"]
    assert {(r.plan.dp, r.plan.server_count, r.plan.staleness) for r in served} == {(2, 2, 0)}
    assert all(0 < r.step_time_s < math.inf and r.server_bytes > 0 for r in served)
    refused = {(p.dp, p.server_count): why for p, why in ranking.infeasible if p.sync == "ps"}
    assert "divisibility" in refused[(3, 1)]  # 64 rows over 3 workers
    times = [r.step_time_s for r in ranking.rows]
    assert times == sorted(times)
    # a budget between a worker's need and a server's refuses the servers alone
    need = served[0].server_bytes
    tight = search(work, _machine(alpha=1e-4, rate=1e9), 4, memory_budget=need - 1)
    assert tight.rows and not [r for r in tight.rows if r.plan.sync == "ps"]
    assert max(served[0].memory_bytes) < need


def test_choose_plan_ranks_the_new_schedules_and_servers() -> None:
    torch.manual_seed(0)
    x, y = ms.data.digits("train")
    report = ms.choose_plan(
        ms.models.mlp(), (x[:32], y[:32]), 4, machine=_machine(1e-4, 1e9), estimate_top=0
    )
    plans = [row.plan for row in report.rows]
    assert any(p.schedule == "interleaved" and p.virtual_stages == 2 for p in plans)
    assert any(p.schedule == "zero-bubble" for p in plans)
    assert any(p.sync == "ps" and p.servers == 2 and p.dp == 2 for p in plans)
    for row in report.rows:
        assert math.isclose(sum(row.terms.values()), row.step_time_s, rel_tol=1e-9)
        assert row.memory_source == "model" and min(row.peak_bytes) > 0


def test_zero_bubble_holds_the_gradients_w_reads_from_b_until_w() -> None:
    """Between a micro-batch's B and its W the chunk keeps, beyond its saved tensors, the
    gradients arriving where parameters leave the input path; 1F1B keeps none past B."""
    from meshsplit.planner.schedule_cost import peak_held

    zb = schedule("zero-bubble", 2, 4)
    one_f = schedule("1f1b", 2, 4)
    held, kept = [10.0, 10.0], [0.0, 5.0]
    assert peak_held(one_f[1], 1, held, kept) == peak_held(one_f[1], 1, held)
    extra = peak_held(zb[1], 1, held, kept) - peak_held(zb[1], 1, held)
    assert extra in (5.0, 10.0)  # one or two micro-batches between their B and W
    assert peak_held(zb[0], 0, held, kept) == peak_held(zb[0], 0, held)  # chunk 0 keeps none


def test_a_message_is_priced_at_what_makes_the_replay_last_as_long_as_the_real_pipeline() -> None:
    plan = ms.Plan(pp=4, micro_batches=8)
    forward, backward, together = 3e-4, 6e-4, 2.2  # four workers on two cores
    slowdown = shared_slowdowns(together, 4, 2, 1)

    def lasts(message_s: float) -> float:
        stages = [forward] * 4, [backward] * 4, [message_s] * 4, [0.0] * 4
        actions = schedule("1f1b", 4, 8)
        return max(i.end_s for i in simulate_pipeline(actions, *stages, slowdown))

    for message_s in (1e-4, 8e-4):
        bursts = Bursts(forward, backward, together, lasts(message_s))
        assert _message_s_matching(plan, bursts, cores=2) == pytest.approx(message_s, rel=1e-6)
    bursts = Bursts(forward, backward, together, lasts(0.0) / 2)
    assert _message_s_matching(plan, bursts, cores=2) == 0.0


def test_idle_pipeline_ranks_lend_their_cores_to_the_busy_ones() -> None:
    """Two busy ranks of four on two cores run at full speed (times the crowd's cost per
    core-second); four busy share the cores; a rank waiting for a message takes none."""
    assert shared_slowdowns(2.2, 4, 2, 1) == pytest.approx([1.1, 1.1, 1.65, 2.2])
    assert shared_slowdowns(2.2, 4, 2, 2) == pytest.approx([1.1, 2.2])  # each rank is 2 replicas
    assert shared_slowdowns(1.5, 4, 2, 1)[0] == 1.0  # never faster than alone
    actions = schedule("gpipe", 4, 1)  # one micro-batch: one rank busy at a time
    stages = [1.0] * 4, [1.0] * 4, [0.0] * 4
    alone = simulate_pipeline(actions, *stages, None, shared_slowdowns(2.2, 4, 2, 1))
    assert max(i.end_s for i in alone) == pytest.approx(8 * 1.1)
    many = schedule("gpipe", 2, 8)  # both ranks busy most of the time, each at 2/2 cores
    shared = simulate_pipeline(many, [1.0] * 2, [1.0] * 2, [0.0] * 2, None, [1.0, 1.0])
    assert max(i.end_s for i in shared) == pytest.approx(18.0)  # as on a core each


def test_a_link_timed_over_workers_that_fill_the_cores_is_not_stretched_twice() -> None:
    machine = replace(_machine(alpha=1e-4, rate=1e9), cores=2, compute_slowdown={2: 0.9, 4: 2.5})
    unshared = machine.unshared()
    for operation in OPERATIONS:
        assert unshared.link(operation, 2) == Link(1e-4, 1e9)  # two workers did not slow
        assert unshared.link(operation, 4) == Link(1e-4 / 2.5, 1e9 * 2.5)
    assert replace(machine, cores=None).unshared().link("all_reduce", 4) == Link(1e-4, 1e9)
    work = _workload()
    # dp4 on two cores: the reduce stretches with the step once, by the plan's own sharing
    crowded = predict(work, machine, ms.Plan(dp=4))
    roomy = predict(work, replace(machine, compute_slowdown={4: 1.0}), ms.Plan(dp=4))
    assert crowded.terms["communication_dp"] == pytest.approx(roomy.terms["communication_dp"] / 2.5)


def test_a_step_shared_in_time_slices_counts_its_preempted_steps() -> None:
    calls = itertools.count()

    def step() -> None:  # two of three steps at full speed, every third waits 30 ms for a core
        time.sleep(0.030 if next(calls) % 3 == 2 else 0.001)

    # the median step is 1 ms; the mean over the window is what the workers' sharing costs
    assert _mean_step_s(step, window_s=0.2) > 0.9 * (0.030 + 2 * 0.001) / 3


@pytest.mark.parametrize(
    "options",
    [{"schedule": "zbv"}, {"schedule": "interleaved", "virtual_stages": 2}, {"micro_batches": 2}],
)
def test_a_plan_without_a_pipeline_is_one_chunk_whatever_its_schedule(options: dict) -> None:
    work, machine = _workload(), _machine()
    plain = predict(work, machine, ms.Plan(micro_batches=options.get("micro_batches", 1)))
    assert predict(work, machine, ms.Plan(**options)).step_time_s == plain.step_time_s


def test_the_search_cuts_only_where_a_stage_may_begin() -> None:
    """8 items a stage may begin only at items 2, 4 and 6 of: four runs to cut between."""
    work = replace(_workload(items=8), cut_starts=(2, 4, 6))
    ranking = search(work, _machine(), 4)
    chunked = {(r.plan.pp, r.plan.virtual_stages) for r in ranking.rows if r.plan.pp > 1}
    assert chunked == {(2, 1), (2, 2), (4, 1)}  # pp * v up to the four runs
    for row in ranking.rows:
        starts = {sum(row.stages[:k]) for k in range(1, len(row.stages))}
        assert starts <= {2, 4, 6}, row.plan.describe()
    fewer = replace(work, cut_starts=(4,))
    refused = [why for plan, why in search(fewer, _machine(), 4).infeasible if plan.pp == 4]
    assert refused and "has 2 between the places a stage may begin; use pp <= 2" in refused[0]


def test_zero_bubble_prices_the_forward_rerun_for_b_and_again_for_w() -> None:
    """Under recompute a chunk that sends gradients back reruns its forward in B and again
    in W (W's backward calls share one rerun; the first chunk has no B): twice 1F1B's."""
    work = _workload()
    recomputed = {"micro_batches": 4, "recompute": "always"}
    one_f = predict(work, _machine(), ms.Plan(pp=2, **recomputed))
    zero = predict(work, _machine(), ms.Plan(pp=2, schedule="zero-bubble", **recomputed))
    assert one_f.terms["recompute"] > 0
    assert zero.terms["recompute"] == pytest.approx(2 * one_f.terms["recompute"])
    assert zero.critical_stage == 1
