"""What else with a gradient enters a column/row pair, besides the values its columns make.

Between a pair's columns and its row each rank computes its slice of the activations; the
backward of that region hands each rank only its slice's share of the gradient of anything
read there. The columns' own input is summed over tp on the way back (their input copy), but
nothing else is: DeepSeek's attention adds one rotary key, made by a layer outside the pair,
to every head's key, so each rank would get its heads' share of that key's gradient, and the
replicated layers before it would drift apart on the tp ranks. A forward of the example with
autograd on, walked back from the row's input and stopped at the columns' outputs, finds
these: a graph node made before the pair's first column ran is a value entering from outside,
and a parameter reached is a weight read inside (inside.py decides which of those a sum over
tp can mend).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from meshsplit.batch import call_model
from meshsplit.tensor.probe import hooked

__all__: list[str] = []


@dataclass
class Entering:
    """What enters one pair between its columns and its row, with a gradient."""

    values: int = 0
    """Graph nodes made before the pair's first column ran, read inside it."""
    parameters: set[str] = field(default_factory=set)
    """Parameters read inside it (names in the model; '(an input)' for a leaf that is not)."""


def what_enters(
    model: nn.Module, example: Any, pairs: Mapping[str, list[str]]
) -> dict[str, Entering]:
    """Row layer -> what enters its pair (`pairs`: row -> columns) besides its columns'
    outputs, from one forward of `example` in eval mode with autograd on (nothing saved for
    a backward; the graph holds the parameters it reads, which a model with real weights
    holds anyway, so inside.py does not run it on a model on the meta device)."""
    anchor = torch.zeros((), requires_grad=True)  # its products number the graph's nodes
    starts: dict[str, int] = {}
    made: set[Any] = set()
    row_inputs: dict[str, list[Any]] = {}

    def column(name: str, module: nn.Module) -> list[Callable[[], Any]]:
        def before(*_: Any) -> None:
            with torch.enable_grad():  # a model may run a layer under no_grad (HRM's cycles)
                starts.setdefault(name, _node(anchor * 1)._sequence_nr())

        def after(_: nn.Module, __: Any, output: Any) -> None:
            made.update(t.grad_fn for t in _tensors(output) if t.grad_fn is not None)

        return [
            lambda: module.register_forward_pre_hook(before),
            lambda: module.register_forward_hook(after),
        ]

    def row(name: str, module: nn.Module) -> Callable[[], Any]:
        def before(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in row_inputs:
                leaves = _tensors((args, kwargs))
                row_inputs[name] = [t.grad_fn for t in leaves if t.grad_fn is not None]

        return lambda: module.register_forward_pre_hook(before, with_kwargs=True)

    register = [row(name, model.get_submodule(name)) for name in pairs]
    for columns in pairs.values():
        for name in columns:
            register += column(name, model.get_submodule(name))
    training = model.training
    model.eval()
    try:
        # the graph's shape is all that is read: nothing saved for a backward, no memory
        with torch.enable_grad(), hooked(register), saved_tensors_hooks(_dropped, _never_read):
            call_model(model, example)
    finally:
        model.train(training)
    names = {id(p): name for name, p in model.named_parameters()}
    found = {}
    for name, columns in pairs.items():
        if name in row_inputs and any(c in starts for c in columns):
            start = min(starts[c] for c in columns if c in starts)
            found[name] = _walk(row_inputs[name], made, start, names)
    return found


def _walk(roots: list[Any], stop: set[Any], start: int, names: dict[int, str]) -> Entering:
    """Back from `roots` through the graph, not past `stop` (the columns' outputs)."""
    entering, seen, todo = Entering(), set(), list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in stop or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf read here
        if variable is not None:
            entering.parameters.add(names.get(id(variable), "(an input)"))
        elif node._sequence_nr() < start:
            entering.values += 1
        else:
            todo.extend(next_node for next_node, _ in node.next_functions)
    return entering


def _dropped(_: torch.Tensor) -> None:
    return None


def _never_read(_: Any) -> torch.Tensor:
    raise RuntimeError("the data-flow walk's graph saved nothing for a backward")


def _node(tensor: torch.Tensor) -> Any:
    assert tensor.grad_fn is not None
    return tensor.grad_fn


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
