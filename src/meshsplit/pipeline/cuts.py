"""Where the layer split cuts a model, and what each stage then holds, runs and sends.

A model whose depth sits in a block list below the top level (or a plan with `split_points`)
is cut between those blocks and runs its own forward (`blocks.py`, `spine.py`); any other is
traced into layers with named data flow (`frontend.py`), which is also the fallback when the
blocks cannot be cut. Under the interleaved schedule the model is cut into pp*v chunks and rank
r holds chunks r, r+pp, ...; everything else here counts a rank's chunks together.
Rationale: docs/internals.md#pipelinecutspy
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshsplit.pipeline.blocks import (
    Piece,
    find_blocks,
    has_nested_blocks,
    refuse_layer_drop,
    sizes_at,
)
from meshsplit.pipeline.frontend import LayerGraph, layer_graph
from meshsplit.pipeline.partition import balance, balance_runs, check_split, split_words
from meshsplit.pipeline.profile import LayerCost, NotATensor, profile_layers
from meshsplit.pipeline.program import LayerProgram, Program, Routes, plan_routes
from meshsplit.pipeline.schedules import chunk_ranks
from meshsplit.pipeline.spine import Spine, check_chain, cut_positions
from meshsplit.plan import Plan, PlanError

__all__: list[str] = []

Agree = Callable[[list[LayerCost]], list[LayerCost]]
"""Makes every rank's measured costs the same numbers (a collective)."""

_BACKWARD_PER_FORWARD = 2.0
"""Backward time of a block-front-end piece, as a multiple of its measured forward."""


@dataclass(frozen=True, kw_only=True)
class Cuts:
    """The model as consecutive items (layers or pieces), and how they are cut into chunks
    (one per rank, or v per rank: chunk c on rank `placement[c]`)."""

    model: nn.Module
    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    costs: tuple[LayerCost, ...]
    sizes: tuple[int, ...]
    """Items per chunk."""
    ranks: int
    """Pipeline ranks (Plan.pp)."""
    placement: tuple[int, ...]
    """The rank of each chunk (`schedules.chunk_ranks`: c % ranks, or a V under 'zbv')."""
    routes: tuple[Routes, ...]
    output: str
    source: str
    programs: Callable[[int], Program]
    cut_starts: tuple[int, ...] | None = None
    """The items a balanced split may begin a stage at (block pieces); None for traced
    layers (anywhere) and for a split the plan pinned (not looked for)."""

    @property
    def starts(self) -> list[int]:
        return [sum(self.sizes[:k]) for k in range(len(self.sizes) + 1)]

    def _span(self, index: int) -> range:
        starts = self.starts
        return range(starts[index], starts[index + 1])

    def program(self, index: int) -> Program:
        return self.programs(index)

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks rank `rank` holds, in model order."""
        return [chunk for chunk, held in enumerate(self.placement) if held == rank]

    def items_of(self, rank: int) -> list[int]:
        """Indices of the items rank `rank` holds, chunk by chunk."""
        return [i for chunk in self.chunks_of(rank) for i in self._span(chunk)]

    def _held(self, rank: int) -> set[int]:
        """ids of the tensors rank `rank`'s items hold."""
        return {id(t) for i in self.items_of(rank) for t in _tensors(self.modules[i])}

    def _common(self) -> dict[str, torch.Tensor]:
        """State no item holds: the code between pieces reads it (a learned position table on
        the root, a buffer) or nothing does. Every stage keeps it."""
        held = {id(t) for module in self.modules for t in _tensors(module)}
        named = {name for module in self.modules for name in _by_model_name(module)}
        return {
            name: t
            for name, t in self.model.state_dict(keep_vars=True).items()
            if id(t) not in held and name not in named
        } | {
            name: p
            for name, p in self.model.named_parameters()
            if id(p) not in held and name not in named
        }

    def stage_module(self, rank: int) -> nn.Module:
        """The modules rank `rank` trains, as one module (for parameters and mode)."""
        stage = nn.ModuleDict(
            {self.names[i].replace(".", "/"): self.modules[i] for i in self.items_of(rank)}
        )
        common = nn.Module()
        for name, tensor in self._common().items():
            if isinstance(tensor, nn.Parameter):
                common.register_parameter(name.replace(".", "/"), tensor)
        stage["<common>"] = common
        return stage

    def local_state(self, index: int) -> dict[str, torch.Tensor]:
        """Rank `index`'s state under the original model's names: every name of a tensor its
        items hold (an alias of a tied weight too, e.g. T5's `shared`), and the common state."""
        mine, common = self._held(index), self._common()
        own = {
            k: t for i in self.items_of(index) for k, t in _by_model_name(self.modules[i]).items()
        }
        return {
            key: own.get(key, value)
            for key, value in self.model.state_dict(keep_vars=True).items()
            if id(value) in mine or key in common or key in own
        }

    def release_other_stages(self, index: int) -> None:
        """Free the weights of other ranks' items, so each rank holds only its share. Their
        buffers stay: the model's own forward, which every stage runs, may read one outside
        its item (FNet's and Nystromformer's read the embeddings' token_type_ids)."""
        mine = self._held(index)
        everyone = {id(p) for module in self.modules for p in module.parameters()}
        with torch.no_grad():
            for param in self.model.parameters():
                if id(param) in everyone and id(param) not in mine:
                    param.data = param.data.new_empty(0)

    def shared_parameters(self) -> list[tuple[str, tuple[int, ...], nn.Parameter]]:
        """(name, ranks, parameter) for each parameter several ranks hold: one that items of
        several ranks use (tied embeddings), and the common ones (every rank)."""
        stages_of: dict[int, list[int]] = {}
        for stage in range(self.ranks):
            for i in self.items_of(stage):
                for param in self.modules[i].parameters():
                    holders = stages_of.setdefault(id(param), [])
                    if stage not in holders:
                        holders.append(stage)
        every = tuple(range(self.ranks))
        common = {id(t) for t in self._common().values()}
        return [
            (name, every if id(param) in common else tuple(stages_of[id(param)]), param)
            for name, param in self.model.named_parameters()
            if id(param) in common or len(stages_of.get(id(param), ())) > 1
        ]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _by_model_name(module: nn.Module) -> dict[str, torch.Tensor]:
    """A traced item's own references to tensors its code reads directly (PoolFormer's
    layer_scale), under their names in the model: sharding replaces them there, not in the
    model, which then still holds the old ones."""
    if not isinstance(module, torch.fx.GraphModule):
        return {}
    return dict(module.state_dict(keep_vars=True))


def find_cuts(model: nn.Module, example: Any, plan: Plan, agree: Agree) -> Cuts:
    """Cut `model` into plan.pp stages, or pp*virtual_stages chunks when interleaved (every
    rank must call this: `agree` is a collective)."""
    refuse_layer_drop(model)
    blocks_error: PlanError | None = None
    if plan.split_points is not None or has_nested_blocks(model):
        try:
            cuts = _from_blocks(model, example, plan, agree)
        except PlanError as error:
            if plan.split_points is not None:
                raise
            blocks_error = error
        else:
            if plan.stages is not None or plan.split_points is not None:
                return cuts
            return _better_balanced(cuts, model, example, plan, agree)
    return _traced(model, example, plan, agree, blocks_error)


_TRY_TRACING_ABOVE = 1.5
"""A block split whose largest chunk holds over this multiple of an even share of the
weights is compared with the traced one: a forward that adds each block's output to a running
sum outside the block (`h = h + block(norm(h))` in a loop) lets a cut fall only where nothing
but the block's input crosses, often nowhere but before the head. Weights, not measured time:
the choice must not flip with the machine's noise from one run to the next."""


def _better_balanced(cuts: Cuts, model: nn.Module, example: Any, plan: Plan, agree: Agree) -> Cuts:
    """`cuts` from the blocks, or the traced cuts where those spread the weights clearly more
    evenly (every rank decides alike: the same model, the same agreed costs)."""
    if _imbalance(cuts) <= _TRY_TRACING_ABOVE:
        return cuts
    try:
        traced = _traced(model, example, plan, agree, None)
    except Exception:  # noqa: BLE001 - the same on every rank; the block cuts stand
        return cuts
    return traced if _imbalance(traced) < 0.8 * _imbalance(cuts) else cuts


def _imbalance(cuts: Cuts) -> float:
    """The largest chunk's weights over an even share of them (1.0: perfectly even)."""
    starts = cuts.starts
    held = [
        sum(c.parameter_bytes for c in cuts.costs[starts[k] : starts[k + 1]])
        for k in range(len(cuts.sizes))
    ]
    return max(held) * len(held) / max(sum(held), 1)


def _traced(
    model: nn.Module, example: Any, plan: Plan, agree: Agree, blocks_error: PlanError | None
) -> Cuts:
    """Cut the model's traced layers (`frontend.py`); `blocks_error` says why the blocks
    could not be cut, if they were tried."""
    inside: frozenset[str] = frozenset()  # values that are no tensor: kept in one layer
    while True:
        try:
            graph = layer_graph(model, example, inside)
        except PlanError as error:
            if blocks_error is not None:
                raise PlanError(f"{blocks_error}; and tracing it failed: {error}") from error
            raise
        if blocks_error is not None and len(graph.layers) < _chunks(plan):
            label, _ = split_words(_chunks(plan), plan.virtual_stages)
            raise PlanError(
                f"{label} exceeds the {len(graph.layers)} layers at the top level of "
                f"{type(model).__name__}, and cutting inside it failed: {blocks_error}"
            )
        try:
            return _from_graph(model, graph, example, plan, agree)
        except NotATensor as crossing:  # the same on every rank: all trace again
            if graph.source == "sequential" or crossing.value in inside:
                raise
            inside |= {crossing.value}


def _chunks(plan: Plan) -> int:
    return plan.pp * plan.virtual_stages


def _from_graph(
    model: nn.Module, graph: LayerGraph, example: Any, plan: Plan, agree: Agree
) -> Cuts:
    chunks = _chunks(plan)
    check_split(len(graph.layers), chunks, plan.stages, plan.virtual_stages)
    # pinned stages need the costs only to describe them: one timed sweep is enough
    costs = agree(profile_layers(graph, example, repeats=1 if plan.stages else 5))
    trainable = [any(p.requires_grad for p in x.module.parameters()) for x in graph.layers]
    memory = [c.parameter_bytes for c in costs]
    sizes = tuple(
        plan.stages
        or balance([c.total_ms for c in costs], chunks, trainable, memory, plan.virtual_stages)
    )
    refuse_stages_without_parameters([x.name for x in graph.layers], trainable, sizes)
    routes = plan_routes(graph, sizes)
    starts = [sum(sizes[:k]) for k in range(chunks + 1)]

    def program(index: int) -> Program:
        layers = graph.layers[starts[index] : starts[index + 1]]
        return LayerProgram(layers, graph, routes[index], last=index == chunks - 1)

    return Cuts(
        model=model,
        names=tuple(x.name for x in graph.layers),
        modules=tuple(x.module for x in graph.layers),
        costs=tuple(costs),
        sizes=sizes,
        ranks=plan.pp,
        placement=tuple(chunk_ranks(plan.pp, plan.virtual_stages, plan.schedule)),
        routes=tuple(routes),
        output=graph.output,
        source=graph.source,
        programs=program,
    )


def _from_blocks(model: nn.Module, example: Any, plan: Plan, agree: Agree) -> Cuts:
    blocks = find_blocks(model, example)
    pieces = blocks.pieces
    chunks = _chunks(plan)
    check_split(len(pieces), chunks, plan.stages, plan.virtual_stages)
    measured = [
        LayerCost(
            forward_ms=piece.forward_ms,
            backward_ms=_BACKWARD_PER_FORWARD * piece.forward_ms,
            parameter_bytes=piece.parameter_bytes,
            activation_bytes=after.crossing_bytes if after is not None else 0,
        )
        for piece, after in zip(pieces, [*pieces[1:], None], strict=True)
    ]
    costs = agree(measured)
    trainable = [any(p.requires_grad for p in x.module.parameters()) for x in pieces]
    spine = Spine(model, pieces)
    positions = None
    if plan.split_points is not None:
        sizes = sizes_at(pieces, plan.split_points)
    elif plan.stages is not None:
        sizes = plan.stages
    else:
        positions = tuple(cut_positions(spine, example))
        sizes = _balanced(costs, trainable, positions, chunks, pieces, plan.virtual_stages)
    refuse_stages_without_parameters([x.name for x in pieces], trainable, sizes)
    check_chain(spine, sizes, example)
    starts = [sum(sizes[:k]) for k in range(chunks + 1)]
    names = [tuple(f"cut{k}.{j}" for j in range(pieces[starts[k]].crossing)) for k in range(chunks)]
    routes = [
        Routes(
            receives=((k - 1, names[k]),) if k > 0 else (),
            sends=((k + 1, names[k + 1]),) if k < chunks - 1 else (),
        )
        for k in range(chunks)
    ]

    def program(index: int) -> Program:
        last = index == chunks - 1
        made = ["output"] if last else list(names[index + 1])
        return _SpineProgram(spine, starts[index], starts[index + 1], made)

    return Cuts(
        model=model,
        names=tuple(x.name for x in pieces),
        modules=tuple(x.module for x in pieces),
        costs=tuple(costs),
        sizes=sizes,
        ranks=plan.pp,
        placement=tuple(chunk_ranks(plan.pp, plan.virtual_stages, plan.schedule)),
        routes=tuple(routes),
        output="output",
        source=f"blocks ({', '.join(blocks.lists)})",
        programs=program,
        cut_starts=positions,
    )


def _balanced(
    costs: Sequence[LayerCost],
    trainable: Sequence[bool],
    cuts: Sequence[int],
    stages: int,
    pieces: Sequence[Piece],
    virtual_stages: int,
) -> tuple[int, ...]:
    """The profile-balanced split (weights spread evenly among near-fastest ones) that cuts
    only where a stage may begin.

    Pieces between two allowed cuts form one segment; the partitioner balances segments.
    """
    bounds = [0, *cuts, len(costs)]
    segments = list(zip(bounds, bounds[1:], strict=False))
    if len(segments) < stages:
        label, name = split_words(stages, virtual_stages)
        raise PlanError(
            f"{label} needs {stages - 1} cuts, but a stage can begin only at "
            f"{[pieces[k].name for k in cuts]}; use {name} <= {len(segments)}"
        )
    total = [c.total_ms for c in costs]
    held = [c.parameter_bytes for c in costs]
    return balance_runs(total, segments, stages, trainable, held, virtual_stages)


class _SpineProgram:
    """Stage program of the block front end: pieces [first, stop) inside the model's forward."""

    def __init__(self, spine: Spine, first: int, stop: int, made: Sequence[str]) -> None:
        self.spine, self.first, self.stop, self.made = spine, first, stop, list(made)

    def __call__(self, x: Any, *received: torch.Tensor) -> tuple[Any, ...]:
        return self.spine.run(self.first, self.stop, x, received)


def refuse_stages_without_parameters(
    names: Sequence[str], trainable: Sequence[bool], sizes: Sequence[int]
) -> None:
    """A stage with nothing to train cannot build its optimizer; say which and what to do."""
    start = 0
    for stage, size in enumerate(sizes):
        if not any(trainable[start : start + size]):
            raise PlanError(
                f"stage {stage} of Plan.stages={list(sizes)} holds only layers without "
                f"trainable parameters ({', '.join(names[start : start + size])}); give it a "
                "layer with parameters via Plan.stages, or use fewer stages"
            )
        start += size
