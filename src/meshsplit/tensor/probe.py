"""A model's data flow probed with forward hooks, from one example input: one clean forward
recorded layer by layer, and forwards with one layer's output perturbed to see what it reaches.
The operator split's searches (pairs, layers inside a pair, experts) stand on these.
Rationale: docs/internals.md#tensordataflowpy
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshsplit.batch import call_model, tensors

__all__: list[str] = []


@contextmanager
def hooked(register: list[Callable[[], Any]]) -> Iterator[None]:
    """The hooks `register` makes, in place while the body runs."""
    handles = [make() for make in register]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def outputs(model: nn.Module, example: Any) -> list[torch.Tensor]:
    """The tensors of the model's output for `example`, flattened."""
    return tensors(call_model(model, example))


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(map(torch.equal, first, second))


def copy_of(value: Any) -> Any:
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


class Trace:
    """One clean forward: every candidate's input, output and call count, in call order, and
    which of the `watched` modules ran next after each candidate's calls."""

    def __init__(
        self,
        model: nn.Module,
        example: Any,
        layers: Mapping[str, nn.Module],
        watched: Collection[nn.Module] = (),
    ) -> None:
        self.model, self.example, self.layers = model, example, layers
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.calls: Counter[str] = Counter()
        self.sequence: list[nn.Module] = []
        """The layers' and the watched modules' calls, in the order they ended."""
        watchers = [self._watcher(m) for m in watched]
        with hooked([self._recorder(name, m) for name, m in layers.items()] + watchers):
            self.result = outputs(model, example)
        self.order = list(self.inputs)

    def followed_by(self, kinds: tuple[type[nn.Module], ...]) -> set[str]:
        """The layers whose call a watched module of one of `kinds` followed next."""
        names = {id(m): name for name, m in self.layers.items()}
        return {
            names[id(call)]
            for call, after in zip(self.sequence, self.sequence[1:], strict=False)
            if id(call) in names and isinstance(after, kinds)
        }

    def _watcher(self, module: nn.Module) -> Callable[[], Any]:
        def hook(*_: Any) -> None:
            self.sequence.append(module)

        return lambda: module.register_forward_hook(hook)

    def _recorder(self, name: str, module: nn.Module) -> Callable[[], Any]:
        def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            self.sequence.append(module)
            self.calls[name] += 1
            if name not in self.outputs:  # copies: the model may add to them in place after
                self.inputs[name] = copy_of(args[0])  # (Falcon: mlp_output += attention_output)
                self.outputs[name] = copy_of(output)

        return lambda: module.register_forward_hook(hook)

    def only_way_out(self, name: str) -> str | None:
        """The layer through which alone `name` reaches the output, or None: perturb
        `name`'s output, restore the input of the first later layer it changes, and see
        whether the model's output is then the clean one (one forward for both questions)."""
        later = set(self.order[self.order.index(name) + 1 :])
        first: list[str] = []

        def restore_first(other: str) -> Callable[[], Any]:
            def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
                if first or other not in later:
                    return None
                later.discard(other)  # its first call only, as the clean run recorded
                clean = self.inputs[other]
                if torch.equal(args[0], clean):
                    return None
                first.append(other)
                return (clean, *args[1:])

            return lambda: self.layers[other].register_forward_pre_hook(hook)

        register = [lambda: self.layers[name].register_forward_hook(noise_added)]
        with hooked(register + [restore_first(other) for other in later]):
            output = outputs(self.model, self.example)
        if not first or self.calls[first[0]] != 1 or not same(output, self.result):
            return None
        return first[0]


def candidates(trace: Trace, rows_only: Collection[str] = ()) -> dict[str, list[str]]:
    """Row layer -> the column layers whose only way to the output is through it (no layer
    of `rows_only` is looked at as a column)."""
    groups: dict[str, list[str]] = {}
    for name in trace.order:
        if trace.calls[name] != 1 or name in rows_only:
            continue
        row = trace.only_way_out(name)
        if row is not None:
            groups.setdefault(row, []).append(name)
    return groups
