"""A step reads the device from the host once (the loss it returns), and never when asked
for the loss as a tensor with nothing to decide (`as_tensor=True`, `nonfinite="off"`).

Host reads are counted as a user's code would make them, through a TorchFunctionMode that
sees every `item`, `tolist` and conversion to a Python number or truth value (on a GPU each
waits for the device). Steps 6-8 are counted: the memory tracker samples the first ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import meshsplit as ms

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"}

PLANS = {
    1: [{}],
    2: [{"dp": 2}, {"tp": 2}, {"pp": 2, "micro_batches": 2}, {"dp": 2, "zero": 3}],
}


class _HostReads(TorchFunctionMode):
    """Counts the tensor methods that read a value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def _steps(options: dict[str, Any], as_tensor: bool) -> tuple[list[float], int, dict[str, Any]]:
    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.mlp(), ms.Plan(**options), optimizer=lambda p: torch.optim.SGD(p, lr=0.05)
    )
    x, y = ms.data.synthetic_images(16)
    losses: list[Any] = [engine.train_step(x, y, as_tensor=as_tensor) for _ in range(5)]
    counting = _HostReads()
    with counting:
        losses += [engine.train_step(x, y, as_tensor=as_tensor) for _ in range(3)]
    state = engine.full_state_dict()
    engine.close()
    return [float(v) for v in losses], sum(counting.reads.values()), state


def _cases(world: int) -> dict[str, Any]:
    results = {}
    for options in PLANS[world]:
        label = ms.Plan(**options).describe()
        results[f"{label} float"] = _steps(options, as_tensor=False)
        results[f"{label} tensor"] = _steps({**options, "nonfinite": "off"}, as_tensor=True)
        loss = ms.parallelize(ms.models.mlp(), ms.Plan(**options)).train_step(
            *ms.data.synthetic_images(16), as_tensor=True
        )
        results[f"{label} tensor type"] = (type(loss), loss.dtype, loss.dim())
    return results


@pytest.fixture(scope="module", params=sorted(PLANS))
def per_rank(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return ms.launch(_cases, request.param, args=(request.param,), timeout_s=240)


def test_one_host_read_a_step_and_none_for_a_tensor_loss(per_rank: list[dict[str, Any]]) -> None:
    for results in per_rank:
        for label in {key.rsplit(" ", 1)[0] for key in results if key.endswith(" float")}:
            losses, reads, state = results[f"{label} float"]
            assert reads == 3, f"{label}: {reads} host reads in 3 steps returning a float"
            tensor_losses, tensor_reads, tensor_state = results[f"{label} tensor"]
            assert tensor_reads == 0, f"{label}: {tensor_reads} host reads with as_tensor"
            # the same training: nothing but the check is left out
            assert tensor_losses == losses, label
            for key, value in state.items():
                assert torch.equal(tensor_state[key], value), f"{label} {key}"
            assert results[f"{label} tensor type"] == (torch.Tensor, torch.float64, 0), label
