"""Column/row pairs found through the model's data flow, from one example input.

Column layers A_1..A_k (q, k, v; or gate, up) that reach the output only through one row layer
B (o; or down) are a Megatron pair: with their features split into the same tp blocks,

    B(x) - b = sum_r  x_r · W_B[:, block r]ᵀ,   x_r = what B sees when each A_j emits block r,

so the split activation is never whole. Forward hooks find and check pairs in one process.
Rationale: docs/internals.md#tensordataflowpy
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshsplit.batch import call_model, tensors
from meshsplit.tensor.conv1d import is_conv1d
from meshsplit.tensor.shards import local_shard
from meshsplit.tensor.units import features

__all__: list[str] = []

Realize = Callable[[nn.Module], AbstractContextManager[None]]
"""layer -> a context in which its weights are real (see `find_pairs`)."""


def as_it_is(_: nn.Module) -> AbstractContextManager[None]:
    return nullcontext()


HEAD_ATTRIBUTES = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "split_size",
    "all_head_size",
)
"""Per-rank ints an attention reads in forward: a rank holds 1/tp of each."""
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Column layers feeding one row layer, checked exact."""

    columns: dict[str, int]
    """Column layer name -> its fused parts (1 unless it is e.g. q|k|v in one weight)."""
    row: str
    per_rank: tuple[str, ...]
    """'module.attribute' ints divided by tp on every rank."""


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Layers that looked like a pair but cannot split as one."""

    names: tuple[str, ...]
    reason: str
    replicate: bool
    """Keep them all whole (grouped-query attention); otherwise the lone-layer rule applies."""


class _Stop(Exception):
    """Ends a simulated forward once the row layer has its partial sum."""


@contextmanager
def hooked(register: list[Callable[[], Any]]) -> Iterator[None]:
    """The hooks `register` makes, in place while the body runs."""
    handles = [make() for make in register]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    return tensors(call_model(model, example))


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(map(torch.equal, first, second))


def _copy(value: Any) -> Any:
    """A tensor's detached copy (other values as they are)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def noise_added(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the output with noise of its own size added (the same every time)."""
    noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(0))
    return output + noise.to(output) * (output.abs().mean() + 1)


@contextmanager
def quietly(model: nn.Module) -> Iterator[None]:
    """Forwards to look at, not to train: eval mode (no dropout) and no autograd, the
    model's mode as it was after. torch's fused transformer inference path is off: it runs
    only in a layer with no hooks on it, so a forward hooked in one place and one hooked in
    another would differ in their last bits, and no pair would pass the comparison."""
    training = model.training
    fastpath = torch.backends.mha.get_fastpath_enabled()
    model.eval()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        model.train(training)


class _Trace:
    """One clean forward: every candidate's input, output and call count, in call order."""

    def __init__(self, model: nn.Module, example: Any, layers: Mapping[str, nn.Module]) -> None:
        self.model, self.example, self.layers = model, example, layers
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.calls: Counter[str] = Counter()
        with hooked([self._recorder(name, m) for name, m in layers.items()]):
            self.result = _outputs(model, example)
        self.order = list(self.inputs)

    def _recorder(self, name: str, module: nn.Module) -> Callable[[], Any]:
        def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            self.calls[name] += 1
            if name not in self.outputs:  # copies: the model may add to them in place after
                self.inputs[name] = _copy(args[0])  # (Falcon: mlp_output += attention_output)
                self.outputs[name] = _copy(output)

        return lambda: module.register_forward_hook(hook)

    def inputs_after_perturbing(self, name: str) -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}

        def record(other: str) -> Callable[[], Any]:
            def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
                seen.setdefault(other, args[0])

            return lambda: self.layers[other].register_forward_pre_hook(hook)

        register = [lambda: self.layers[name].register_forward_hook(noise_added)]
        with hooked(register + [record(other) for other in self.layers]):
            _outputs(self.model, self.example)
        return seen

    def only_path(self, name: str, through: str) -> bool:
        """Restoring `through`'s input removes every change that perturbing `name` made."""

        def perturb(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            return output + 1

        def restore(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (self.inputs[through], *args[1:])

        with hooked(
            [
                lambda: self.layers[name].register_forward_hook(perturb),
                lambda: self.layers[through].register_forward_pre_hook(restore),
            ]
        ):
            return same(_outputs(self.model, self.example), self.result)


def candidates(trace: _Trace) -> dict[str, list[str]]:
    """Row layer -> the column layers whose only way to the output is through it."""
    groups: dict[str, list[str]] = {}
    for name in trace.order:
        if trace.calls[name] != 1:
            continue
        changed = trace.inputs_after_perturbing(name)
        later = trace.order[trace.order.index(name) + 1 :]
        first = next(
            (b for b in later if b in changed and not torch.equal(changed[b], trace.inputs[b])),
            None,
        )
        if first is not None and trace.calls[first] == 1 and trace.only_path(name, first):
            groups.setdefault(first, []).append(name)
    return groups


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


def head_counts(model: nn.Module, modules: list[str], tp: int) -> tuple[list[str], str]:
    """The per-rank ints to divide, and why a split by heads is impossible ('' when it is not).

    An attention module (one with a head count or `head_dim`) whose config's head or kv-head
    count tp does not divide cannot split (grouped-query attention with few kv heads).
    """
    per_rank: list[str] = []
    for name in modules:
        module = model.get_submodule(name)
        config = getattr(module, "config", None)
        attention = any(hasattr(module, a) for a in (*HEAD_ATTRIBUTES, "head_dim"))
        for attr in (*KV_HEADS, "num_attention_heads"):
            value = getattr(config, attr, None)
            if attention and isinstance(value, int) and value % tp:
                return [], f"tp={tp} does not divide {attr}={value} of '{name}'"
        for attr in HEAD_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    return [], f"tp={tp} does not divide {attr}={value} of '{name}'"
                per_rank.append(f"{name}.{attr}" if name else attr)
    return per_rank, ""


@contextmanager
def divided(model: nn.Module, per_rank: tuple[str, ...], tp: int) -> Iterator[None]:
    """The `per_rank` ints divided by tp for the duration."""
    saved = []
    for path in per_rank:
        owner, _, attr = path.rpartition(".")
        module = model.get_submodule(owner)
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, getattr(module, attr) // tp)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _partial(row: nn.Module, x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """B's block `rank` of input features applied to x, without bias."""
    weight: torch.Tensor = row.weight  # type: ignore[assignment]
    if is_conv1d(row):
        return x @ local_shard(weight, 0, 1, rank, tp)
    return F.linear(x, local_shard(weight, 1, 1, rank, tp))


def _column(trace: _Trace, name: str, parts: int, rank: int, tp: int) -> Callable[[], Any]:
    """Registers a hook making column layer `name` emit only rank `rank`'s block."""

    def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return local_shard(output, output.dim() - 1, parts, rank, tp)

    return lambda: trace.layers[name].register_forward_hook(hook)


@contextmanager
def _as_rank(trace: _Trace, pairs: list[Pair], rank: int, tp: int) -> Iterator[None]:
    """`pairs` split as on rank `rank`, each row handing on its whole (all-reduced) output.

    Columns emit their block, the head counts between are divided, and each row's forward
    is replaced by the clean run's output, as the all-reduce after it would give.
    """

    register = [_column(trace, n, parts, rank, tp) for p in pairs for n, parts in p.columns.items()]
    rows = [trace.layers[pair.row] for pair in pairs]
    for pair, row in zip(pairs, rows, strict=True):
        row.forward = lambda *_, whole=trace.outputs[pair.row], **__: _copy(whole)
    per_rank = tuple(path for pair in pairs for path in pair.per_rank)
    try:
        with hooked(register), divided(trace.model, per_rank, tp):
            yield
    finally:
        for row in rows:
            del row.forward


def _simulate_rank(
    trace: _Trace, pair: Pair, rank: int, tp: int, accepted: list[Pair]
) -> torch.Tensor:
    """The row layer's partial output on simulated rank `rank`, the accepted pairs split too."""
    found: list[torch.Tensor] = []

    def stop(module: nn.Module, args: tuple[Any, ...]) -> None:
        found.append(_partial(module, args[0], rank, tp))
        raise _Stop

    register = [_column(trace, name, parts, rank, tp) for name, parts in pair.columns.items()]
    register.append(lambda: trace.layers[pair.row].register_forward_pre_hook(stop))
    with (
        _as_rank(trace, accepted, rank, tp),
        hooked(register),
        divided(trace.model, pair.per_rank, tp),
        suppress(_Stop),
    ):
        _outputs(trace.model, trace.example)
    if not found:
        raise RuntimeError(f"'{pair.row}' did not run in the simulated forward")
    return found[0]


def _leaks(trace: _Trace, pairs: list[Pair], tp: int) -> str:
    """Why splitting `pairs` together changes the model's output, or '' when it does not.

    With every row handing on its whole output, the output is the clean one unless a split
    reaches past its pair (a head count read elsewhere, a bias made with local heads).
    """
    try:
        with _as_rank(trace, pairs, 0, tp):
            changed = not same(_outputs(trace.model, trace.example), trace.result)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    return "it changes values outside the pair" if changed else ""


def _check(
    model: nn.Module,
    trace: _Trace,
    row: str,
    columns: list[str],
    tp: int,
    accepted: list[Pair],
    realize: Realize,
) -> Pair | Refusal:
    """The validated pair, or why it is not one."""
    names = (*columns, row)
    n_in = features(trace.layers[row])[0]
    parts = {}
    for name in columns:
        out = features(trace.layers[name])[1]
        parts[name] = out // n_in if out > n_in and out % n_in == 0 else 1
        if out % (parts[name] * tp) or n_in % tp:
            why = f"tp={tp} does not divide '{name}' out_features={out} / '{row}' in={n_in}"
            return Refusal(names=names, reason=why, replicate=False)
    per_rank, why = head_counts(model, _between(columns, row), tp)
    if why:
        return Refusal(names=names, reason=why, replicate=True)
    pair = Pair(columns=parts, row=row, per_rank=tuple(per_rank))
    with realize(trace.layers[row]):
        bias = getattr(trace.layers[row], "bias", None)
        expected = trace.outputs[row] - (0 if bias is None else bias)
    try:
        partials = [_simulate_rank(trace, pair, r, tp, accepted) for r in range(tp)]
        torch.testing.assert_close(torch.stack(partials).sum(0), expected, rtol=1e-5, atol=1e-6)
    except Exception as error:  # any failure of the simulated split refuses the pair
        why = f"split check failed ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
        return Refusal(names=names, reason=why, replicate=False)
    leak = _leaks(trace, [*accepted, pair], tp)
    if leak:
        return Refusal(
            names=names, reason=f"split together with the others: {leak}", replicate=False
        )
    return pair


def find_pairs(
    model: nn.Module,
    example: Any,
    layers: Mapping[str, nn.Module],
    tp: int,
    realize: Realize = as_it_is,
) -> tuple[list[Pair], list[Refusal], set[str]]:
    """The exact column/row pairs among `layers` (Linear or Conv1D), the refused ones, and
    the layers the example called.

    `realize(layer)` holds a layer's weights while they are read outside its forward (a model
    built in parts keeps them elsewhere)."""
    with quietly(model):
        trace = _Trace(model, example, layers)
        pairs: list[Pair] = []
        refused: list[Refusal] = []
        taken: set[str] = set()
        found = candidates(trace)
        for row in sorted(found, key=trace.order.index):  # earliest first, no overlaps
            columns = found[row]
            if taken & {*columns, row}:
                continue
            taken.update(columns, [row])
            checked = _check(model, trace, row, columns, tp, pairs, realize)
            if isinstance(checked, Pair):
                pairs.append(checked)
            else:
                refused.append(checked)
        return pairs, refused, set(trace.calls)
