"""Plan.offload: the numbers stay those of plain training, the state leaves resident memory.

offload='optimizer' is checked against single-process training (SGD with momentum and AdamW)
with 1 and 2 workers, through a checkpoint save and load, in the live-tensor count and the
estimate; the GPU path's host copies run here on CPU parameters too. offload='activations'
is refused on CPU and checked on a GPU where there is one.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.memory import offload, reclaim
from meshsplit.memory.report import resident_bytes

from reference import OPTIMIZERS, assert_matches, batches, build, train_parallel, train_single

pytestmark = pytest.mark.timeout(300)

ROWS = 16


def _file_backed(engine: ms.Engine) -> list[bool]:
    return [
        reclaim.is_file_backed(value)
        for state in engine.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.nbytes >= mmap.PAGESIZE
    ]


def _offloaded_runs(dp: int) -> dict[str, Any]:
    """Runs in every worker: both optimizers under offload='optimizer'."""
    results: dict[str, Any] = {}
    for name in ("sgd", "adamw"):
        results[name] = train_parallel("mlp", name, ms.Plan(dp=dp, offload="optimizer"))
    engine = ms.parallelize(build("mlp"), ms.Plan(dp=dp, offload="optimizer"))
    engine.train_step(*batches("mlp", ROWS, 1)[0])
    results["file_backed"] = _file_backed(engine)
    results["breakdown"] = engine.memory_report().tensor_breakdown
    engine.close()
    return results


@pytest.mark.parametrize("dp", [1, 2])
def test_offloaded_optimizer_matches_single_process(dp: int) -> None:
    # gloo: the host path (file-backed state) is the claim, also on a machine with a GPU
    per_rank = ms.launch(_offloaded_runs, dp, args=(dp,), backend="gloo")
    for name in ("sgd", "adamw"):
        assert_matches([r[name] for r in per_rank], train_single("mlp", name))
    for result in per_rank:
        assert result["file_backed"] and all(result["file_backed"])
        assert result["breakdown"]["optimizer"] < 64 * 1024  # what is under a page stays


def _save_and_resume(directory: str) -> tuple[list[float], list[float], bool]:
    """Runs in the worker: 2 steps, save, 2 more; a fresh offloaded engine loads and redoes
    the last 2."""
    plan = ms.Plan(offload="optimizer")
    data = batches("mlp", ROWS, 4)
    engine = ms.parallelize(build("mlp"), plan, optimizer=OPTIMIZERS["adamw"])
    for x, y in data[:2]:
        engine.train_step(x, y)
    engine.save(directory)
    straight = [engine.train_step(x, y) for x, y in data[2:]]
    engine.close()
    torch.manual_seed(1)
    resumed = ms.parallelize(ms.models.mlp(), plan, optimizer=OPTIMIZERS["adamw"])
    resumed.load(directory)
    again = [resumed.train_step(x, y) for x, y in data[2:]]
    backed = all(_file_backed(resumed))
    resumed.close()
    return straight, again, backed


def test_checkpoint_saves_and_loads_offloaded_state(tmp_path: Path) -> None:
    [(straight, again, backed)] = ms.launch(
        _save_and_resume, 1, args=(str(tmp_path),), backend="gloo"
    )  # the host path, also on a machine with a GPU
    torch.testing.assert_close(torch.tensor(again), torch.tensor(straight), rtol=1e-5, atol=0)
    assert backed


def test_estimate_leaves_file_backed_state_out() -> None:
    x, y = batches("mlp", ROWS, 1)[0]
    plain = ms.estimate_memory(build("mlp"), ms.Plan(), (x, y))
    offloaded = ms.estimate_memory(build("mlp"), ms.Plan(offload="optimizer"), (x, y))
    params = sum(p.numel() * 4 for p in build("mlp").parameters())
    assert plain.ranks[0].breakdown["optimizer"] >= 2 * params  # Adam: two moments
    assert offloaded.ranks[0].breakdown["optimizer"] < 64 * 1024
    assert offloaded.peak_bytes < plain.peak_bytes - params


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches("mlp", ROWS, steps)):
        if step == 1:  # changed outside a step, as a checkpoint load does
            with torch.no_grad():
                model[1].bias.detach().mul_(0.5)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_host_copies_step_exactly_as_the_optimizer_does(name: str) -> None:
    plain = build("mlp")
    plain_losses = _train(plain, OPTIMIZERS[name](plain.parameters()), 3)
    model = build("mlp")
    optimizer = OPTIMIZERS[name](model.parameters())
    copies = offload.HostCopies(optimizer)
    losses = _train(model, optimizer, 3)
    assert losses == plain_losses
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)
    assert all(
        v.device.type == "cpu" for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor)
    )  # fmt: skip
    copies.close()


def test_file_state_lives_in_released_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MESHSPLIT_OFFLOAD_DIR", str(tmp_path))
    param = nn.Parameter(torch.zeros(16 * 2**20 // 4))  # 16 MiB: Adam's state is 32 MiB
    optimizer = torch.optim.Adam([param], lr=0.1)
    state = offload.FileState(optimizer)
    assert state.directory.parent == tmp_path
    param.grad = torch.ones_like(param)
    optimizer.step()
    mapped = state.tensors()
    assert len(mapped) == 2 and list(state.directory.iterdir()) == []  # unlinked once mapped
    released = resident_bytes()
    total = sum(float(t.sum()) for t in mapped)  # reading brings the pages back
    touched = resident_bytes()
    assert total == pytest.approx(param.numel() * (0.1 + 0.001), rel=1e-4)
    assert touched - released > 0.8 * 32 * 2**20
    optimizer.step()  # the step releases them again
    reclaim.trim_heap()  # the step's freed temporaries are not what is measured
    assert resident_bytes() < touched - 0.8 * 32 * 2**20
    optimizer.load_state_dict(optimizer.state_dict())
    assert len(state.tensors()) == 2  # a loaded state goes to files too
    state.close()
    assert not state.directory.exists()


def test_unsupported_offloads_are_refused_at_build() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    with pytest.raises(ms.PlanError, match=r"offload='activations'.*computes on cpu.*optimizer"):
        offload.check(ms.Plan(offload="activations"), cpu)
    with pytest.raises(ms.PlanError, match=r"offload='optimizer' with zero=1.*zero=0"):
        offload.check(ms.Plan(dp=2, zero=1, offload="optimizer"), cpu)
    # each refusal gives its own reason: on a CPU activations are on the host already
    with pytest.raises(ms.PlanError, match=r"computes on cpu"):
        offload.check(ms.Plan(dp=2, zero=3, offload="activations"), cpu)
    with pytest.raises(ms.PlanError, match=r"activations to the host is not proven.*zero=0"):
        offload.check(ms.Plan(dp=2, zero=3, offload="activations"), gpu)
    with pytest.raises(ms.PlanError, match=r"compress='bf16'"):
        offload.check(ms.Plan(offload="activations", compress="bf16"), gpu)
    offload.check(ms.Plan(offload="activations"), gpu)


def _on_gpu() -> dict[str, Any]:
    """Runs in the worker on a GPU: both offloads against a plain run."""
    results = {}
    for option in ("none", "optimizer", "activations"):
        results[option] = train_parallel("mlp", "sgd", ms.Plan(offload=option))
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to the host needs a GPU")
def test_offloads_from_the_gpu_keep_the_numbers() -> None:
    [results] = ms.launch(_on_gpu, 1)
    expected = results["none"]
    for option in ("optimizer", "activations"):
        assert_matches([results[option]], expected)
