"""A cluster on paper prices what runs around a step's items from the cluster, not this host.

The loss and the optimizer step are memory-bound work (bytes at the device's bandwidth), the
host's own bookkeeping is left out, and no operator runs faster than its launch: a bf16
autocast on this CPU once made the MoE's step on a DGX H100 180 ms of CPU time.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import meshsplit as ms
from meshsplit.planner.cluster import DEFAULT_LAUNCH_S, load_cluster
from meshsplit.planner.cost import predict
from meshsplit.planner.machine import OPERATIONS, Link, Machine
from meshsplit.planner.workload import Item, Line, Workload

MiB = 2**20
ROWS, ITEMS, FLOPS, OPS = 64, 4, 1e6, 10
"""The batch, and four equal items of FLOPS per row and OPS operators forward (twice both
backward)."""


def _workload() -> Workload:
    item = Item(
        name="layer",
        forward=Line.per_row(1e-3),
        backward=Line.per_row(2e-3),
        parameter_bytes=4 * MiB,
        output_bytes_per_row=4096.0,
        saved_bytes_per_row=8192.0,
        forward_flops_per_row=FLOPS,
        backward_flops_per_row=2 * FLOPS,
        forward_ops=OPS,
        backward_ops=2 * OPS,
    )
    return Workload(
        items={1: (item,) * ITEMS},
        loss_forward=Line.per_row(1e-3),
        loss_backward=Line.per_row(1e-3),
        optimizer_s_per_byte=1e-8,
        optimizer_state_per_byte=2.0,
        step_overhead_s=0.2,
        global_rows=ROWS,
    )


def _machine(*, paper: bool, launch_s: float = 0.0) -> Machine:
    links = {op: {2: Link(1e-6, 1e11)} for op in OPERATIONS}
    if not paper:
        return Machine(name="this host", links=links)
    return Machine(
        name="paper",
        links=links,
        flop_per_s=1e14,
        memory_bytes_per_s=1e12,
        launch_s=launch_s,
    )


def test_this_host_keeps_its_timed_loss_optimizer_and_overhead() -> None:
    terms = predict(_workload(), _machine(paper=False), ms.Plan()).terms
    assert terms["overhead"] == 0.2
    assert terms["optimizer"] == pytest.approx(1e-8 * ITEMS * 4 * MiB)
    # the items' and the loss's timed lines
    assert terms["compute"] == pytest.approx(ROWS * (ITEMS * 3e-3 + 2e-3))


def test_on_paper_the_loss_and_optimizer_stream_bytes_and_the_host_is_left_out() -> None:
    prediction = predict(_workload(), _machine(paper=True), ms.Plan())
    terms = prediction.terms
    assert terms["overhead"] == 0.0
    # parameter and state read and written, gradient read: (3 + 2 * 2) bytes per byte
    assert terms["optimizer"] == pytest.approx(7 * ITEMS * 4 * MiB / 1e12)
    items = ITEMS * 3 * FLOPS * ROWS / 1e14
    loss = (3 + 2) * 4096 * ROWS / 1e12  # logits streamed 3 times forward, twice backward
    assert terms["compute"] == pytest.approx(items + loss)
    assert prediction.step_time_s == pytest.approx(sum(terms.values()))


def test_on_paper_no_operator_runs_faster_than_its_launch() -> None:
    terms = predict(_workload(), _machine(paper=True, launch_s=1e-5), ms.Plan()).terms
    loss = (3 + 2) * 4096 * ROWS / 1e12
    assert terms["compute"] == pytest.approx(ITEMS * 3 * OPS * 1e-5 + loss)
    # more micro-batches launch every operator more often, and each after the first adds
    # its gradients to the stage's (two read, one written, at the memory's bandwidth)
    more = predict(_workload(), _machine(paper=True, launch_s=1e-5), ms.Plan(pp=2, micro_batches=4))
    accumulate = 3 * 3 * (ITEMS // 2) * 4 * MiB / 1e12
    assert more.terms["compute"] == pytest.approx(
        4 * (ITEMS // 2) * 3 * OPS * 1e-5 + loss + accumulate
    )


def test_each_micro_batch_after_the_first_adds_its_gradients_at_the_timed_rate() -> None:
    timed = replace(_workload(), accumulate_s_per_byte=1e-9)
    plans = [ms.Plan(pp=2, micro_batches=m) for m in (1, 4)] + [
        ms.Plan(pp=2, micro_batches=4, schedule="zero-bubble")
    ]
    for plan in plans:
        with_it = predict(timed, _machine(paper=False), plan)
        without = predict(_workload(), _machine(paper=False), plan)
        added = (plan.micro_batches - 1) * (ITEMS // 2) * 4 * MiB * 1e-9
        assert with_it.terms["compute"] - without.terms["compute"] == pytest.approx(added)
    split = predict(timed, _machine(paper=False), plans[-1])  # W adds, B does not
    weights = [i.end_s - i.start_s for i in split.intervals if i.kind == "W"]
    plain = predict(_workload(), _machine(paper=False), plans[-1])
    plain_weights = [i.end_s - i.start_s for i in plain.intervals if i.kind == "W"]
    assert sum(weights) - sum(plain_weights) == pytest.approx(2 * 3 * (ITEMS // 2) * 4 * MiB * 1e-9)


def test_the_moe_under_bf16_on_a_dgx_is_priced_by_its_operators_not_this_cpu() -> None:
    torch.manual_seed(0)
    model = ms.models.moe(vocab_size=64, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    batch = ms.data.synthetic_tokens(8, seq_len=8, vocab_size=64, seed=1)
    report = ms.choose_plan(
        model,
        batch,
        2,
        cluster="dgx-h100",
        estimate_top=0,
        loss_fn=ms.models.TokenCrossEntropy(),
        precision="bf16-mixed",
    )
    best = report.rows[0]
    assert best.terms["overhead"] == 0.0
    assert best.step_time_s == pytest.approx(sum(best.terms.values()))
    # about 1,500 operators a step at 5 us each, not this CPU's bf16 step
    assert 1e-3 < best.step_time_s < 2e-2


def test_a_cluster_file_may_give_its_launch_time(tmp_path: Path) -> None:
    data = load_cluster("dgx-h100").as_dict()
    assert data["launch_s"] == DEFAULT_LAUNCH_S == 5e-6
    del data["launch_s"]
    (tmp_path / "mine.json").write_text(json.dumps(data))
    assert load_cluster(tmp_path / "mine.json").machine().launch_s == DEFAULT_LAUNCH_S
    (tmp_path / "slow.json").write_text(json.dumps({**data, "launch_s": 2e-5}))
    assert load_cluster(tmp_path / "slow.json").machine().launch_s == 2e-5
    (tmp_path / "bad.json").write_text(json.dumps({**data, "launch_s": -1}))
    with pytest.raises(ms.PlanError, match="launch_s"):
        load_cluster(tmp_path / "bad.json")
