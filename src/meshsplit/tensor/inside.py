"""Layers kept whole that run inside a column/row pair, on a rank's slice of the activations.

Between a pair's columns and its row every rank holds only its slice of the activations. A
layer with weights of its own that reads them there (Qwen3's and Gemma 3's per-head q_norm and
k_norm, between q_proj and o_proj) computes on that slice with whole weights: its output is
right, but each rank's gradient of those weights is only its slice's share of the whole. Left
alone, the ranks' copies drift apart and none equals one process. Until such gradients are
summed over tp, the pair around such a layer is kept whole (rewrite.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import call_model
from meshsplit.tensor.dataflow import hooked, noise_added, quietly, same

__all__: list[str] = []


def readers_inside(
    model: nn.Module,
    example: Any,
    pairs: Mapping[str, list[str]],
    holders: Mapping[str, nn.Module],
) -> dict[str, list[str]]:
    """Row layer -> the `holders` (layers kept whole, with weights of their own) that run
    after its first column and before it, on values its columns made (one forward of
    `example`, then one for each pair with a holder in that window, its columns' outputs
    perturbed)."""
    layers = {
        name: model.get_submodule(name) for row, cols in pairs.items() for name in (row, *cols)
    }
    order, clean = _first_inputs(model, example, layers | dict(holders))
    found: dict[str, list[str]] = {}
    for row, columns in pairs.items():
        start = min(order.get(c, len(order)) for c in columns)
        window = [h for h in holders if start < order.get(h, -1) < order.get(row, -1)]
        if not window:
            continue
        _, seen = _first_inputs(
            model, example, {h: holders[h] for h in window}, [layers[c] for c in columns]
        )
        moved = [h for h in window if h not in seen or not same(seen[h], clean[h])]
        if moved:
            found[row] = moved
    return found


def _first_inputs(
    model: nn.Module,
    example: Any,
    watched: Mapping[str, nn.Module],
    perturbed: Sequence[nn.Module] = (),
) -> tuple[dict[str, int], dict[str, list[torch.Tensor]]]:
    """Each watched module's place in the call order and a copy of its first call's tensor
    inputs, in eval mode without autograd; `perturbed` modules' outputs get noise added."""
    order: dict[str, int] = {}
    inputs: dict[str, list[torch.Tensor]] = {}

    def recorder(name: str, module: nn.Module) -> Callable[[], Any]:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in order:
                order[name] = len(order)
                leaves = pytree.tree_leaves((args, kwargs))
                inputs[name] = [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]

        return lambda: module.register_forward_pre_hook(hook, with_kwargs=True)

    def noisy(module: nn.Module) -> Callable[[], Any]:
        return lambda: module.register_forward_hook(noise_added)

    register = [recorder(name, module) for name, module in watched.items()]
    register += [noisy(module) for module in perturbed]
    with quietly(model), hooked(register):
        call_model(model, example)
    return order, inputs
