"""Layers kept whole that run inside a column/row pair, on a rank's slice of the activations.

Between a pair's columns and its row every rank holds only its slice of the activations. A
layer with weights of its own that reads them there (Qwen3's and Gemma 3's per-head q_norm and
k_norm, between q_proj and o_proj) computes on that slice with whole weights: its output is
right, but each rank's gradient of those weights is only its slice's share of the whole. Left
alone, the ranks' copies drift apart and none equals one process. Their sum over tp is the
whole gradient (gradient_sum.py) when the layer runs once a forward, there; a layer that runs
again elsewhere would have that use counted tp times, so the pair around it is kept whole
(rewrite.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import call_model
from meshsplit.tensor.entering import Entering, what_enters
from meshsplit.tensor.probe import hooked, noise_added, quietly, same

__all__: list[str] = []


def readers_inside(
    model: nn.Module,
    example: Any,
    pairs: Mapping[str, list[str]],
    holders: Mapping[str, nn.Module],
) -> tuple[dict[str, list[str]], set[str]]:
    """Row layer -> the `holders` (layers kept whole, with weights of their own) that run, in
    any of their calls, after its first column and before it, on values its columns made
    (one forward of `example`, then one for each pair with a holder in that window, its
    columns' outputs perturbed); and the holders that run more than once a forward."""
    layers = {
        name: model.get_submodule(name) for row, cols in pairs.items() for name in (row, *cols)
    }
    ticks, clean = _calls(model, example, layers | dict(holders), list(holders))
    found: dict[str, list[str]] = {}
    for row, columns in pairs.items():
        if row not in ticks or not any(c in ticks for c in columns):
            continue
        start, end = min(ticks[c][0] for c in columns if c in ticks), ticks[row][0]
        window = [h for h in holders if any(start < t < end for t in ticks.get(h, ()))]
        if not window:
            continue
        _, seen = _calls(
            model, example, {h: holders[h] for h in window}, window, [layers[c] for c in columns]
        )
        moved = [h for h in window if not _same_calls(seen.get(h, []), clean[h])]
        if moved:
            found[row] = moved
    return found, {h for h in holders if len(ticks.get(h, ())) > 1}


def summed_or_whole(
    model: nn.Module,
    example: Any,
    pairs: Mapping[str, list[str]],
    holders: Mapping[str, nn.Module],
    decided: set[str],
) -> tuple[dict[str, tuple[str, tuple[str, ...]]], dict[str, str]]:
    """Holder -> (the pair's row, its parameters) to sum over tp, for the readers inside each
    pair (`readers_inside`); and row -> why, for the pairs to keep whole: a reader also runs
    elsewhere or shares its weights (that use would count tp times), or something else with
    a gradient enters between the columns and the row (entering.py), whose gradient no sum
    over tp mends. `decided`: the layers with a decision of their own."""
    found, again = readers_inside(model, example, pairs, holders) if holders else ({}, set())
    # a model on the meta device lends each layer copies while it runs: a graph over the
    # whole forward would hold all of them at once (see what_enters)
    lazy = any(p.is_meta for p in model.parameters())
    entering = {} if lazy else what_enters(model, example, pairs)
    summed: dict[str, tuple[str, tuple[str, ...]]] = {}
    whole: dict[str, str] = {}
    paths = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for row in pairs:
        readers = found.get(row, [])
        owned = {r: _owned(model, r, decided, paths) for r in readers if r not in again}
        inside = entering.get(row, Entering())
        covered = {name for names in owned.values() for name in names}
        stray = sorted(inside.parameters - covered)
        if not all(owned.get(r) for r in readers):
            whole[row] = (
                f"{', '.join(readers)} (kept whole) read their split values and run again "
                "elsewhere or share their weights"
            )
        elif inside.values:
            whole[row] = (
                "a value with a gradient, made before its columns ran, is read between them "
                "(each rank would get only its share of that gradient)"
            )
        elif stray:
            whole[row] = (
                f"{', '.join(stray[:3])} read between them (each rank would get only its "
                "share of that gradient)"
            )
        else:
            summed.update({r: (row, owned[r]) for r in readers})
    return summed, whole


def _owned(model: nn.Module, name: str, decided: set[str], paths: Counter[int]) -> tuple[str, ...]:
    """The parameters of layer `name` (not those of a layer inside it with a decision of its
    own), by their names in `model`; () when any of them is also reachable elsewhere
    (`paths`: how many names each parameter has in `model`)."""
    inner = tuple(d + "." for d in decided if d.startswith(name + "."))
    mine = [
        (path, p)
        for path, p in model.get_submodule(name).named_parameters(prefix=name)
        if not path.startswith(inner)
    ]
    if any(paths[id(p)] > 1 for _, p in mine):
        return ()
    return tuple(path for path, _ in mine)


def _same_calls(one: list[list[torch.Tensor]], other: list[list[torch.Tensor]]) -> bool:
    return len(one) == len(other) and all(same(a, b) for a, b in zip(one, other, strict=True))


def _calls(
    model: nn.Module,
    example: Any,
    watched: Mapping[str, nn.Module],
    copied: Sequence[str],
    perturbed: Sequence[nn.Module] = (),
) -> tuple[dict[str, list[int]], dict[str, list[list[torch.Tensor]]]]:
    """When each watched module was called (ticks of one clock over all their calls) and, for
    the `copied` ones, a copy of each call's tensor inputs; in eval mode without autograd,
    `perturbed` modules' outputs with noise added."""
    ticks: dict[str, list[int]] = {}
    inputs: dict[str, list[list[torch.Tensor]]] = {name: [] for name in copied}
    clock = itertools.count()

    def recorder(name: str, module: nn.Module) -> Callable[[], Any]:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ticks.setdefault(name, []).append(next(clock))
            if name in inputs:
                leaves = pytree.tree_leaves((args, kwargs))
                inputs[name].append(
                    [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
                )

        return lambda: module.register_forward_pre_hook(hook, with_kwargs=True)

    def noisy(module: nn.Module) -> Callable[[], Any]:
        return lambda: module.register_forward_hook(noise_added)

    register = [recorder(name, module) for name, module in watched.items()]
    register += [noisy(module) for module in perturbed]
    with quietly(model), hooked(register):
        call_model(model, example)
    return ticks, inputs
