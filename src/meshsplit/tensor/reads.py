"""Which layers have a weight read where no module holding it runs: a split is only right
for a layer that uses its weights through its own forward. nn.MultiheadAttention hands
`out_proj.weight` to a function without calling `out_proj`; a model may add `pos.weight[:T]`
to its input or read a relative-position table whole (DeBERTa, SEW-D); under a split each
would read a shard as if it were the whole tensor, failing or, worse, training on the wrong
rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshsplit.batch import call_model

__all__: list[str] = []

_METADATA = frozenset(
    {"size", "dim", "numel", "stride", "is_contiguous", "element_size", "is_floating_point",
     "is_complex", "data_ptr", "untyped_storage", "__len__", "__hash__", "requires_grad_",
     "get_device"}
)  # fmt: skip
"""Reads of a tensor's shape or kind, not its values: a model may ask them of any weight
(`x.to(self.fc.weight.dtype)`)."""

_TEMPLATES = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
     "new_zeros", "new_ones", "new_empty", "new_full"}
)  # fmt: skip
"""Ops that take a tensor's shape, dtype and device only, whichever argument it is."""

_NOT_READS = _METADATA | _TEMPLATES
"""Ops that read no value of any argument, asked once per op of the watched forward."""

_CONVERSIONS = frozenset({"to", "type_as", "expand_as", "view_as", "reshape_as"})
"""Ops that read the values of their first argument only (`x.to(w)` takes w's dtype,
`x.expand_as(w)` its shape)."""

_VALUE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
"""Properties that hand on a tensor's values (`h @ emb.weight.T`, `pos.weight.data[:T]`);
every other property (shape, dtype, device, grad_fn...) describes it."""


def outside_reads(model: nn.Module, example: Any, layers: Mapping[str, nn.Module]) -> set[str]:
    """One forward of `example` (no grad, eval mode): the names of `layers` whose parameter
    some op read while neither a module holding that parameter itself nor the layer holding
    it was running (nn.MultiheadAttention's forward reads its out_proj's weight: inside the
    layer, which splits as a whole)."""
    owners: dict[int, list[str]] = {}
    for name, layer in layers.items():
        for param in layer.parameters():
            owners.setdefault(id(param), []).append(name)
    layer_names = {id(layer): name for name, layer in layers.items()}
    running: list[nn.Module] = []
    outside: set[str] = set()

    def enter(module: nn.Module, _: Any) -> None:
        running.append(module)

    def leave(module: nn.Module, _: Any, __: Any) -> None:
        if running and running[-1] is module:
            running.pop()

    def read(values: Any) -> None:
        for value in values:
            known = isinstance(value, nn.Parameter) and id(value) in owners
            if known and not any(
                _holds(m, value) or layer_names.get(id(m)) in owners[id(value)] for m in running
            ):
                outside.update(owners[id(value)])

    training = model.training
    model.eval()
    try:
        with _hooks(model, enter, leave), _Reads(read), torch.no_grad():
            call_model(model, example)
    except Exception:  # noqa: BLE001 - a forward the watch breaks (a torch.compile'd module
        return set()  # traces the hooks) is left unwatched, as before this check existed
    finally:
        model.train(training)
    return outside


def _holds(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether `module` holds `param` itself now (a model built in parts puts a layer's
    weights in place only while it runs)."""
    return any(p is param for p in module._parameters.values())


@contextmanager
def _hooks(
    model: nn.Module, enter: Callable[..., None], leave: Callable[..., None]
) -> Iterator[None]:
    handles = []
    for module in model.modules():
        # first in, last out: a module's own hooks (a model built in parts puts its
        # weights in place in one) count as the module running
        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Reads(TorchFunctionMode):
    """Hands every op's tensor arguments (not shape or dtype queries) to `seen`."""

    def __init__(self, seen: Callable[[Any], None]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            if getattr(getattr(func, "__self__", None), "__name__", "") in _VALUE_PROPERTIES:
                self.seen(args[:1])
        elif name in _CONVERSIONS:
            self.seen(args[:1])
        elif name not in _NOT_READS:
            self.seen([*_flat(args), *_flat(kwargs.values())])
        return func(*args, **kwargs)


def _flat(values: Any) -> Iterator[Any]:
    for value in values:
        if isinstance(value, list | tuple):
            yield from _flat(value)
        else:
            yield value
