"""Zero bubble's backward in two passes, each doing its own half of the work.

B computes the gradients of a chunk's received values and, at every node where a
parameter's gradient leaves that input path (an "exit": a matmul's backward, which feeds both
its input and its weight), keeps the gradient arriving there. W starts from those exits with
what B kept and runs only the parameter halves of their backward: no input gradient is
computed twice. W accumulates into `.grad` as a plain backward does, so hooks on the
parameters (the dp gradient sync) fire in W, once per micro-batch. This follows the split of
the zero-bubble schedule (arXiv 2401.10241) over autograd's own graph; the graph is kept
between the passes (retain_graph) and freed when W drops it.
Rationale: docs/internals.md#pipelinestagepy
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward, get_gradient_edge

__all__: list[str] = []

Grads = tuple[torch.Tensor | None, ...]
"""The gradients arriving at a node, one per output of its forward (None: none arrived)."""


@dataclass(eq=False)
class _Exits:
    """Parameters whose gradients leave the input path at the same nodes, with the gradients
    B saw arriving at those nodes; W computes them in one backward call, so each parameter's
    hooks fire once per micro-batch, as in a plain backward."""

    params: list[torch.Tensor]
    nodes: list[Node]
    arrived: dict[Node, Grads] = field(default_factory=dict)
    starts: list[GradientEdge] = field(default_factory=list)
    """Roots whose paths never meet the input path, which W starts from as well."""
    seeds: list[torch.Tensor] = field(default_factory=list)


WeightWork = list[_Exits]
"""What W needs of one micro-batch's chunk after B."""


def input_gradients(
    roots: Sequence[torch.Tensor],
    seeds: Sequence[torch.Tensor | None],
    leaves: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], WeightWork]:
    """B: the gradients of `leaves` (zeros where unused) from `roots` seeded by `seeds`, and
    what W needs to compute the parameters' gradients later."""
    starts = [root.grad_fn for root in roots]
    feeders = _feeders(node for node in starts if node is not None)
    inputs = {get_gradient_edge(leaf).node for leaf in leaves}
    input_path = _reaching(inputs, feeders)
    groups = _exit_groups(feeders, inputs, input_path)
    handles = [
        node.register_prehook(_keeper(group, node)) for group in groups for node in group.nodes
    ]
    try:
        found = gradients_of(leaves, roots, seeds)
    finally:
        for handle in handles:
            handle.remove()
    apart = [
        (root, seed)
        for root, seed, node in zip(roots, seeds, starts, strict=True)
        if node is not None and node not in input_path
    ]
    if apart:
        groups = _with_apart_roots(groups, apart, feeders)
    return found, groups


def gradients_of(
    leaves: Sequence[torch.Tensor],
    roots: Sequence[torch.Tensor],
    seeds: Sequence[torch.Tensor | None],
) -> list[torch.Tensor]:
    """The gradients of `leaves` alone (zeros where unused), keeping the graph for W."""
    got = torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True)
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, leaves, strict=True)]


def weight_gradients(work: WeightWork) -> None:
    """W: accumulate every parameter's gradient from what B kept (hooks fire as usual). Its
    backward calls, one per group, run over parts of the graph no two share, so a region
    recomputed in backward (non-reentrant checkpoint) is recomputed once for all of them,
    not once per call (a convolution net under recompute ran 3x as long as 1F1B)."""
    with torch.utils.checkpoint.GraphExecGroup():
        _weight_groups(work)


def _weight_groups(work: WeightWork) -> None:
    for group in work:
        edges = list(group.starts)
        grads = list(group.seeds)
        for node, arrived in group.arrived.items():
            for slot, grad in enumerate(arrived):
                if grad is not None:
                    edges.append(GradientEdge(node, slot))
                    grads.append(grad)
        if not edges:
            continue
        # one exit may feed another through the input path: each must start from what B
        # saw there, not from what this pass sends it again
        handles = (
            [node.register_prehook(_replayer(arrived)) for node, arrived in group.arrived.items()]
            if len(group.arrived) > 1
            else []
        )
        try:
            _run_backward(edges, grads, group.params)
        finally:
            for handle in handles:
                handle.remove()


def _run_backward(
    edges: list[GradientEdge], grads: list[torch.Tensor], params: list[torch.Tensor]
) -> None:
    """`torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)` without its
    checks of what B already made right (gradients shaped as their edges): W calls it once
    per group, and the checks took 10-20% of the reference transformer's W on this host."""
    _engine_run_backward(
        tuple(edges), tuple(grads), True, False, tuple(params), allow_unreachable=True,
        accumulate_grad=True,
    )  # fmt: skip


def _with_apart_roots(
    groups: list[_Exits],
    apart: list[tuple[torch.Tensor, torch.Tensor | None]],
    feeders: dict[Node, list[Node]],
) -> list[_Exits]:
    """Join the roots that never meet the input path into one group with every group whose
    parameters they reach, so that no parameter is accumulated by two backward calls."""
    reached = _leaves_below([root.grad_fn for root, _ in apart if root.grad_fn is not None])
    variables = {id(t): t for t in reached}
    joined = [g for g in groups if any(id(p) in variables for p in g.params)]
    merged = _Exits(params=[], nodes=[])
    for group in joined:
        merged.params += group.params
        merged.nodes += group.nodes
        merged.arrived.update(group.arrived)
    known = {id(p) for p in merged.params}
    merged.params += [t for k, t in variables.items() if k not in known]
    merged.starts = [get_gradient_edge(root) for root, _ in apart]
    merged.seeds = [torch.ones_like(r) if s is None else s for r, s in apart]
    return [g for g in groups if g not in joined] + [merged]


def _leaves_below(starts: Iterable[Node]) -> list[torch.Tensor]:
    """The leaves (parameters) whose AccumulateGrad nodes the backward of `starts` reaches."""
    seen: set[Node] = set()
    queue = list(starts)
    found: list[torch.Tensor] = []
    while queue:
        node = queue.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
        queue += [child for child, _ in node.next_functions if child is not None]
    return found


def _feeders(starts: Iterable[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that send it gradient, over the graph below `starts`."""
    feeders: dict[Node, list[Node]] = {node: [] for node in starts}
    queue = list(feeders)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in feeders:
                feeders[child] = []
                queue.append(child)
            feeders[child].append(node)
    return feeders


def _reaching(targets: set[Node], feeders: dict[Node, list[Node]]) -> set[Node]:
    """Every node whose backward leads to one of `targets` (the targets included)."""
    reached = {node for node in targets if node in feeders}
    queue = list(reached)
    while queue:
        for parent in feeders[queue.pop()]:
            if parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached


def _exit_groups(
    feeders: dict[Node, list[Node]], inputs: set[Node], input_path: set[Node]
) -> list[_Exits]:
    """The parameters below the roots grouped by the input-path nodes their gradients leave
    from; parameters sharing an exit share a group."""
    by_exit: dict[Node, _Exits] = {}
    groups: list[_Exits] = []
    for node in feeders:
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is None or node in inputs:
            continue
        exits = _exits_above(node, feeders, input_path)
        joined = list({id(by_exit[n]): by_exit[n] for n in exits if n in by_exit}.values())
        group = _Exits(params=[variable], nodes=list(exits))
        for other in joined:
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in exits]
            groups.remove(other)
        groups.append(group)
        for n in group.nodes:
            by_exit[n] = group
    return [g for g in groups if g.nodes]


def _exits_above(node: Node, feeders: dict[Node, list[Node]], input_path: set[Node]) -> set[Node]:
    """The first input-path nodes met going up from `node` toward the roots."""
    exits: set[Node] = set()
    seen = {node}
    queue = [node]
    while queue:
        for parent in feeders[queue.pop()]:
            if parent in seen:
                continue
            seen.add(parent)
            if parent in input_path:
                exits.add(parent)
            else:
                queue.append(parent)
    return exits


def _keeper(group: _Exits, node: Node) -> Callable[[Grads], None]:
    """A pre-hook that keeps the gradients arriving at `node` in B."""

    def keep(grad_outputs: Grads) -> None:
        group.arrived[node] = tuple(grad_outputs)

    return keep


def _replayer(arrived: Grads) -> Callable[[Grads], Grads]:
    """A pre-hook that makes a node start from what B saw arrive at it."""

    def replay(grad_outputs: Grads) -> Grads:
        return arrived

    return replay
