"""Any `nn.Module` as an ordered list of layers with explicit data flow between them.

A layer reads named values and writes named values; the pipeline cuts only between layers.
Three ways in, tried in order: `nn.Sequential`, `torch.fx` tracing (nodes grouped by unit:
a top-level child or a block inside one, see `grouping.py`; or by `split_point` markers),
`torch.export`. A skip connection is just a value with several readers, sent straight to
every stage that reads it.
Rationale: docs/internals.md#pipelinefrontendpy
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from meshsplit.batchnorm import BatchNorm
from meshsplit.pipeline.grouping import copied, groups, is_marker, joined, split_point, units
from meshsplit.plan import PlanError

__all__: list[str] = []

_MAX_OPAQUE_RETRIES = 32


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One piece of the model: reads `inputs`, writes `outputs` (value names)."""

    name: str
    """Unique name, shown by `describe()` (a child module's name when there is one)."""
    module: nn.Module
    """Runs the piece; its state-dict keys, with `prefix` in front, are the original model's."""
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    prefix: str
    """Prefix that turns `module`'s state-dict keys into the original model's keys."""
    packed: bool
    """True when `module` returns a tuple with one entry per output."""

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        result = self.module(*values)
        return tuple(result) if self.packed else (result,)


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The model as layers in execution order, and the names of its input and output."""

    layers: tuple[Layer, ...]
    input: str
    output: str
    source: str
    """How the layers were found: 'sequential', 'fx' or 'export'."""


def layer_graph(
    model: nn.Module, example: torch.Tensor | None = None, inside: frozenset[str] = frozenset()
) -> LayerGraph:
    """Turn `model` into a LayerGraph; PlanError naming the construct when none can be made.
    Values named in `inside` (a traced graph's) stay within one layer: the layers from the
    one making each to the last reading it become one."""
    if isinstance(model, nn.Sequential):
        return _from_sequential(model)
    try:
        traced, opaque = _trace_fx(model)
    except _RootUntraceable as failure:
        return _from_export(model, example, failure.reason, inside)
    owners = units(model)
    hiding = [name for name in opaque if any(o.startswith(f"{name}.") for o in owners)]
    if hiding and example is not None:
        # an opaque container would be one layer holding all its blocks: export may see inside
        try:
            why = f"fx could not trace into {', '.join(hiding)}"
            return _from_export(model, example, why, inside)
        except PlanError:
            pass  # then the container stays one layer
    source = "fx" if not opaque else f"fx (opaque: {', '.join(opaque)})"
    return _from_graph(traced, owners, source=source, inside=inside)


def _from_sequential(model: nn.Sequential) -> LayerGraph:
    layers, previous = [], "input"
    # every entry, as Sequential.forward runs them: one module listed twice is two layers
    for name, child in model._modules.items():
        if child is None:
            continue
        layers.append(
            Layer(
                name=name,
                module=child,
                inputs=(previous,),
                outputs=(name,),
                prefix=f"{name}.",
                packed=False,
            )
        )
        previous = name
    return LayerGraph(layers=tuple(layers), input="input", output=previous, source="sequential")


class _RootUntraceable(Exception):
    """fx cannot trace the root forward itself; `reason` says which construct stopped it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _OpaqueTracer(fx.Tracer):
    """An fx tracer that keeps chosen submodules opaque and remembers where tracing failed."""

    def __init__(self, opaque: set[str]) -> None:
        super().__init__(autowrap_functions=(split_point,))  # recorded as a call, not inlined
        self.opaque = opaque
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # our BatchNorm is a layer like nn.BatchNorm (its collectives are not traceable)
        return (
            module_qualified_name in self.opaque
            or isinstance(m, BatchNorm)
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module sees the error first
                self.failed_in = self.path_of_module(m)
            raise


def _trace_fx(model: nn.Module) -> tuple[fx.GraphModule, list[str]]:
    """Trace with fx, making each submodule that fails to trace opaque, innermost first."""
    opaque: set[str] = set()
    for _ in range(_MAX_OPAQUE_RETRIES):
        tracer = _OpaqueTracer(opaque)
        try:
            graph = tracer.trace(model)
        except Exception as error:
            if tracer.failed_in is None or tracer.failed_in in opaque:
                raise _RootUntraceable(f"{type(error).__name__}: {error}") from error
            opaque.add(tracer.failed_in)
            continue
        return fx.GraphModule(tracer.root, graph, type(model).__name__), sorted(opaque)
    raise _RootUntraceable(f"more than {_MAX_OPAQUE_RETRIES} submodules failed to trace")


def _from_export(
    model: nn.Module, example: torch.Tensor | None, fx_reason: str, inside: frozenset[str]
) -> LayerGraph:
    """Fall back to torch.export's graph (needs the example micro-batch)."""
    fix = (
        "make the model an nn.Sequential whose children are the pieces between the split "
        "points you want (each child may hold untraceable code), or make its forward traceable"
    )
    if example is None:
        raise PlanError(
            f"torch.fx cannot trace {type(model).__name__}.forward ({fx_reason}) and there is no "
            f"example input for torch.export; pass example_inputs= to parallelize, or {fix}"
        )
    try:
        batch = {0: torch.export.Dim.AUTO}  # let predict use other batch sizes where it can
        exported = torch.export.export(model, (example,), dynamic_shapes=(batch,))
    except Exception as error:
        raise PlanError(
            f"cannot split {type(model).__name__} into layers: torch.fx stopped at "
            f"({fx_reason}) and torch.export at ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); {fix}"
        ) from error
    module = exported.module()
    if not isinstance(module, fx.GraphModule):
        raise PlanError(f"torch.export returned {type(module).__name__}, not a graph; {fix}")
    return _from_graph(module, units(model), source="export", inside=inside)


def _from_graph(
    traced: fx.GraphModule, owners: set[str], *, source: str, inside: frozenset[str]
) -> LayerGraph:
    """Cut a traced graph into layers (one per run of `owners`' nodes), each a GraphModule
    over the original submodules."""
    graph = traced.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        names = ", ".join(str(n.target) for n in placeholders)
        raise PlanError(
            f"the model's forward takes {len(placeholders)} inputs ({names}); the layer split "
            "pipelines models with one input tensor; wrap the model so forward takes one tensor"
        )
    result = next(n for n in graph.nodes if n.op == "output").args[0]
    if isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]  # torch.export flattens the output into a tuple
    if not isinstance(result, fx.Node):
        raise PlanError(
            f"the model returns {type(result).__name__}, not one tensor; the layer split needs "
            "a single tensor output for the loss; wrap the model to return one tensor"
        )
    alias = {n: n.args[0] for n in graph.nodes if is_marker(n)}

    def resolve(node: fx.Node) -> fx.Node:
        while node in alias:
            node = alias[node]
        return node

    runs = joined(groups(graph, owners), inside, graph)
    final = resolve(result)
    readers: dict[fx.Node, set[int]] = {}
    for index, (_, nodes) in enumerate(runs):
        for node in nodes:
            for source_node in node.all_input_nodes:
                readers.setdefault(resolve(source_node), set()).add(index)
    layers = []
    for index, (name, nodes) in enumerate(runs):
        outputs = [
            n
            for n in nodes
            if not copied(n)
            and (n is final or any(reader != index for reader in readers.get(n, ())))
        ]
        if not outputs:
            continue  # nothing reads it (e.g. export's shape guards): not part of the data flow
        inputs = _external_inputs(nodes, resolve)
        layers.append(
            Layer(
                name=name,
                module=_sub_module(traced, name, nodes, inputs, outputs, resolve),
                inputs=tuple(n.name for n in inputs),
                outputs=tuple(n.name for n in outputs),
                prefix="",
                packed=True,
            )
        )
    return LayerGraph(
        layers=tuple(layers), input=placeholders[0].name, output=final.name, source=source
    )


def _external_inputs(nodes: list[fx.Node], resolve: Callable[[fx.Node], fx.Node]) -> list[fx.Node]:
    """Values a run reads but does not compute: its placeholders, in first-use order."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for source_node in map(resolve, node.all_input_nodes):
            if source_node not in inside and source_node not in inputs:
                inputs.append(source_node)
    return inputs


def _sub_module(
    traced: fx.GraphModule,
    name: str,
    nodes: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node],
    resolve: Callable[[fx.Node], fx.Node],
) -> fx.GraphModule:
    """A GraphModule running `nodes`; it keeps the root's qualified names for its submodules."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[resolve(n)])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(traced, graph, f"Layer_{name}")
