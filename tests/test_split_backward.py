"""Zero bubble's split backward (B then W) gives a plain backward's gradients, fires each
parameter's hooks once, and does no matmul twice. No processes: one chunk's graph."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshsplit.pipeline.split_backward import input_gradients, weight_gradients


class Chunk(nn.Module):
    """A residual MLP, a LayerNorm, a weight used twice and an output that never reads the
    input: every way a parameter's gradient can leave (or avoid) the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm, self.twice = nn.LayerNorm(16), nn.Linear(16, 16)
        self.gate = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.down(torch.relu(self.up(x))) + x)
        h = self.twice(h) + self.twice(h * 2)
        return h * self.gate, self.gate * 3.0


class _MatmulCount(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += "mm" in str(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _backward(model: nn.Module, x: torch.Tensor, split: bool, autocast: bool) -> dict[str, Any]:
    arrivals: collections.Counter[str] = collections.Counter()
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: arrivals.update([name]))
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        roots = list(model(leaf))
    seeds: list[torch.Tensor | None] = [torch.full_like(r, 0.5) for r in roots]
    with _MatmulCount() as counted:
        if split:
            found, work = input_gradients(roots, seeds, [leaf])
            untouched = all(p.grad is None for p in model.parameters())
            weight_gradients(work)
            given = found[0]
        else:
            torch.autograd.backward(roots, seeds)
            untouched, given = True, leaf.grad
    return {
        "input": given,
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "arrivals": arrivals,
        "matmuls": counted.count,
        "b_left_weights": untouched,
    }


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_b_then_w_equals_one_backward(autocast: bool) -> None:
    torch.manual_seed(0)
    model, x = Chunk(), torch.randn(8, 16)
    split = _backward(copy.deepcopy(model), x, split=True, autocast=autocast)
    plain = _backward(model, x, split=False, autocast=autocast)
    assert split["b_left_weights"], "B must leave every weight gradient to W"
    torch.testing.assert_close(split["input"], plain["input"], rtol=0, atol=0)
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=0, atol=0, msg=name)
    assert split["arrivals"] == plain["arrivals"] == {n: 1 for n in plain["grads"]}
    assert split["matmuls"] == plain["matmuls"], "W recomputed a product B had done"


def test_w_of_a_deep_stack_runs_each_weight_product_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)])
    split = _backward(copy.deepcopy(model), torch.randn(4, 32), split=True, autocast=False)
    assert split["matmuls"] == 2 * 5  # an input and a weight product per layer, no more
