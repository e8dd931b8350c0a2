"""What a stage computes: the values it receives and sends (`Routes`), and its program, the
layers of a traced LayerGraph run in order over named values (`LayerProgram`).
Rationale: docs/internals.md#pipelineprogrampy
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from meshsplit.pipeline.frontend import Layer, LayerGraph

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class Routes:
    """The values one stage receives from earlier stages and sends to later ones."""

    receives: tuple[tuple[int, tuple[str, ...]], ...]
    """(source stage, value names), by source stage."""
    sends: tuple[tuple[int, tuple[str, ...]], ...]
    """(destination stage, value names), by destination stage."""


def plan_routes(graph: LayerGraph, sizes: Sequence[int]) -> list[Routes]:
    """Routes of every stage when stage k holds the next sizes[k] layers (a pure function).

    The model input is on every rank, so it is never sent; the model output is read by the
    last stage (the loss), wherever it is made.
    """
    stage_of_layer = [k for k, size in enumerate(sizes) for _ in range(size)]
    maker: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    order: list[str] = []
    for layer, stage in zip(graph.layers, stage_of_layer, strict=True):
        for name in layer.inputs:
            readers.setdefault(name, [])
            if stage not in readers[name]:
                readers[name].append(stage)
        for name in layer.outputs:
            maker[name] = stage
            order.append(name)
    readers.setdefault(graph.output, []).append(len(sizes) - 1)
    links: dict[tuple[int, int], list[str]] = {}
    for name in order:
        for reader in readers.get(name, []):
            if reader != maker[name] and name not in links.get((maker[name], reader), []):
                links.setdefault((maker[name], reader), []).append(name)
    return [
        Routes(
            receives=tuple((src, tuple(v)) for (src, dst), v in sorted(links.items()) if dst == k),
            sends=tuple((dst, tuple(v)) for (src, dst), v in sorted(links.items()) if src == k),
        )
        for k in range(len(sizes))
    ]


class Program(Protocol):
    """What a stage computes for one micro-batch: received values in, the values it makes out."""

    @property
    def made(self) -> Sequence[str]:
        """Names of the values `__call__` returns: what the sends carry, then (last stage) the
        model's output."""

    def __call__(self, x: Any, *received: torch.Tensor) -> tuple[Any, ...]: ...


class LayerProgram:
    """A stage's layers of a LayerGraph, run in order over named values, each value dropped
    after its last reader (as nn.Sequential drops a layer's input once the next has it): one
    autograd does not save is freed before the stage's forward ends."""

    def __init__(
        self, layers: Sequence[Layer], graph: LayerGraph, routes: Routes, last: bool
    ) -> None:
        self.layers = list(layers)
        self.model_input = graph.input
        self.received_names = [n for _, names in routes.receives for n in names]
        self.made = list(dict.fromkeys(n for _, names in routes.sends for n in names))
        if last:
            self.made.append(graph.output)
        self.dead = _dead_after(self.layers, set(self.made))
        """Per layer, the values no later layer reads and no send carries."""

    def __call__(self, x: Any, *received: torch.Tensor) -> tuple[Any, ...]:
        values = {self.model_input: x, **dict(zip(self.received_names, received, strict=True))}
        for layer, dead in zip(self.layers, self.dead, strict=True):
            outputs = layer(*(values[n] for n in layer.inputs))
            values.update(zip(layer.outputs, outputs, strict=True))
            for name in dead:
                del values[name]
        return tuple(values[n] for n in self.made)


def _dead_after(layers: Sequence[Layer], kept: set[str]) -> list[list[str]]:
    """For each layer, the names whose last use is that layer (read, or made and never
    read), except those in `kept`."""
    last: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in (*layer.inputs, *layer.outputs):
            last[name] = index
    dead: list[list[str]] = [[] for _ in layers]
    for name, index in last.items():
        if name not in kept:
            dead[index].append(name)
    return dead
