"""Replaying a recording: real values for recorded tensors, put into the model's own objects.

`Replay` recomputes a storage from the op that made it and the writes logged into it,
restoring before each random op the RNG state that op saw while recording, so the values are
bit-identical to a plain ``factory()``'s; it restores every generator it set when done.
`materialize` and `borrowed` put those values into a module's parameters and buffers in
place (`replace_tensor`), so ties and anything holding a tensor by identity see them.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import swap_tensors
from torch.utils._pytree import tree_map

from meshsplit.memory.deferred.graph import (
    DeferredInitError,
    Op,
    Ref,
    Storage,
    View,
    leaves,
    op_kind,
)
from meshsplit.memory.module_state import own_state

RECORDING_ATTR = "_meshsplit_deferred"  # on a recorded module: {state name: Ref} still to do
_MMAP_BYTES = 1 << 20  # scratch tensors this big get their own mmap


@dataclass
class _Entry:
    data: torch.UntypedStorage
    done: int  # writes applied


def scratch_tensor(view: View, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor laid out like `view`. A big CPU one gets its own mmap, whose
    pages go back to the OS when it dies: on the heap, small objects allocated meanwhile pin
    the freed pages of one scratch after another, and RSS would grow to the model's size."""
    extent = 1 + sum((n - 1) * s for n, s in zip(view.size, view.stride, strict=True))
    nbytes = extent * view.dtype.itemsize if all(view.size) else 0
    if device.type != "cpu" or nbytes < _MMAP_BYTES:
        return torch.empty_strided(view.size, view.stride, dtype=view.dtype, device=device)
    data = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
    return view._replace(offset=0).on(data)


class Replay:
    """Recomputes recorded tensors for real, caching storages; restores every RNG it set."""

    def __init__(self) -> None:
        self.cache: dict[Storage, _Entry] = {}
        self.saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.no_grad = torch.no_grad()

    def __enter__(self) -> Replay:
        self.no_grad.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for generator, state in self.saved.values():
            generator.set_state(state)
        self.no_grad.__exit__(None, None, None)

    def tensor(self, ref: Ref) -> torch.Tensor:
        return ref.view.on(self.storage(ref.storage, ref.version))

    def storage(self, storage: Storage, version: int) -> torch.UntypedStorage:
        entry = self.cache.get(storage)
        if entry is None or entry.done > version:
            fresh = self._create(storage, version)
            if entry is not None:  # the cached one is past `version`: advance a private one
                return self._advance(storage, fresh, version)
            self.cache[storage] = entry = fresh
        return self._advance(storage, entry, version)

    def inputs(
        self, op: Op, scratch: Iterable[str] = (), own: tuple[Storage, _Entry] | None = None
    ) -> dict[str, Any]:
        """Real arguments for `op`. Names in `scratch` get uninitialised tensors; written
        tensors are copies (no side effects) unless they are views of `own`, being advanced."""
        blank, mutated = set(scratch), op_kind(op.func).mutated

        def real(name: str, ref: Ref) -> torch.Tensor:
            if name in blank:
                return scratch_tensor(ref.view, ref.storage.device)
            if own is not None and ref.storage is own[0]:
                return ref.view.on(own[1].data)
            return self.tensor(ref).clone() if name in mutated else self.tensor(ref)

        def arg(name: str, value: Any) -> Any:
            return tree_map(lambda x: real(name, x) if isinstance(x, Ref) else x, value)

        return {name: arg(name, value) for name, value in op.kwargs.items()}

    def run(self, op: Op, own: tuple[Storage, _Entry] | None = None) -> Any:
        kwargs = self.inputs(op, own=own)
        if op.rng is not None:
            generator, state = op.rng
            self.saved.setdefault(id(generator), (generator, generator.get_state()))
            generator.set_state(state)
        return op.func(**kwargs)

    def _advance(self, storage: Storage, entry: _Entry, version: int) -> torch.UntypedStorage:
        entry.done = max(entry.done, storage.start(version))
        while entry.done < version:
            op = storage.writes[entry.done]
            assert op is not None, "a pruned write is needed after all"
            self.run(op, own=(storage, entry))
            entry.done += 1
        return entry.data

    def _create(self, storage: Storage, version: int) -> _Entry:
        start = storage.start(version)
        if start >= 0:  # write `start` overwrites every byte: what came before does not matter
            return _Entry(torch.UntypedStorage(storage.nbytes, device=storage.device), start)
        if storage.constant is not None:
            if storage.constant._version != storage.constant_version:
                raise DeferredInitError(
                    "a tensor made outside the factory and used by it was modified after "
                    "record(); materialize() needs its value as it was then"
                )
            data = storage.constant.untyped_storage()
            return _Entry(data.clone() if storage.writes else data, 0)
        if storage.make is None:
            raise DeferredInitError("the factory used a meta tensor made before record()")
        outputs = zip(storage.make.made, leaves(self.run(storage.make), torch.Tensor), strict=True)
        entries = {made: _Entry(_laid_out(out, made), 0) for made, out in outputs if made}
        for made, entry in entries.items():  # the other outputs of the op, for later
            if made is not storage:
                self.cache.setdefault(made, entry)
        return entries[storage]


def _laid_out(tensor: torch.Tensor, storage: Storage) -> torch.UntypedStorage:
    """`tensor`'s storage, or a copy laid out as recorded if the real kernel chose otherwise."""
    data = tensor.untyped_storage()
    if View.of(tensor) != storage.view or data.nbytes() != storage.nbytes:
        data = torch.UntypedStorage(storage.nbytes, device=tensor.device)
        storage.view.on(data).copy_(tensor)
    return data


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False)]
    return dict(named + [*module.named_buffers(remove_duplicate=False)])


def _recorded(module: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor, Ref]]:
    """(name relative to `module`, owner, tensor, ref) of each state tensor still to do."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        refs = owner.__dict__.get(RECORDING_ATTR, {})
        for name, tensor in own_state(owner):
            if name in refs and tensor.is_meta:
                yield f"{prefix}.{name}" if prefix else name, owner, tensor, refs[name]


def is_recorded(module: nn.Module) -> bool:
    """Whether `module` holds recorded parameters or buffers still waiting for `materialize`."""
    return next(_recorded(module), None) is not None


def materialize(
    module: nn.Module, names: Iterable[str] | None = None, device: torch.device | str = "cpu"
) -> None:
    """Give real values, in place, to the recorded parameters and buffers of `module` (a model
    from `record` or any submodule of it) named in `names` (relative to `module`, default all),
    bit-identical to `factory()`'s; the caller's RNG states are left untouched. Values are
    computed where `factory()` would have put them, then moved to `device`. Tensor objects are
    kept (their contents swapped), so ties and `requires_grad` survive; distinct tensors that
    share a storage keep sharing it if materialised in the same call."""
    wanted = None if names is None else set(names)
    missing = sorted(wanted - _state(module).keys()) if wanted is not None else []
    if missing:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer {missing}")
    moved: dict[Storage, torch.UntypedStorage] = {}  # so tensors sharing storage still do
    with Replay() as replay:
        for name, _, tensor, ref in list(_recorded(module)):
            if (wanted is not None and name not in wanted) or not tensor.is_meta:
                continue  # not asked for, or done already through a tie
            if ref.storage not in moved:
                data = replay.storage(ref.storage, ref.version)
                flat = torch.empty(0, dtype=torch.uint8, device=data.device).set_(data)
                moved[ref.storage] = flat.to(device).untyped_storage()
            value = ref.view.on(moved[ref.storage])
            if value.shape != tensor.shape:
                raise DeferredInitError(f"{name} changed shape after record()")
            real = as_kind_of(tensor, value.to(tensor.dtype))  # as after .half()
            replace_tensor(module, tensor, real)
    for owner in module.modules():  # forget what is done, and so the recording it needed
        refs = owner.__dict__.get(RECORDING_ATTR, {})
        for name in [name for name, tensor in own_state(owner) if not tensor.is_meta]:
            refs.pop(name, None)


@contextmanager
def borrowed(owner: nn.Module) -> Iterator[None]:
    """Real values for `owner`'s own recorded parameters and buffers (not its children's)
    while the body runs, meta again after it, the recording kept: a module can be run or
    copied from without the rank keeping it."""
    refs = owner.__dict__.get(RECORDING_ATTR, {})
    pending = [name for name, tensor in own_state(owner) if name in refs and tensor.is_meta]
    kept = {name: refs[name] for name in pending}
    materialize(owner, pending)
    try:
        yield
    finally:
        for name, tensor in own_state(owner):
            if name in kept and not tensor.is_meta:
                meta = as_kind_of(tensor, torch.empty_like(tensor, device="meta"))
                replace_tensor(owner, tensor, meta)
        owner.__dict__.setdefault(RECORDING_ATTR, {}).update(kept)


def as_kind_of(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as a tensor of `tensor`'s kind: a Parameter if it is one, same requires_grad."""
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(value, requires_grad=tensor.requires_grad)
    return value.requires_grad_(tensor.requires_grad)


def replace_tensor(
    root: nn.Module, old: torch.Tensor, new: torch.Tensor, drop: Iterable[str] = ()
) -> torch.Tensor:
    """Move `new` into the object `old`, so every reference (ties too) sees it, keeping `old`'s
    attributes but `drop`. Where `old` cannot be swapped (something holds a weak reference to
    it), `new` takes its place in `root`'s modules instead."""
    new.__dict__.update({k: v for k, v in vars(old).items() if k not in set(drop)})
    try:
        swap_tensors(old, new)
        return old
    except RuntimeError:
        for owner in root.modules():
            for name in [name for name, tensor in own_state(owner) if tensor is old]:
                setattr(owner, name, new)
        return new
