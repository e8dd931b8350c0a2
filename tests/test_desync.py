"""MESHSPLIT_DEBUG=1: ranks that call different collectives end in one DesyncError naming both
calls and both call sites, within seconds; ordinary training is untouched by the check.

Each fault is its own launch of 2 workers (the job ends on it); the cases without a fault
share one launch, and are compared with the same steps in one plain process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshsplit as ms
from meshsplit.job import desync

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSPLIT_DEBUG", "1")  # spawned workers inherit it
    monkeypatch.setenv("MESHSPLIT_DEBUG_WAIT_S", "2")


def _diverge(kind: str) -> None:
    """Both ranks agree on one all-reduce, then rank 1 goes its own way."""
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1024))  # rank 0's collective
    elif kind == "shape":
        dist.all_reduce(torch.ones(8, 16))  # rank 1's shape
    elif kind == "op":
        dist.all_gather_into_tensor(torch.empty(16, 16), torch.ones(8, 16))  # rank 1's op
    else:  # rank 1 skips the collective and stays busy elsewhere
        time.sleep(60)


def _line(marker: str) -> str:
    """'test_desync.py:<line> _diverge' for the line of _diverge that carries `marker`."""
    lines = Path(__file__).read_text().splitlines()
    number = next(n for n, line in enumerate(lines, 1) if line.endswith(marker))
    return f"test_desync.py:{number} _diverge"


def _error(kind: str) -> tuple[ms.WorkerError, float]:
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as raised:
        ms.launch(_diverge, 2, args=(kind,), timeout_s=60)
    return raised.value, time.monotonic() - started


def test_a_different_shape_names_both_calls_and_both_call_sites() -> None:
    error, seconds = _error("shape")
    assert seconds < 30
    assert error.error_type == "DesyncError", error
    message = error.message
    assert "collective #1 on the world (ranks [0, 1])" in message, message
    assert "rank 0 called all_reduce([1024] float32, op=SUM)" in message, message
    assert "rank 1 called all_reduce([8, 16] float32, op=SUM)" in message, message
    assert _line("# rank 0's collective") in message, message
    assert _line("# rank 1's shape") in message, message


def test_a_different_operation_is_named() -> None:
    error, seconds = _error("op")
    assert seconds < 30
    assert error.error_type == "DesyncError", error
    message = error.message
    assert "rank 0 called all_reduce([1024] float32, op=SUM) at" in message, message
    assert (
        "rank 1 called all_gather_into_tensor([16, 16] float32, [8, 16] float32) at "
        "tests/" + _line("# rank 1's op") in message
    ), message


def test_a_rank_that_skips_a_collective_is_named_with_where_it_was_last() -> None:
    error, seconds = _error("skip")
    assert seconds < 30  # MESHSPLIT_DEBUG_WAIT_S=2, not the 60 s process-group timeout
    assert error.rank == 0 and error.error_type == "DesyncError", error
    message = error.message
    assert "rank 1 has not reached all_reduce([1024] float32, op=SUM)" in message, message
    assert "the last collective rank 1 passed was all_reduce([4] float32, op=SUM)" in message
    assert _line("# rank 0's collective") in message, message


def _step(plan: ms.Plan) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    x, y = ms.data.synthetic_images(8)
    engine = ms.parallelize(
        ms.models.mlp((784, 64, 32, 10)),
        plan,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    loss = engine.train_step(x, y)
    state = engine.full_state_dict()
    engine.close()
    return loss, state


def _plans() -> dict[str, Any]:
    results: dict[str, Any] = {"checked": dict(desync._installed[0].sequence)}
    for plan in (ms.Plan(dp=2), ms.Plan(pp=2, micro_batches=2), ms.Plan(tp=2)):
        results[plan.describe()] = _step(plan)
    checker = desync._installed[0]
    results["checked"] = sum(checker.sequence.values()) - sum(results["checked"].values())
    results["messages"] = sum(checker.p2p.values())
    return results


def test_training_under_the_check_equals_one_process() -> None:
    per_rank = ms.launch(_plans, 2, timeout_s=120)
    torch.manual_seed(0)
    model = ms.models.mlp((784, 64, 32, 10))
    x, y = ms.data.synthetic_images(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    for results in per_rank:
        assert results["checked"] > 0 and results["messages"] > 0, results
        for plan in ("dp2 pp1 tp1", "dp1 pp2 tp1 m2 1f1b", "dp1 pp1 tp2"):
            got_loss, state = results[plan]
            torch.testing.assert_close(got_loss, loss.item(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state, model.state_dict(), rtol=1e-5, atol=1e-6)
