"""Which layer each node of a traced graph belongs to: runs of nodes, one per unit of the model.

A unit is a top-level child, or, inside a child that keeps a block list, one block or one
parameter holder beside it (`blocks.piece_names`): so a container whose own `forward` loops
over what is inside its blocks (x-transformers' `AttentionLayers`) is cut between the blocks,
and the values that cross (hidden states, residuals, masks, rotary tables) follow the data
flow. Code outside every unit joins the layer before it; `split_point` markers override all.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from meshsplit.pipeline.blocks import piece_names

__all__ = ["split_point"]


def split_point(x: torch.Tensor) -> torch.Tensor:
    """Mark a place in `forward` where a pipeline stage may begin: `x = split_point(x)`.

    Identity when run; under tracing, the model's layers become the segments between markers.
    """
    return x


def units(model: nn.Module) -> set[str]:
    """Module paths whose nodes form one layer each: the top-level children, a child that
    keeps a block list replaced by its blocks and the parameter holders beside them."""
    pieces = piece_names(model)
    top = {
        name
        for name, child in model._modules.items()  # a module listed twice: both its names
        if child is not None and not any(piece.startswith(name + ".") for piece in pieces)
    }
    return top | set(pieces)


def is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is split_point


def copied(node: fx.Node) -> bool:
    """Nodes each reader recomputes instead of receiving: parameter reads, shape reads and
    arithmetic over shapes.

    A shape is a Python int, not a tensor, so it cannot travel between stages; reading it
    again where it is needed costs nothing. torch.export also shares shape arithmetic between
    blocks (nn.MultiheadAttention's batch x heads, made once and read by every later block),
    which would otherwise tie all those blocks into one layer.
    """
    return node.op == "get_attr" or _shape(node)


_NUMBER_OPS = frozenset(
    (operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
     operator.mod, operator.neg, operator.pow)
)  # fmt: skip
"""Python arithmetic: over shapes and constants only, a number (over a tensor, a tensor)."""


def _shape(node: fx.Node) -> bool:
    """A shape, a dimension of one, or arithmetic over them and constants."""
    if node.op == "call_method":
        return node.target == "size"
    return node.op == "call_function" and (
        node.target is torch.ops.aten.sym_size.int
        or (node.target is getattr and node.args[1:] == ("shape",))
        or (node.target is operator.getitem and _shape(node.args[0]))  # type: ignore[arg-type]
        or (
            node.target in _NUMBER_OPS
            and all(_shape(a) for a in node.args if isinstance(a, fx.Node))
        )
    )


def groups(graph: fx.Graph, owners: set[str]) -> list[tuple[str, list[fx.Node]]]:
    """Consecutive runs of body nodes: one per split-point segment, else one per owner unit.

    Parameter reads and shape reads are copied into every run that uses them (see
    `copied`), so each run is self-contained however the tracer ordered them.
    """
    body = [
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output") and not copied(n) and not _is_guard(n)
    ]
    runs: list[tuple[str, list[fx.Node]]] = []
    if any(is_marker(n) for n in body):
        runs.append(("part0", []))
        for node in body:
            if is_marker(node):
                runs.append((f"part{len(runs)}", []))
            else:
                runs[-1][1].append(node)
    else:
        keys = [_owner(n, owners) for n in body]
        leading = next((k for k in keys if k is not None), "root")
        for node, owner in zip(body, keys, strict=True):
            # code outside every unit joins the layer before it (the first layer when it leads)
            key = owner if owner is not None else (runs[-1][0] if runs else leading)
            if runs and runs[-1][0] == key:
                runs[-1][1].append(node)
            else:
                runs.append((key, [node]))
    position = {node: index for index, node in enumerate(graph.nodes)}
    closed = [(name, _with_copies(nodes, position)) for name, nodes in runs]
    return _unique_names([(name, nodes) for name, nodes in closed if nodes])


def joined(
    runs: list[tuple[str, list[fx.Node]]], inside: frozenset[str], graph: fx.Graph
) -> list[tuple[str, list[fx.Node]]]:
    """`runs` with the runs from the one making each value named in `inside` to the last one
    reading it made one (named after the first): such a value (an int a layer returns) cannot
    cross a stage boundary, so no boundary may fall between them."""
    if not inside:
        return runs
    made = {n.name: i for i, (_, nodes) in enumerate(runs) for n in nodes if not copied(n)}
    last = list(range(len(runs)))  # the last run each run must be joined up to
    for index, (_, nodes) in enumerate(runs):
        for node in nodes:
            for source in node.all_input_nodes:
                start = made.get(source.name)
                if source.name in inside and start is not None and start < index:
                    last[start] = max(last[start], index)
    position = {node: index for index, node in enumerate(graph.nodes)}
    merged: list[tuple[str, list[fx.Node]]] = []
    end = -1
    for index, (name, nodes) in enumerate(runs):
        if index <= end:  # within the span of the run being joined
            members = set(merged[-1][1]) | set(nodes)
            merged[-1] = (merged[-1][0], sorted(members, key=position.__getitem__))
        else:
            merged.append((name, list(nodes)))
        end = max(end, last[index])
    return merged


def _owner(node: fx.Node, owners: set[str]) -> str | None:
    """The unit a node runs in, or None for code outside every unit.

    A call of a module that holds several units (one fx kept opaque) is a unit of its own.
    """
    if node.op == "call_module":
        paths = [str(node.target)]
    else:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [value[0] if isinstance(value, tuple) else str(value) for value in stack.values()]
    for path in paths:
        parts = path.split(".")
        for end in range(1, len(parts) + 1):
            head = ".".join(parts[:end])
            if head in owners:
                return head
    if node.op == "call_module" and any(o.startswith(f"{node.target}.") for o in owners):
        return str(node.target)
    return None


def _is_guard(node: fx.Node) -> bool:
    """torch.export's input-shape guards: a check, not part of the data flow."""
    return node.op == "call_module" and node.target == "_guards_fn"


def _with_copies(nodes: list[fx.Node], position: dict[fx.Node, int]) -> list[fx.Node]:
    """`nodes` plus the copied nodes they read (transitively), in graph order."""
    members = set(nodes)
    pending = list(nodes)
    while pending:
        for source_node in pending.pop().all_input_nodes:
            if copied(source_node) and source_node not in members:
                members.add(source_node)
                pending.append(source_node)
    return sorted(members, key=position.__getitem__)


def _unique_names(runs: list[tuple[str, list[fx.Node]]]) -> list[tuple[str, list[fx.Node]]]:
    """A module called twice at separate places gives two layers: 'enc' and 'enc_2'."""
    seen: dict[str, int] = {}
    named = []
    for key, nodes in runs:
        seen[key] = seen.get(key, 0) + 1
        named.append((key if seen[key] == 1 else f"{key}_{seen[key]}", nodes))
    return named
