"""Cuts inside a model: the repeated blocks its own `forward` calls in turn, found by one run.

Real models keep their depth one level down (`model.layers`, `transformer.h`, ResNet `stages`)
behind a `forward` no tracer takes whole, so hooks watch one forward on an example micro-batch
instead: each child of a repeated-block list, and each module with parameters beside the path
down to it, is a piece. A stage then runs the model's own forward with the other stages'
pieces stubbed out (see `spine.py`). Rationale: docs/internals.md#pipelineblockspy
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshsplit import phases
from meshsplit.batch import call_model, rows, tensors
from meshsplit.plan import PlanError

__all__: list[str] = []

_REPEATS = 3
"""Timed forwards per piece when profiling; the fastest counts (noise only adds time)."""


@dataclass(frozen=True, kw_only=True)
class Placeholder:
    """What a stubbed piece returns: its output's structure, with zeros of the right shapes.

    Code between pieces may read shapes and dtypes of what a piece returned before the
    stage's first piece takes the received values, so a stub keeps them (dimension 0 follows
    the micro-batch's rows when it did in the example).
    """

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    """Per leaf: (shape, dtype, batch_first) for tensors, the value itself otherwise."""

    def make(self, batch_rows: int, device: torch.device) -> Any:
        made = []
        for leaf in self.leaves:
            if isinstance(leaf, TensorLeaf):
                shape = (batch_rows, *leaf.shape[1:]) if leaf.batch_first else leaf.shape
                made.append(torch.zeros(shape, dtype=leaf.dtype, device=device))
            else:
                made.append(leaf)
        return pytree.tree_unflatten(made, self.spec)


@dataclass(frozen=True)
class TensorLeaf:
    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_first: bool


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One module a cut may fall before, with what one example run said about it."""

    name: str
    """Its path in the model, e.g. 'm.model.layers.2' (what Plan.split_points names)."""
    module: nn.Module
    forward_ms: float
    parameter_bytes: int
    crossing_bytes: int
    """Bytes of the tensors it is called with: what a cut before it sends per micro-batch."""
    crossing: int
    """How many tensors it is called with (args and kwargs): the values a cut before it sends."""
    placeholders: dict[bool, tuple[Placeholder, ...]]
    """Training or not -> what each of its calls in one forward returned, in call order (a
    piece a loop calls again, or one called on its input's padding too, may answer in other
    shapes; a forward may make other values when evaluating, as RWKV's state)."""


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """A model as pieces in call order, and the block lists they came from."""

    pieces: tuple[Piece, ...]
    lists: tuple[str, ...]
    """The repeated-block lists found, e.g. ('m.model.layers',)."""


def find_blocks(model: nn.Module, example: Any) -> Blocks:
    """The pieces of `model`, from one profiled forward on `example` (PlanError if none)."""
    named = dict(model.named_modules())
    lists = _block_lists(model, named)
    if not lists:
        raise PlanError(
            f"found no repeated blocks in {type(model).__name__} to cut between (an "
            "nn.ModuleList, nn.Sequential or nn.ModuleDict of two or more children with "
            "parameters); make the "
            "model an nn.Sequential of its pieces, or mark cuts with "
            "meshsplit.pipeline.split_point(x) in forward"
        )
    names = _piece_names(model, lists)
    record = _observe(model, example, [named[n] for n in names])
    for name in names:
        if record.nested.get(name):
            raise PlanError(
                f"{name!r} is called inside {record.nested[name]!r}; pieces must follow each "
                "other in the model's forward; mark cuts with Plan.split_points elsewhere"
            )
    uncalled = [n for n in names if not record.calls[n] and n.rpartition(".")[0] in lists]
    if uncalled:
        # its weights would sit on every stage: the split would hold no share of them
        raise PlanError(
            f"the blocks {uncalled[:3]}{' ...' if len(uncalled) > 3 else ''} are never called "
            "themselves: the model's forward loops over what is inside them (a ModuleList of "
            "(norm, layer, residual), as in x-transformers), so no cut can fall before them; "
            "leave Plan.split_points unset to cut between them by tracing the data flow, or "
            "mark cuts with meshsplit.pipeline.split_point(x) in forward"
        )
    order = sorted((n for n in names if record.calls[n]), key=record.first_call.__getitem__)
    return Blocks(
        pieces=tuple(
            Piece(
                name=name,
                module=named[name],
                forward_ms=record.forward_ms[name],
                parameter_bytes=sum(p.numel() * p.element_size() for p in named[name].parameters()),
                crossing_bytes=sum(t.numel() * t.element_size() for t in record.inputs[name]),
                crossing=len(record.inputs[name]),
                placeholders={
                    mode: tuple(made[name]) for mode, made in record.placeholders.items()
                },
            )
            for name in order
        ),
        lists=tuple(lists),
    )


def refuse_layer_drop(model: nn.Module) -> None:
    """A model that skips blocks at random while training (LayerDrop: a module's `layerdrop`
    rate, Hugging Face's and fairseq's spelling) cannot be cut into fixed stages: a stage whose
    first block is skipped would lose what the stage before sent."""
    for name, module in model.named_modules():
        rate = getattr(module, "layerdrop", 0)
        if isinstance(rate, float | int) and not isinstance(rate, bool) and rate > 0:
            raise PlanError(
                f"'{name or type(model).__name__}' drops its blocks at random while training "
                f"(layerdrop={rate}), but the layer split fixes each stage's blocks; set it to "
                "0 (Hugging Face: config.encoder_layerdrop=0.0, config.decoder_layerdrop=0.0, "
                "or config.layerdrop=0.0), or use pp=1"
            )


def has_nested_blocks(model: nn.Module) -> bool:
    """Whether the model keeps a block list below its top level (the block front end's case)."""
    return any(name != "" for name in _block_lists(model, dict(model.named_modules())))


def piece_names(model: nn.Module) -> list[str]:
    """The pieces a run would find, by name, without running: the blocks of the model's block
    lists (the root's children when the root is one) and the parameter holders beside them."""
    return _piece_names(model, _block_lists(model, dict(model.named_modules())))


def sizes_at(pieces: Sequence[Piece], split_points: Sequence[str]) -> tuple[int, ...]:
    """Stage sizes when a stage begins at each named piece (Plan.split_points)."""
    index = {piece.name: k for k, piece in enumerate(pieces)}
    unknown = [name for name in split_points if name not in index]
    if unknown:
        shown = ", ".join(piece.name for piece in pieces[:8])
        raise PlanError(
            f"Plan.split_points names {unknown}, which are not pieces the layer split can cut "
            f"before; use names among: {shown}{', ...' if len(pieces) > 8 else ''}"
        )
    starts = sorted(index[name] for name in split_points)
    if len(set(starts)) != len(starts) or (starts and starts[0] == 0):
        raise PlanError(
            f"Plan.split_points={list(split_points)} must name distinct pieces after the first "
            f"({pieces[0].name!r}), one per stage boundary"
        )
    bounds = [0, *starts, len(pieces)]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def _block_lists(model: nn.Module, named: dict[str, nn.Module]) -> list[str]:
    """Outermost lists of two or more children with parameters (the root counts if it is one;
    a ModuleDict of blocks walked by `.values()`, as torchtitan's models keep theirs, is one)."""
    found: list[str] = []
    for name, module in named.items():
        if not isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            continue
        holders = [c for c in module.children() if any(True for _ in c.parameters())]
        if len(holders) < 2:
            continue
        if any(name.startswith(outer + ".") or outer == "" for outer in found):
            continue
        found.append(name)
    return found


def _piece_names(model: nn.Module, lists: list[str]) -> list[str]:
    """Children of the block lists, and parameter holders beside the paths down to them."""

    def holds(module: nn.Module) -> bool:
        return any(True for _ in module.parameters())

    def visit(path: str, module: nn.Module) -> list[str]:
        children = [(f"{path}.{n}" if path else n, c) for n, c in module.named_children()]
        if path in lists:
            return [child for child, c in children if holds(c)]
        found: list[str] = []
        for child, c in children:
            if not holds(c):
                continue  # no parameters: runs on every stage, between the pieces
            if any(inner == child or inner.startswith(child + ".") for inner in lists):
                found += visit(child, c)
            else:
                found.append(child)
        return found

    return visit("", model)


@dataclass
class _Record:
    calls: dict[str, int]
    first_call: dict[str, int]
    nested: dict[str, str]
    forward_ms: dict[str, float]
    inputs: dict[str, list[torch.Tensor]]
    placeholders: dict[bool, dict[str, list[Placeholder]]]
    """Training or not -> piece -> what its calls returned."""


def _observe(model: nn.Module, example: Any, modules: list[nn.Module]) -> _Record:
    """Run `model` on `example` a few times under hooks; restore buffers and RNG afterwards.

    The first run records the calls (order, count, nesting, inputs, outputs) and warms up;
    the others are timed; one more, in the other mode (evaluating or training), records what
    the pieces return in that mode.
    """
    name_of = {id(m): n for n, m in model.named_modules()}
    record = _Record({name_of[id(m)]: 0 for m in modules}, {}, {}, {}, {}, {})
    timings: dict[str, list[float]] = {name: [0.0] * _REPEATS for name in record.calls}
    active: list[str] = []
    started: dict[str, float] = {}
    example_rows = rows(example)
    sweep = [0]
    first_modes: set[bool] = set()

    def before(module: nn.Module, args: Any, kwargs: Any) -> None:
        name = name_of[id(module)]
        if sweep[0] == 0:
            if active:
                record.nested.setdefault(name, active[-1])
            record.calls[name] += 1
            record.first_call.setdefault(name, len(record.first_call))
            record.inputs.setdefault(name, tensors((args, kwargs)))  # what a cut before sends
        active.append(name)
        started[name] = phases.compute_clock()  # tp collectives' waits left out

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = name_of[id(module)]
        if sweep[0] == 0 or (sweep[0] > _REPEATS and module.training not in first_modes):
            made = record.placeholders.setdefault(module.training, {})
            made.setdefault(name, []).append(_placeholder(output, example_rows))
        else:  # a piece the forward calls several times (a loop) costs all its calls
            timings[name][sweep[0] - 1] += phases.compute_clock() - started[name]
        active.pop()

    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.random.get_rng_state()
    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in modules]
    handles += [m.register_forward_hook(after, with_kwargs=True) for m in modules]
    modes = {module: module.training for module in model.modules()}
    try:
        with torch.no_grad():
            for sweep[0] in range(_REPEATS + 1):
                call_model(model, example)
            first_modes = set(record.placeholders)
            model.train(not model.training)
            sweep[0] = _REPEATS + 1
            call_model(model, example)
    finally:
        for module, mode in modes.items():
            module.training = mode
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for saved, live in zip(buffers, model.buffers(), strict=True):
                live.copy_(saved)
        torch.random.set_rng_state(rng)
    record.forward_ms = {name: 1e3 * min(ts) for name, ts in timings.items()}
    return record


def _placeholder(output: Any, example_rows: int) -> Placeholder:
    leaves, spec = pytree.tree_flatten(output)
    described = tuple(
        TensorLeaf(tuple(leaf.shape), leaf.dtype, leaf.dim() > 0 and len(leaf) == example_rows)
        if isinstance(leaf, torch.Tensor)
        else leaf
        for leaf in leaves
    )
    return Placeholder(spec=spec, leaves=described)
