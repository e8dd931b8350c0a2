"""Parameter servers: synchronous equals one process; asynchronous keeps its staleness bound."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch
import torch.distributed as dist
from test_hf_models import ATOL as HF_ATOL
from test_hf_models import RTOL as HF_RTOL
from test_hf_models import _batches, _build, _loss, _sgd, _single
from test_planner_choose import _machine

import meshsplit as ms
from meshsplit.cli.compare import (
    CompareConfig,
    _pricing,
    _row,
    accuracy,
    candidate_plans,
    reference_losses,
)
from meshsplit.data_parallel.ps_layout import cut_points, pieces, server_ranges

from cli_runner import run_meshsplit
from reference import OPTIMIZERS, assert_matches, build, train_parallel, train_single


def test_cuts_give_each_server_about_one_share_at_row_boundaries() -> None:
    shapes = [(1024, 784), (1024,), (512, 1024), (512,), (10, 512), (10,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    for servers in (1, 2, 3, 4):
        cuts = cut_points(shapes, servers)
        assert cuts[0] == 0 and cuts[-1] == total
        for low, high in zip(cuts, cuts[1:], strict=False):
            assert abs((high - low) - total / servers) <= 1024  # within one row of 1/S
            found = pieces(shapes, low, high)
            assert sum(torch.Size(shape).numel() for _, shape in found) == high - low
    cuts = cut_points(shapes, 2)
    # of two servers, the first takes the first 851 rows of the largest tensor, the second
    # the other 173 rows and everything after them
    first, second = (pieces(shapes, low, high) for low, high in itertools.pairwise(cuts))
    assert first == [(0, (851, 784))]
    assert [shape for _, shape in second] == [(173, 784), *shapes[1:]]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"sync": "ps", "servers": 0}, "servers=0 must be a positive integer"),
        ({"sync": "ps", "staleness": -1}, "staleness=-1 must be 0"),
        ({"servers": 2}, "add sync='ps'"),
        ({"sync": "ps", "pp": 2}, "does not combine with pp=2"),
        ({"sync": "ps", "tp": 2, "zero": 1}, "tp=2, zero=1"),
        ({"sync": "pull"}, "Plan.sync='pull' is unknown"),
    ],
)
def test_bad_parameter_server_plans_are_refused(options: dict, needle: str) -> None:
    with pytest.raises(ms.PlanError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ms.Plan(dp=2, **options)


def test_parameter_server_plan_counts_its_servers() -> None:
    plan = ms.Plan(dp=3, sync="ps", servers=2, staleness=1)
    assert plan.world_size == 5 and plan.servers == 2
    assert "ps2 staleness1" in plan.describe()
    with pytest.raises(ms.PlanError, match="dp \\+ servers = 3 \\+ 2 = 5 does not match 4"):
        plan.check_world(4)


def _synchronous(plan: ms.Plan, model: str, optimizer: str, batch: int) -> tuple:
    return train_parallel(model, optimizer, plan, batch=batch)


@pytest.mark.parametrize(
    ("plan", "model", "optimizer", "batch"),
    [
        (ms.Plan(dp=2, sync="ps"), "mlp", "sgd", 16),
        (ms.Plan(dp=2, sync="ps", servers=2), "cnn", "adamw", 16),
        (ms.Plan(dp=3, sync="ps", servers=2, micro_batches=2), "transformer", "sgd", 12),
    ],
    ids=["mlp-dp2-s1", "cnn-dp2-s2", "transformer-dp3-s2-m2"],
)
def test_synchronous_parameter_servers_match_one_process(
    plan: ms.Plan, model: str, optimizer: str, batch: int
) -> None:
    per_rank = ms.launch(_synchronous, plan.world_size, args=(plan, model, optimizer, batch))
    assert_matches(per_rank[: plan.dp], train_single(model, optimizer, batch=batch))
    servers = per_rank[plan.dp :]
    assert [s["server"] for s in servers] == list(range(plan.server_count))
    for stats in servers:
        assert stats["updates"] == 3 and stats["pushes"] == 3 * plan.dp
        assert stats["most_updates_behind"] == 0
    held = [stats["held_bytes"] for stats in servers]
    assert max(held) < 1.1 * min(held)  # each server holds about 1/S of the parameters


def test_more_servers_than_the_model_splits_into_is_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 3))]
    with pytest.raises(ms.PlanError, match="servers=3 leaves a server without parameters"):
        server_ranges(params, ms.Plan(dp=1, sync="ps", servers=3))


def _asynchronous(staleness: int, steps: int) -> tuple:
    torch.manual_seed(0)
    plan = ms.Plan(dp=2, sync="ps", staleness=staleness)
    engine = ms.parallelize(build("small_mlp"), plan, optimizer=OPTIMIZERS["sgd"])
    x, y = ms.data.synthetic_images(16 * steps, seed=1)
    losses = []
    for inputs, targets in zip(x.split(16), y.split(16), strict=True):
        if dist.get_rank() == 1:  # a straggler: far slower than the other worker's step
            time.sleep(0.05)
        losses.append(engine.train_step(inputs, targets))
    state = engine.full_state_dict()
    optimizer_bytes = engine.memory_report().optimizer_bytes
    engine.close()
    return losses, state, optimizer_bytes


@pytest.mark.parametrize("staleness", [0, 2])
def test_asynchronous_servers_keep_the_staleness_bound(staleness: int) -> None:
    steps = 8
    worker0, worker1, server = ms.launch(_asynchronous, 3, args=(staleness, steps))
    assert server["most_updates_behind"] <= staleness
    if staleness:  # the fast worker did not wait: the straggler's pushes came in behind
        assert server["most_updates_behind"] >= 1
    assert server["pushes"] == 2 * steps
    assert server["updates"] == steps  # every update sums two pushes, whoever gave them
    for key, value in worker0[1].items():  # the newest parameters on every worker
        torch.testing.assert_close(worker1[1][key], value, rtol=0, atol=0)
    assert worker0[2] == worker1[2] == 0  # the optimizer state is on the server
    assert all(torch.isfinite(torch.tensor(w[0])).all() for w in (worker0, worker1))


def _server_over_budget() -> None:
    plan = ms.Plan(dp=2, sync="ps", memory_budget="800KiB")  # fits a worker, not the server
    torch.manual_seed(0)
    ms.parallelize(build("small_mlp"), plan, optimizer=OPTIMIZERS["adamw"])


def test_a_server_over_the_memory_budget_is_refused_before_any_step() -> None:
    with pytest.raises(ms.WorkerError) as caught:
        ms.launch(_server_over_budget, 3, timeout_s=30)
    assert caught.value.error_type == "PlanError"
    assert "parameter server rank 2" in caught.value.message
    assert "use more servers (servers=" in caught.value.message


def _second_engine() -> None:
    plan = ms.Plan(dp=1, sync="ps")
    ms.parallelize(build("small_mlp"), plan).close()
    ms.parallelize(build("small_mlp"), plan)


def test_a_second_engine_after_the_servers_left_is_refused() -> None:
    with pytest.raises(ms.WorkerError, match="served an engine and left"):
        ms.launch(_second_engine, 2, timeout_s=30)


def test_compare_lists_parameter_server_plans_when_asked() -> None:
    plain = candidate_plans(CompareConfig(model="mlp", devices=4))
    plans = candidate_plans(CompareConfig(model="mlp", devices=4, include_ps=True))
    assert plans[: len(plain)] == plain
    added = [(p.dp, p.server_count, p.staleness) for p in plans[len(plain) :]]
    assert added == [(3, 1, 0), (3, 1, 2), (2, 2, 0), (2, 2, 2)]
    assert all(p.world_size == 4 for p in plans)


def test_compare_runs_a_parameter_server_plan_beside_the_reference_and_its_prediction() -> None:
    config = CompareConfig(model="mlp", devices=3, steps=3, batch_size=16, include_ps=True)
    plans = [ms.Plan(dp=2, sync="ps"), ms.Plan(dp=2, sync="ps", staleness=2)]
    priced = _pricing(config, plans, machine=_machine())
    row = _row(config, plans[0], reference=reference_losses(config), pricing=priced)
    assert row["loss_matches"] is True  # synchronous: one process's losses
    assert len(row["peak_memory_bytes"]) == 3  # two workers and the server
    assert row["estimated_peak_bytes"] is None  # the estimate covers the mesh's ranks only
    assert row["predicted_step_s"] > 0 and row["predicted_terms"]["communication_dp"] > 0
    stale = _row(config, plans[1], reference=reference_losses(config), pricing=priced)
    assert "predicted_step_s" not in stale  # the cost model prices staleness 0 only
    assert accuracy([row, stale])["largest_memory_error"] == 0.0


def test_train_command_runs_asynchronous_parameter_servers(tmp_path) -> None:
    out = tmp_path / "metrics.json"
    done = run_meshsplit(
        "train", "--model", "mlp", "--dp", "2", "--sync", "ps", "--staleness", "1",
        "--epochs", "1", "--metrics-out", str(out), timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    metrics = json.loads(out.read_text())
    assert metrics["plan"]["sync"] == "ps" and metrics["plan"]["staleness"] == 1
    assert len(metrics["peak_memory_bytes"]) == 3
    assert metrics["servers"][0]["most_updates_behind"] <= 1
    assert metrics["test_accuracy"] > 0.5  # one epoch of Adam on digits learns
    refused = run_meshsplit(
        "train", "--sync", "ps", "--servers", "0", "--dp", "2", "--epochs", "1", timeout=60
    )
    assert refused.returncode == 2 and "servers=0 must be a positive integer" in refused.stderr
    refused = run_meshsplit(
        "train", "--sync", "ps", "--dp", "2", "--checkpoint-dir", str(tmp_path), timeout=60
    )
    assert refused.returncode == 2 and "--sync ps takes neither --checkpoint-dir" in refused.stderr


def _refusals(directory: str) -> list[str]:
    plan = ms.Plan(dp=1, sync="ps")
    refused = []
    try:
        ms.parallelize(lambda: build("small_mlp"), plan)
    except ms.PlanError as error:  # every rank, the server too, refuses a factory
        refused.append(str(error))
    engine = ms.parallelize(build("small_mlp"), plan)
    for attempt in (engine.save, engine.load):
        try:
            attempt(directory)
        except ms.PlanError as error:
            refused.append(str(error))
    engine.close()
    return refused


def test_factories_and_checkpoints_are_refused_under_parameter_servers(tmp_path) -> None:
    worker, server = ms.launch(_refusals, 2, args=(str(tmp_path),), timeout_s=60)
    assert len(worker) == 3
    assert "pass the built model, not a factory" in worker[0]
    assert all("the optimizer state lives on the parameter servers" in r for r in worker[1:])
    assert server["updates"] == 0


def test_parameter_servers_need_gloo(monkeypatch) -> None:
    from meshsplit.data_parallel import ps

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ms.PlanError, match="sync='ps' runs on the gloo backend"):
        ps.check_backend()


def _hugging_face(model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    plan = ms.Plan(dp=2, sync="ps", servers=2)
    engine = ms.parallelize(_build(model), plan, optimizer=_sgd, loss_fn=_loss(model))
    losses = [engine.train_step(x, y) for x, y in _batches(model)]
    state = engine.full_state_dict()
    engine.close()
    return losses, state


@pytest.mark.parametrize("model", ["gpt2", "resnet"])  # tied embeddings; BatchNorm
def test_hugging_face_models_under_synchronous_servers_match_one_process(model: str) -> None:
    *workers, first, second = ms.launch(_hugging_face, 4, args=(model,))
    # the tolerance test_hf_models holds these models to under every other plan: 3 steps of
    # SGD with momentum 0.9 through BatchNorm grow summation-order noise past 1e-6
    assert_matches(workers, _single(model), rtol=HF_RTOL, atol=HF_ATOL)
    assert abs(first["held_bytes"] - second["held_bytes"]) < 0.1 * first["held_bytes"]


def test_the_memory_estimate_says_it_does_not_cover_parameter_servers() -> None:
    model, (x, y) = build("small_mlp"), ms.data.synthetic_images(16)
    with pytest.raises(ms.PlanError, match="the memory estimate covers sync='allreduce' plans"):
        ms.estimate_memory(model, ms.Plan(dp=2, sync="ps"), (x, y))
