"""A model each rank builds only its part of: from a factory, or a model on the meta device.

Every rank gets the model on the meta device; a module is given real values only while the
split looks at it (at most the modules on the call stack are real), then the rank materialises
only what it keeps. The values are those of `factory()` run in one process or, with no factory
recorded, what each module's `reset_parameters()` draws from a seed of its own.
Rationale: docs/internals.md#memorylazy_modelpy
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from meshsplit.memory import deferred
from meshsplit.memory.module_state import own_state

__all__: list[str] = []

LENDS_VALUES = "meshsplit_lends_values"
"""Marks the hooks that lend a module its values while it runs (streaming): not a behaviour
of the module's own (the parallel layer that replaces it gets its values another way)."""

ModelSource = nn.Module | Callable[[], nn.Module]
"""What parallelize takes: a model, a model on the meta device, or a zero-argument factory."""


def is_lazy(source: ModelSource) -> bool:
    """Whether the model is built rank by rank (a factory, or parameters on the meta device)."""
    if not isinstance(source, nn.Module):
        return True
    return any(t.is_meta for t in [*source.parameters(), *source.buffers()])


def build(source: ModelSource) -> nn.Module:
    """The model with its tensors on the meta device (a factory is recorded; a meta model's
    modules each get a seed of their own)."""
    if isinstance(source, nn.Module):
        base = int(torch.randint(0, 2**31, (1,), device="cpu").item())  # the shared stream
        for index, module in enumerate(source.modules()):
            _SEEDS[module] = base + index
        return source
    return deferred.record(source)


_SEEDS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
"""A meta model's modules: the seed each one's reset_parameters draws from, every time it
runs, so a module realized twice (the split's data-flow trace runs the model several times),
or first on one rank and later on another, has the same values each time."""


@contextmanager
def realize(module: nn.Module, *, lend_copies: bool = False) -> Iterator[None]:
    """`module`'s own parameters and buffers real while the body runs.

    In place by default: the same tensor objects hold the values (ties and anything that
    knows a parameter by identity see them), and go back to meta after. `lend_copies`: new
    tensor objects on the real values take the module's places instead, and the meta ones
    come back after; whatever still holds the copies (autograd's graph, for a backward to
    come) frees them with itself.
    """
    pending = {name: t for name, t in own_state(module) if t.is_meta}
    if not pending:
        yield
        return
    if not lend_copies:
        with _real_values(module):
            yield
        return
    with _real_values(module):  # moving off meta gives the module new tensor objects
        real = {name: _detached(tensor) for name, tensor in own_state(module) if name in pending}
    _install(module, real)
    try:
        yield
    finally:
        _install(module, pending)


@contextmanager
def realize_tree(module: nn.Module) -> Iterator[None]:
    """`module` and everything below it real while the body runs (in place), meta after:
    one layer being cut into shards, such as an attention block and its projections."""
    with ExitStack() as stack:
        for inner in module.modules():
            stack.enter_context(realize(inner))
        yield


@contextmanager
def _real_values(module: nn.Module) -> Iterator[None]:
    """The module's own meta tensors real, in place, for the body; meta again after."""
    if deferred.is_recorded(module):
        with deferred.borrowed(module):
            yield
        return
    _reset(module)
    try:
        yield
    finally:
        module.to_empty(device="meta", recurse=False)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on the same storage (a Parameter if `tensor` is one)."""
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.detach(), requires_grad=tensor.requires_grad)
    return tensor.detach()


def _install(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if name in module._parameters:
            module._parameters[name] = tensor  # type: ignore[assignment]
        else:
            module._buffers[name] = tensor


def _reset(module: nn.Module, device: torch.device | str = "cpu") -> None:
    """Real storage for an unrecorded meta module's own tensors, drawn by reset_parameters
    from the module's own seed (the caller's random streams are left as they were)."""
    module.to_empty(device=device, recurse=False)
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        return
    seed = _SEEDS.get(module)
    if seed is None:
        with torch.no_grad():
            reset()
        return
    where = torch.device(device)
    cuda = [where.index or 0] if where.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[cuda[0]].manual_seed(seed)
        reset()


@contextmanager
def streaming(model: nn.Module) -> Iterator[None]:
    """Each module real only while its forward runs in the body. With autograd on, the
    module lends copies (realize), so what the graph saved lives as long as the graph."""
    open_: dict[int, list[AbstractContextManager[None]]] = {}

    def before(module: nn.Module, args: Any) -> None:
        context = realize(module, lend_copies=torch.is_grad_enabled())
        context.__enter__()
        open_.setdefault(id(module), []).append(context)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        open_[id(module)].pop().__exit__(None, None, None)

    for hook in (before, after):  # the tp split's probe of a layer's own forward skips these
        setattr(hook, LENDS_VALUES, True)
    holders = [m for m in model.modules() if own_state(m)]
    hooks = [
        handle
        for module in holders
        for handle in (
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, always_call=True),
        )
    ]
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()


def keep(model: nn.Module, names: Iterable[str], device: torch.device) -> None:
    """Materialise, on `device`, the named state of `model` still on meta, and the buffers no
    state dict holds (rotary tables: every stage runs the modules between the pieces)."""
    wanted = set(names) | (dict(model.named_buffers()).keys() - model.state_dict().keys())
    if deferred.is_recorded(model):
        deferred.materialize(model, [n for n in wanted if _is_meta(model, n)], device)
    for prefix, owner in model.named_modules(remove_duplicate=False):
        state = [
            f"{prefix}.{name}" if prefix else name
            for name, tensor in own_state(owner)
            if tensor.is_meta
        ]
        if any(name in wanted for name in state):
            _reset(owner, device)


def _is_meta(model: nn.Module, name: str) -> bool:
    owner_name, _, attr = name.rpartition(".")
    tensor = getattr(model.get_submodule(owner_name), attr)
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


def while_splitting(model: nn.Module, lazy: bool) -> AbstractContextManager[None]:
    """The context the split runs in: streaming for a lazy model, nothing otherwise."""
    return streaming(model) if lazy else nullcontext()
