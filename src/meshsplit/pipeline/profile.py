"""Measure each layer on this device: forward and backward time, parameter and activation bytes.

Each layer runs on the values the layers before it produced for one micro-batch, so its
inputs have real shapes. Backward is timed as torch.autograd.grad of the layer's outputs
with respect to its floating-point inputs and its parameters, the work one pipeline
backward does there, without touching `.grad`. The times are compute: the waits of an
operator split's collectives inside a layer are left out (on shared cores they vary with
what the other ranks do, and an estimate made in one process, with no peers to wait for,
would cut elsewhere). Buffers (e.g. BatchNorm statistics) and the
random generators are restored afterwards, so profiling leaves training unchanged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from meshsplit import phases
from meshsplit.pipeline.frontend import Layer, LayerGraph
from meshsplit.plan import PlanError

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer costs for one micro-batch."""

    forward_ms: float
    backward_ms: float
    parameter_bytes: int
    activation_bytes: int
    """Bytes of the layer's outputs (what a stage boundary after it would send)."""

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def profile_layers(graph: LayerGraph, example: torch.Tensor, repeats: int = 5) -> list[LayerCost]:
    """One LayerCost per layer of `graph`: the median of `repeats` timed runs after a warm-up.

    The runs sweep the whole model in turn rather than repeating one layer back to back, so
    a burst of load from another process inflates one sample of many layers, and the
    median discards it while keeping what a typical step pays (what the planner predicts).
    """
    modules = [layer.module for layer in graph.layers]
    buffers = [b.detach().clone() for m in modules for b in m.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if example.is_cuda else None
    try:
        values: dict[str, Any] = {graph.input: example}
        runs = []
        for layer in graph.layers:  # warm-up sweep: also makes every layer's real inputs
            args = [_leaf(values[name], trainable=name != graph.input) for name in layer.inputs]
            _, _, outputs = _timed(layer, args)
            values.update(_checked(layer, outputs))
            runs.append(args)
        forward: list[list[float]] = [[] for _ in graph.layers]
        backward: list[list[float]] = [[] for _ in graph.layers]
        for _ in range(repeats):
            for index, (layer, args) in enumerate(zip(graph.layers, runs, strict=True)):
                f, b, _ = _timed(layer, args)
                forward[index].append(f)
                backward[index].append(b)
    finally:
        with torch.no_grad():
            for saved, live in zip(buffers, (b for m in modules for b in m.buffers()), strict=True):
                live.copy_(saved)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return [
        LayerCost(
            forward_ms=1e3 * statistics.median(forward[index]),
            backward_ms=1e3 * statistics.median(backward[index]),
            parameter_bytes=sum(p.numel() * p.element_size() for p in layer.module.parameters()),
            activation_bytes=sum(
                values[name].numel() * values[name].element_size() for name in layer.outputs
            ),
        )
        for index, layer in enumerate(graph.layers)
    ]


def _timed(layer: Layer, args: list[Any]) -> tuple[float, float, tuple[Any, ...]]:
    """`_time_once`, with a layer that cannot run and differentiate alone refused before any
    step (torch.export's layers of a tp-split model can keep a graph from one run to the
    next)."""
    try:
        return _time_once(layer, args)
    except RuntimeError as error:
        raise PlanError(
            f"layer {layer.name!r} of the traced model cannot run and differentiate on its own "
            f"({str(error).splitlines()[0][:160]}); mark the cuts with "
            "meshsplit.pipeline.split_point(x) in forward, or use a plan without pp"
        ) from error


def _time_once(layer: Layer, args: list[Any]) -> tuple[float, float, tuple[Any, ...]]:
    """Seconds for the layer's forward and for its backward, and its outputs."""
    params = [p for p in layer.module.parameters() if p.requires_grad]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + params
    _synchronize(args)
    started = phases.compute_clock()
    outputs = layer(*args)
    _synchronize(outputs)
    middle = phases.compute_clock()
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable and wrt:
        torch.autograd.grad(
            differentiable,
            wrt,
            grad_outputs=[torch.ones_like(o) for o in differentiable],
            allow_unused=True,
        )
    _synchronize(outputs)
    return middle - started, phases.compute_clock() - middle, outputs


class NotATensor(PlanError):
    """A layer hands a later layer a value that is not a tensor (an int, a tuple): no stage
    boundary may fall between them; `value` names it."""

    def __init__(self, message: str, value: str) -> None:
        super().__init__(message)
        self.value = value


def _checked(layer: Layer, outputs: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """The layer's outputs by name, refusing values that cannot cross a stage boundary."""
    named = {}
    for name, value in zip(layer.outputs, outputs, strict=True):
        if not isinstance(value, torch.Tensor):
            raise NotATensor(
                f"layer {layer.name!r} passes {name!r} of type {type(value).__name__} to a later "
                "layer; only tensors can cross a stage boundary; mark split points by hand "
                "(an nn.Sequential of pieces) so that value stays inside one piece",
                name,
            )
        named[name] = value.detach()
    return named


def _leaf(value: Any, *, trainable: bool) -> Any:
    """A fresh autograd leaf: later layers' inputs need gradients, the model input does not."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(trainable and value.is_floating_point())


def _synchronize(tensors: Any) -> None:
    """Wait for queued GPU work so wall-clock time measures it (nothing to do on CPU)."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        torch.cuda.synchronize()
