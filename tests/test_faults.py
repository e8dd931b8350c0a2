"""Bad batches and non-finite steps end in one clear error naming the layer, rank and step.

One launch of 2 workers runs the cases every rank meets alike (dp and tp see the same bad
batch; a NaN is learnt by every rank through the guard's all-reduce); a pipeline whose last
stage alone fails is its own launch, since its peer is left waiting and the job must end.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit.job.input_errors import explain_input_error

pytestmark = pytest.mark.timeout(300)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _message(engine: ms.Engine, x: torch.Tensor, y: torch.Tensor) -> tuple[str, str]:
    try:
        engine.train_step(x, y)
    except Exception as error:  # noqa: BLE001 - the test reads which error and what it says
        return type(error).__name__, str(error)
    return "", ""


def _state(engine: ms.Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.runner.module.state_dict().items()}


class _InfiniteGradient(torch.autograd.Function):
    """Passes values through; its backward makes every gradient before it non-finite while
    the loss stays finite."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class _HugeGradient(torch.autograd.Function):
    """Passes values through; its backward sends 1e36 to every element before it: gradients
    finite, their float32 sum not."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, 1e36)


class _HugeBackward(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HugeGradient.apply(x)


def _huge_gradients(plan: ms.Plan) -> tuple[str, str, bool]:
    """A step whose gradients are finite but sum past float32's range: it trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10), _HugeBackward())
    engine = ms.parallelize(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    kind, message = _message(engine, x, y)
    weight = engine.full_state_dict()["1.weight"]
    return kind, message, bool(weight.isfinite().all()) and float(weight.abs().max()) > 1e30


class _BadBackward(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfiniteGradient.apply(x)


def _bad_backward_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 32), _BadBackward(), torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )  # fmt: skip


def _infinite_gradients(plan: ms.Plan) -> tuple[str, str]:
    """A finite loss whose gradients are not: the error the step raises."""
    engine = ms.parallelize(_bad_backward_model(), plan, optimizer=_sgd)
    return _message(engine, *ms.data.synthetic_images(8))


def _cases() -> dict[str, Any]:
    torch.manual_seed(0)
    x, y = ms.data.synthetic_images(8)
    wide = torch.randn(8, 785)
    results: dict[str, Any] = {}
    for plan in (ms.Plan(dp=2), ms.Plan(tp=2)):
        engine = ms.parallelize(ms.models.mlp(), plan, optimizer=_sgd)
        engine.train_step(x, y)
        results[f"wide {plan.describe()}"] = _message(engine, wide, y)
    engine = ms.parallelize(ms.models.mlp(), ms.Plan(dp=2), optimizer=_sgd)
    engine.train_step(x, y)
    before = _state(engine)
    rows = 8 if torch.distributed.get_rank() == 0 else 6  # a loader per rank, out of step
    results["uneven"] = _message(engine, x[:rows], y[:rows])
    results["uneven untouched"] = all(torch.equal(v, _state(engine)[k]) for k, v in before.items())
    for zero in (2, 3):  # the gradient shards FSDP2 reduced, looked at on each rank
        results[f"infinite gradients zero={zero}"] = _infinite_gradients(ms.Plan(dp=2, zero=zero))
    for plan in (ms.Plan(dp=2), ms.Plan(dp=2, zero=3), ms.Plan(tp=2)):
        results[f"huge gradients {plan.describe()}"] = _huge_gradients(plan)
    bad = x.clone()
    bad[3] = float("nan")
    for mode in ("raise", "skip"):
        engine = ms.parallelize(ms.models.mlp(), ms.Plan(dp=2, nonfinite=mode), optimizer=_sgd)
        engine.train_step(x, y)
        before = _state(engine)
        results[f"nan {mode}"] = _message(engine, bad, y)
        after = _state(engine)
        results[f"nan {mode} untouched"] = all(torch.equal(before[k], after[k]) for k in before)
        results[f"nan {mode} skipped"] = engine.skipped_steps
        results[f"nan {mode} then"] = _message(engine, x, y)  # a good batch trains again
        results[f"nan {mode} trains"] = not all(
            torch.equal(before[k], v) for k, v in _state(engine).items()
        )
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return ms.launch(_cases, 2, timeout_s=240)


@pytest.mark.parametrize("plan", ["dp2 pp1 tp1", "dp1 pp1 tp2"])
def test_a_batch_too_wide_names_the_layer_and_both_shapes(
    per_rank: list[dict[str, Any]], plan: str
) -> None:
    for rank, results in enumerate(per_rank):
        kind, message = results[f"wide {plan}"]
        assert kind == "InputError", message
        assert f"rank {rank}" in message and "'fc1'" in message, message
        assert "784 input features" in message and "(8, 785)" in message, message


def test_a_nan_stops_every_rank_naming_step_rank_and_parameter(
    per_rank: list[dict[str, Any]],
) -> None:
    for results in per_rank:
        kind, message = results["nan raise"]
        assert kind == "NonFiniteError", message
        assert "step 2" in message and "rank(s) [0, 1]" in message, message
        assert "rank 0 (dp 0, pp stage 0, tp 0): loss nan" in message, message
        assert "rank 1 (dp 1, pp stage 0, tp 0): loss finite" in message, message
        assert "fc1.weight" in message and "nonfinite='skip'" in message, message
        assert results["nan raise untouched"]


@pytest.mark.parametrize("zero", [2, 3])
def test_non_finite_gradients_of_a_finite_loss_stop_a_sharded_step(
    per_rank: list[dict[str, Any]], zero: int
) -> None:
    for results in per_rank:
        kind, message = results[f"infinite gradients zero={zero}"]
        assert kind == "NonFiniteError", message
        assert "loss finite" in message and "first non-finite gradient: 1.weight" in message


def test_non_finite_gradients_of_a_finite_loss_stop_one_process() -> None:
    (kind, message), *_ = ms.launch(_infinite_gradients, 1, args=(ms.Plan(),), timeout_s=60)
    assert kind == "NonFiniteError", message
    assert "loss finite" in message and "first non-finite gradient: 1.weight" in message


@pytest.mark.parametrize("plan", ["dp2 pp1 tp1", "dp2 pp1 tp1 zero3", "dp1 pp1 tp2"])
def test_finite_gradients_whose_sum_overflows_float32_train(
    per_rank: list[dict[str, Any]], plan: str
) -> None:
    for results in per_rank:
        assert results[f"huge gradients {plan}"] == ("", "", True)


def test_finite_gradients_whose_sum_overflows_float32_train_one_process() -> None:
    (result,) = ms.launch(_huge_gradients, 1, args=(ms.Plan(),), timeout_s=60)
    assert result == ("", "", True)


def test_skip_drops_the_update_on_every_rank_and_training_goes_on(
    per_rank: list[dict[str, Any]],
) -> None:
    for results in per_rank:
        assert results["nan skip"] == ("", "")
        assert results["nan skip untouched"] and results["nan skip skipped"] == 1
        assert results["nan skip then"] == ("", "") and results["nan skip trains"]


def _pipeline_with_bad_targets() -> None:
    torch.manual_seed(0)
    x, y = ms.data.synthetic_images(8)
    engine = ms.parallelize(ms.models.mlp(), ms.Plan(pp=2, micro_batches=2), optimizer=_sgd)
    engine.train_step(x, y)
    engine.train_step(x, torch.full_like(y, 12))  # ten classes


def test_targets_out_of_range_in_the_last_stage_end_the_job_within_seconds() -> None:
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as raised:
        ms.launch(_pipeline_with_bad_targets, 2, timeout_s=120)
    assert time.monotonic() - started < 30
    message = str(raised.value)
    assert "worker rank 1" in message and "InputError" in message, message
    assert "pp stage 1" in message and "'loss_fn'" in message and "12" in message, message


def _one_rank_stalls() -> None:
    """Rank 1 is alive but busy in its loss for longer than the process group's timeout."""
    torch.manual_seed(0)
    x, y = ms.data.synthetic_images(8)

    def slow_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.distributed.get_rank() == 1 and engine.steps == 1:
            time.sleep(12)
        return torch.nn.functional.cross_entropy(output, target)

    engine = ms.parallelize(ms.models.mlp(), ms.Plan(dp=2), optimizer=_sgd, loss_fn=slow_loss)
    for _ in range(3):
        engine.train_step(x, y)


def test_a_stalled_rank_is_warned_about_then_named_when_the_wait_times_out(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MESHSPLIT_STALL_WARN_S", "2")
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as raised:
        ms.launch(_one_rank_stalls, 2, timeout_s=5)
    assert time.monotonic() - started < 30
    error = raised.value
    assert error.rank == 0 and error.error_type == "CollectiveTimeout", error
    message = error.message
    assert "rank 0 (dp 0, pp stage 0, tp 0) has waited" in message, message
    assert "all-reduce wait" in message and "at step 2" in message, message
    assert "held up by rank(s) [1]" in message, message
    assert "rank 1: step 2, forward, micro-batch 0, not waiting for anyone" in message, message
    warning = capfd.readouterr().err
    assert "meshsplit watchdog: rank 0 (dp 0, pp stage 0, tp 0) has waited" in warning


def test_ranks_given_different_batches_are_refused_before_the_update(
    per_rank: list[dict[str, Any]],
) -> None:
    for results in per_rank:
        kind, message = results["uneven"]
        assert kind == "InputError", message
        assert "rank 0: 8, rank 1: 6 rows" in message and "same data" in message, message
        assert results["uneven untouched"]


def test_a_plain_loss_function_that_fails_is_named_with_what_it_received() -> None:
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, target)

    model = ms.models.mlp((4, 3))
    x, y = torch.randn(2, 4), torch.tensor([0, 7])
    try:
        loss_fn(model(x), y)
    except IndexError as error:
        explained = explain_input_error(error, model, x, "rank 0", {"loss_fn": loss_fn})
    assert explained is not None
    message = str(explained)
    assert "rank 0: loss_fn received (a float32 tensor of shape (2, 3)" in message, message
    assert "int64 tensor of shape (2,)" in message and "out of bounds" in message, message


def _user_collective_stalls() -> None:
    """The user's own code: rank 1 is busy elsewhere while rank 0 waits in an all-reduce."""
    if torch.distributed.get_rank() == 1:
        time.sleep(30)
    torch.distributed.all_reduce(torch.ones(1))


def test_a_stalled_collective_in_the_users_own_code_is_named() -> None:
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as raised:
        ms.launch(_user_collective_stalls, 2, timeout_s=5)
    assert time.monotonic() - started < 30
    error = raised.value
    assert error.rank == 0 and error.error_type == "CollectiveTimeout", error
    message = error.message
    assert "rank 0 timed out in all_reduce called at" in message, message
    assert "_user_collective_stalls" in message and "rank(s) [1] never joined it" in message
    assert "rank 1: not in a collective, at" in message, message
