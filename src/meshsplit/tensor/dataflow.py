"""Column/row pairs found through the model's data flow, from one example input.

Column layers A_1..A_k (q, k, v; or gate, up) that reach the output only through one row layer
B (o; or down) are a Megatron pair: with their features split into the same tp blocks,

    B(x) - b = sum_r  x_r · W_B[:, block r]ᵀ,   x_r = what B sees when each A_j emits block r,

so the split activation is never whole. Forward hooks find and check pairs in one process.
Rationale: docs/internals.md#tensordataflowpy
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshsplit.tensor.conv import CONVOLUTIONS
from meshsplit.tensor.conv1d import is_conv1d
from meshsplit.tensor.heads import divided, head_counts
from meshsplit.tensor.probe import Trace, candidates, copy_of, hooked, outputs, quietly, same
from meshsplit.tensor.shards import local_shard
from meshsplit.tensor.units import NORMS, feature_dim, features

__all__: list[str] = []

Realize = Callable[[nn.Module], AbstractContextManager[None]]
"""layer -> a context in which its weights are real (see `find_pairs`)."""


def as_it_is(_: nn.Module) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Column layers feeding one row layer, checked exact."""

    columns: dict[str, int]
    """Column layer name -> its fused parts (1 unless it is e.g. q|k|v in one weight)."""
    row: str
    per_rank: tuple[tuple[str, int], ...]
    """('module.attribute', divisor): ints divided on every rank (by tp, but for the kv heads
    fewer than tp ranks share)."""
    shared: dict[str, int] = field(default_factory=dict)
    """Column layer name -> its kv heads, where tp ranks share them (grouped-query attention
    with fewer kv heads than tp ranks): the weight stays whole and each rank emits the block
    of the kv head its query heads read."""


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Layers that looked like a pair but cannot split as one."""

    names: tuple[str, ...]
    reason: str
    replicate: bool
    """Keep them all whole (grouped-query attention); otherwise the lone-layer rule applies."""


class _Stop(Exception):
    """Ends a simulated forward once the row layer has its partial sum."""


def _between(columns: list[str], row: str) -> list[str]:
    """Module names from the columns' and row's common ancestor down to each column's parent."""
    paths = [name.split(".")[:-1] for name in [*columns, row]]
    common = 0
    while all(len(p) > common and p[common] == paths[0][common] for p in paths):
        common += 1
    names = {".".join(paths[0][:common])}
    for path in paths[:-1]:
        names.update(".".join(path[:depth]) for depth in range(common + 1, len(path) + 1))
    return sorted(names, key=len)


def _partial(row: nn.Module, x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """B's block `rank` of input features (a convolution's: input channels) applied to x,
    without bias."""
    weight: torch.Tensor = row.weight  # type: ignore[assignment]
    if is_conv1d(row):
        return x @ local_shard(weight, 0, 1, rank, tp)
    if isinstance(row, CONVOLUTIONS):
        return row._conv_forward(x, local_shard(weight, 1, 1, rank, tp), None)
    return F.linear(x, local_shard(weight, 1, 1, rank, tp))


def _column(
    trace: Trace, name: str, parts: int, rank: int, tp: int, shared: int = 0
) -> Callable[[], Any]:
    """Registers a hook making column layer `name` emit only rank `rank`'s block (of its
    `shared` kv heads, where tp ranks share them)."""

    def hook(layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if shared:
            return local_shard(output, output.dim() - 1, 1, rank * shared // tp, shared)
        return local_shard(output, feature_dim(layer, output), parts, rank, tp)

    return lambda: trace.layers[name].register_forward_hook(hook)


@contextmanager
def _as_rank(trace: Trace, pairs: list[Pair], rank: int, tp: int) -> Iterator[None]:
    """`pairs` split as on rank `rank`, each row handing on its whole (all-reduced) output.

    Columns emit their block, the head counts between are divided, and each row's forward
    is replaced by the clean run's output, as the all-reduce after it would give.
    """

    register = [
        _column(trace, n, parts, rank, tp, p.shared.get(n, 0))
        for p in pairs
        for n, parts in p.columns.items()
    ]
    rows = [trace.layers[pair.row] for pair in pairs]
    for pair, row in zip(pairs, rows, strict=True):
        row.forward = lambda *_, whole=trace.outputs[pair.row], **__: copy_of(whole)
    per_rank = tuple(entry for pair in pairs for entry in pair.per_rank)
    try:
        with hooked(register), divided(trace.model, per_rank):
            yield
    finally:
        for row in rows:
            del row.forward


def _simulate_rank(
    trace: Trace, pair: Pair, rank: int, tp: int, accepted: list[Pair]
) -> torch.Tensor:
    """The row layer's partial output on simulated rank `rank`, the accepted pairs split too."""
    found: list[torch.Tensor] = []

    def stop(module: nn.Module, args: tuple[Any, ...]) -> None:
        found.append(_partial(module, args[0], rank, tp))
        raise _Stop

    register = [
        _column(trace, name, parts, rank, tp, pair.shared.get(name, 0))
        for name, parts in pair.columns.items()
    ]
    register.append(lambda: trace.layers[pair.row].register_forward_pre_hook(stop))
    with (
        _as_rank(trace, accepted, rank, tp),
        hooked(register),
        divided(trace.model, pair.per_rank),
        suppress(_Stop),
    ):
        outputs(trace.model, trace.example)
    if not found:
        raise RuntimeError(f"'{pair.row}' did not run in the simulated forward")
    return found[0]


def _leaks(trace: Trace, pairs: list[Pair], tp: int) -> str:
    """Why splitting `pairs` together changes the model's output, or '' when it does not.

    With every row handing on its whole output, the output is the clean one unless a split
    reaches past its pair (a head count read elsewhere, a bias made with local heads).
    """
    try:
        with _as_rank(trace, pairs, 0, tp):
            changed = not same(outputs(trace.model, trace.example), trace.result)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    return "it changes values outside the pair" if changed else ""


def _shaped(
    model: nn.Module, trace: Trace, row: str, columns: list[str], tp: int
) -> Pair | Refusal:
    """The pair if its shapes and head counts divide by tp, or why they do not."""
    names = (*columns, row)
    per_rank, why, shared = head_counts(model, _between(columns, row), tp)
    if why:
        return Refusal(names=names, reason=why, replicate=True)
    n_in = features(trace.layers[row])[0]
    parts, kv = {}, {}
    for name in columns:
        out = features(trace.layers[name])[1]
        if shared and out < n_in and out % shared == 0 and not is_conv1d(trace.layers[name]):
            kv[name] = shared  # a key or value projection: its heads are shared, not split
            parts[name] = 1
            continue
        fused = out > n_in and out % n_in == 0 and not isinstance(trace.layers[name], CONVOLUTIONS)
        parts[name] = out // n_in if fused else 1
        if out % (parts[name] * tp) or n_in % tp:
            why = f"tp={tp} does not divide '{name}' out_features={out} / '{row}' in={n_in}"
            return Refusal(names=names, reason=why, replicate=False)
    if shared and not kv:
        why = f"tp={tp} does not divide the {shared} kv heads, and no key or value layer is found"
        return Refusal(names=names, reason=why, replicate=True)
    return Pair(columns=parts, row=row, per_rank=tuple(per_rank), shared=kv)


def _without_bias(trace: Trace, row: str, realize: Realize) -> torch.Tensor:
    """The row layer's clean output less its bias: what its partial sums must add up to."""
    layer = trace.layers[row]
    with realize(layer):
        bias = getattr(layer, "bias", None)
        output = trace.outputs[row]
        if bias is None:
            return output
        dim = feature_dim(layer, output)  # a convolution's bias is one per channel, dim 1
        return output - bias.reshape(-1, *[1] * (output.dim() - 1 - dim))


def _sums_to(partials: list[torch.Tensor], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.stack(partials).sum(0), expected, rtol=1e-5, atol=1e-6)


def _simulated(
    trace: Trace, pair: Pair, tp: int, accepted: list[Pair], realize: Realize
) -> Pair | Refusal:
    """The pair if its simulated ranks sum to its row's output and splitting it beside the
    `accepted` ones leaves the model's output as it was, or why not."""
    names = (*pair.columns, pair.row)
    expected = _without_bias(trace, pair.row, realize)
    try:
        _sums_to([_simulate_rank(trace, pair, r, tp, accepted) for r in range(tp)], expected)
    except Exception as error:  # any failure of the simulated split refuses the pair
        why = f"split check failed ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
        return Refusal(names=names, reason=why, replicate=False)
    leak = _leaks(trace, [*accepted, pair], tp)
    if leak:
        return Refusal(
            names=names, reason=f"split together with the others: {leak}", replicate=False
        )
    return pair


def _first_failing(trace: Trace, pairs: list[Pair], tp: int, realize: Realize) -> int | None:
    """None if all `pairs` pass at once: each rank simulated with every pair split (tp
    forwards, where one pair at a time takes tp partial ones and a whole one per pair), every
    row's partials summing to its output, and rank 0's model output the clean one. Otherwise
    the first pair that looks at fault: its row not reached or its sum wrong; len(pairs)
    when only the model's output changed (which pair leaks is not known)."""
    partials: dict[str, list[torch.Tensor]] = {pair.row: [] for pair in pairs}

    def record(row: str, rank: int) -> Callable[[], Any]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            partials[row].append(_partial(module, args[0], rank, tp))

        return lambda: trace.layers[row].register_forward_pre_hook(hook)

    leaked = False
    for rank in range(tp):
        register = [record(pair.row, rank) for pair in pairs]
        with suppress(Exception):  # a forward that fails leaves the rows after it unreached
            with _as_rank(trace, pairs, rank, tp), hooked(register):
                output = outputs(trace.model, trace.example)
            leaked = leaked or (rank == 0 and not same(output, trace.result))
    for index, pair in enumerate(pairs):
        if len(partials[pair.row]) != tp:
            return index
        try:
            _sums_to(partials[pair.row], _without_bias(trace, pair.row, realize))
        except Exception:
            return index
    return len(pairs) if leaked else None


def _taken(
    trace: Trace, possible: list[Pair], tp: int, realize: Realize
) -> tuple[list[Pair], list[Refusal]]:
    """The pairs to split and the refused ones. All are simulated at once first: a set that
    passes together is taken whole, which also takes pairs exact only beside each other (T5's
    cross-attentions hand on a position bias made with the first one's head count; one pair
    at a time, both were refused). Otherwise those before the first at fault are taken (their
    sums held with even more split beside them), that one is checked beside the taken ones,
    for its reason, and so on with the rest. A leak that no pair's sum shows, or a taken set
    that leaks at the end, sends every pair to be checked alone."""
    pairs: list[Pair] = []
    refused: list[Refusal] = []
    rest = possible
    together = True  # the accepted pairs passed the leak check as one set
    while rest:
        found = 0  # a lone pair is checked alone
        if len(rest) > 1:
            together_now = pairs + rest
            at_fault = _first_failing(trace, together_now, tp, realize)
            if at_fault is None:
                return together_now, refused
            if at_fault == len(together_now):
                return _alone(trace, possible, tp, realize)
            found = max(0, at_fault - len(pairs))  # one accepted before: check rest[0]
        if found:
            pairs += rest[:found]
            together = False
        checked = _simulated(trace, rest[found], tp, pairs, realize)
        if isinstance(checked, Pair):
            pairs.append(checked)
            together = True
        else:
            refused.append(checked)
        rest = rest[found + 1 :]
    if together or not _leaks(trace, pairs, tp):
        return pairs, refused
    return _alone(trace, possible, tp, realize)


def _alone(
    trace: Trace, possible: list[Pair], tp: int, realize: Realize
) -> tuple[list[Pair], list[Refusal]]:
    """Each pair checked alone, in order, beside those accepted before it."""
    pairs: list[Pair] = []
    refused: list[Refusal] = []
    for pair in possible:
        checked = _simulated(trace, pair, tp, pairs, realize)
        if isinstance(checked, Pair):
            pairs.append(checked)
        else:
            refused.append(checked)
    return pairs, refused


def find_pairs(
    model: nn.Module,
    example: Any,
    layers: Mapping[str, nn.Module],
    tp: int,
    realize: Realize = as_it_is,
) -> tuple[list[Pair], list[Refusal], set[str]]:
    """The exact column/row pairs among `layers` (Linear, Conv1D or a convolution), the
    refused ones, and the layers the example called. A convolution whose output a norm
    takes next (a ResNet's conv -> bn) is looked at only as a row: a whole norm cannot run
    on split channels, so the pair would be refused after forwards that a deep CNN would
    pay at every convolution (`normalised`).

    `realize(layer)` holds a layer's weights while they are read outside its forward (a model
    built in parts keeps them elsewhere). The pairs taken check exact split all together
    (see `_taken`)."""
    with quietly(model):
        trace = Trace(model, example, layers, [m for m in model.modules() if isinstance(m, NORMS)])
        shaped: list[Pair | Refusal] = []
        taken: set[str] = set()
        found = candidates(trace, normalised(trace))
        for row in sorted(found, key=trace.order.index):  # earliest first, no overlaps
            columns = found[row]
            if taken & {*columns, row}:
                continue
            taken.update(columns, [row])
            shaped.append(_shaped(model, trace, row, columns, tp))
        pairs, failed = _taken(trace, [p for p in shaped if isinstance(p, Pair)], tp, realize)
        refused = [r for r in shaped if isinstance(r, Refusal)] + failed
        refused.sort(key=lambda refusal: trace.order.index(refusal.names[-1]))  # by row
        return pairs, refused, set(trace.calls)


def normalised(trace: Trace) -> set[str]:
    """The convolutions among the trace's layers whose output a norm takes next (the trace
    watching the model's norms)."""
    convolutions = {name for name, m in trace.layers.items() if isinstance(m, CONVOLUTIONS)}
    return trace.followed_by(NORMS) & convolutions
