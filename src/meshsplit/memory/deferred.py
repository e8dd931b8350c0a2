"""Build a model without memory, then give real values to only the part a rank keeps.

A model too big for one process cannot be built whole on every rank only to keep a slice of
it. `record` runs the user's zero-argument factory once with every tensor on the meta device
(no data), logging the ops that create and initialise each tensor; `materialize` replays that
log for the parameters and buffers a rank owns, one module at a time if wanted. Values are
bit-identical to a plain ``factory()``'s from the same RNG state: while recording, each random
op also runs for real on a scratch tensor (so the RNG advances exactly as in a real run) after
the state it saw is saved, and replay restores that state before running the op again. This
is the idea of torchdistx's ``deferred_init``, written afresh.

The recording is a graph over storages. A storage has the op that made it and the ordered log
of in-place/out= ops that wrote into it (through any view); every tensor an op reads is a
`_Ref`: a storage, how many of its writes had happened, and a dtype/size/stride/offset view.
While the factory runs, its tensors are `_Pending`: meta tensors that report the device a real
run would use: torch.nn.init (trunc_normal_, orthogonal_, ...) skips tensors that say they are
on meta, and Hugging Face skips initialisation when new tensors land there. Once the factory
returns they become plain meta tensors.
"""

from __future__ import annotations

import bisect
import functools
import mmap
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils import swap_tensors
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeferredInitError", "borrowed", "is_recorded", "materialize", "record"]

_ATTR = "_meshsplit_deferred"  # on a recorded module: {state name: _Ref} still to do
_HOME = "_meshsplit_home"  # the device a _Pending tensor reports
_META = torch.device("meta")
# In-place ops that overwrite all of `self` without reading it: a replay may start there.
_OVERWRITES = frozenset(
    ["fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_",
     "exponential_", "cauchy_", "log_normal_", "geometric_"]
)  # fmt: skip
_MMAP_BYTES = 1 << 20  # scratch tensors this big get their own mmap
_RECORDERS: list[_Recorder] = []  # the active recording, for _Pending.tolist()/numpy()


class DeferredInitError(RuntimeError):
    """The factory did something that a recording cannot reproduce."""


class _View(NamedTuple):
    """How a tensor sits on its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> _View:
        return _View(t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()))

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        empty = torch.empty(0, dtype=self.dtype, device=storage.device)
        return empty.set_(storage, self.offset, self.size, self.stride)


@dataclass(eq=False)
class _Op:
    """One recorded aten call: every argument by name, tensors replaced by `_Ref`s."""

    func: OpOverload
    kwargs: dict[str, Any]
    rng: tuple[torch.Generator, torch.Tensor] | None = None  # generator, the state it saw
    made: list[_Storage | None] = field(default_factory=list)  # per tensor output: if new


@dataclass(eq=False)
class _Storage:
    """A recorded storage: where factory() would put it, what made it, what wrote into it."""

    device: torch.device
    nbytes: int
    view: _View  # how the output of `make` (or `constant`) sat on it
    make: _Op | None = None
    constant: torch.Tensor | None = None  # a real tensor the factory used
    constant_version: int = 0
    owned: bool = False  # the factory made the constant itself (torch.tensor(data))
    writes: list[_Op | None] = field(default_factory=list)  # None: pruned, nothing needs it
    resets: list[int] = field(default_factory=list)  # writes overwriting every byte unread

    def start(self, version: int) -> int:
        """Index of the last full overwrite before `version` (-1: replay from `make`)."""
        i = bisect.bisect_left(self.resets, version)
        return self.resets[i - 1] if i else -1


@dataclass(frozen=True, eq=False)
class _Ref:
    """A tensor as an op saw it: its storage after `version` writes, seen through `view`."""

    storage: _Storage
    version: int
    view: _View

    def __deepcopy__(self, memo: dict[int, Any]) -> _Ref:
        return self  # recordings never change: a deep-copied model shares its recording


@dataclass
class _Entry:
    data: torch.UntypedStorage
    done: int  # writes applied


def _leaves(tree: Any, kind: type) -> list[Any]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, kind)]


class _Kind(NamedTuple):
    """What an op's schema and tags say about it."""

    name: str
    mutated: tuple[str, ...]  # the arguments it writes to
    random: bool
    view: bool  # returns views of its inputs (lift_fresh aside: data entering the recording)
    reads: bool  # hands tensor values to Python: item(), bool(), equal()
    out: OpOverload | None  # its out= variant


@functools.cache
def _kind(func: OpOverload) -> _Kind:
    args, returns = func._schema.arguments, func._schema.returns
    mutated = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
    random = torch.Tag.nondeterministic_seeded in func.tags or "generator" in [a.name for a in args]
    aliases = [r.alias_info for r in returns]
    view = all(a is not None and not a.is_write for a in aliases) and bool(aliases)
    reads = not mutated and not any("Tensor" in str(r.type) for r in returns)
    overload = func._overloadname
    out = getattr(func.overloadpacket, "out" if overload == "default" else f"{overload}_out", None)
    if out is not None and _kind(out).mutated != ("out",):
        out = None
    name = func.overloadpacket.__name__
    return _Kind(name, mutated, random, view and name != "lift_fresh", reads, out)


def _scratch(view: _View, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor laid out like `view`. A big CPU one gets its own mmap, whose
    pages go back to the OS when it dies: on the heap, small objects allocated meanwhile pin
    the freed pages of one scratch after another, and RSS would grow to the model's size."""
    extent = 1 + sum((n - 1) * s for n, s in zip(view.size, view.stride, strict=True))
    nbytes = extent * view.dtype.itemsize if all(view.size) else 0
    if device.type != "cpu" or nbytes < _MMAP_BYTES:
        return torch.empty_strided(view.size, view.stride, dtype=view.dtype, device=device)
    data = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
    return view._replace(offset=0).on(data)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type)  # torch.cuda and the like
    index = backend.current_device() if device.index is None else device.index
    return backend.default_generators[index]


class _Replay:
    """Recomputes recorded tensors for real, caching storages; restores every RNG it set."""

    def __init__(self) -> None:
        self.cache: dict[_Storage, _Entry] = {}
        self.saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.no_grad = torch.no_grad()

    def __enter__(self) -> _Replay:
        self.no_grad.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for generator, state in self.saved.values():
            generator.set_state(state)
        self.no_grad.__exit__(None, None, None)

    def tensor(self, ref: _Ref) -> torch.Tensor:
        return ref.view.on(self.storage(ref.storage, ref.version))

    def storage(self, storage: _Storage, version: int) -> torch.UntypedStorage:
        entry = self.cache.get(storage)
        if entry is None or entry.done > version:
            fresh = self._create(storage, version)
            if entry is not None:  # the cached one is past `version`: advance a private one
                return self._advance(storage, fresh, version)
            self.cache[storage] = entry = fresh
        return self._advance(storage, entry, version)

    def inputs(
        self, op: _Op, scratch: Iterable[str] = (), own: tuple[_Storage, _Entry] | None = None
    ) -> dict[str, Any]:
        """Real arguments for `op`. Names in `scratch` get uninitialised tensors; written
        tensors are copies (no side effects) unless they are views of `own`, being advanced."""
        blank, mutated = set(scratch), _kind(op.func).mutated

        def real(name: str, ref: _Ref) -> torch.Tensor:
            if name in blank:
                return _scratch(ref.view, ref.storage.device)
            if own is not None and ref.storage is own[0]:
                return ref.view.on(own[1].data)
            return self.tensor(ref).clone() if name in mutated else self.tensor(ref)

        def arg(name: str, value: Any) -> Any:
            return tree_map(lambda x: real(name, x) if isinstance(x, _Ref) else x, value)

        return {name: arg(name, value) for name, value in op.kwargs.items()}

    def run(self, op: _Op, own: tuple[_Storage, _Entry] | None = None) -> Any:
        kwargs = self.inputs(op, own=own)
        if op.rng is not None:
            generator, state = op.rng
            self.saved.setdefault(id(generator), (generator, generator.get_state()))
            generator.set_state(state)
        return op.func(**kwargs)

    def _advance(self, storage: _Storage, entry: _Entry, version: int) -> torch.UntypedStorage:
        entry.done = max(entry.done, storage.start(version))
        while entry.done < version:
            op = storage.writes[entry.done]
            assert op is not None, "a pruned write is needed after all"
            self.run(op, own=(storage, entry))
            entry.done += 1
        return entry.data

    def _create(self, storage: _Storage, version: int) -> _Entry:
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
        outputs = zip(storage.make.made, _leaves(self.run(storage.make), torch.Tensor), strict=True)
        entries = {made: _Entry(_laid_out(out, made), 0) for made, out in outputs if made}
        for made, entry in entries.items():  # the other outputs of the op, for later
            if made is not storage:
                self.cache.setdefault(made, entry)
        return entries[storage]


def _laid_out(tensor: torch.Tensor, storage: _Storage) -> torch.UntypedStorage:
    """`tensor`'s storage, or a copy laid out as recorded if the real kernel chose otherwise."""
    data = tensor.untyped_storage()
    if _View.of(tensor) != storage.view or data.nbytes() != storage.nbytes:
        data = torch.UntypedStorage(storage.nbytes, device=tensor.device)
        storage.view.on(data).copy_(tensor)
    return data


class _Pending(torch.Tensor):
    """While recording, a meta tensor that reports the device factory() would have used, so
    code checking `is_meta` or `.device` acts as in a real run (torch.nn.init skips meta)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device) -> _Pending:
        tensor = torch.Tensor._make_subclass(
            cls, meta, False, dispatch_device=True, device_for_backend_keys=device
        )
        setattr(tensor, _HOME, device)
        return tensor

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.prim.device.default:
            return getattr(args[0], _HOME)
        if not _RECORDERS:
            raise DeferredInitError(f"{func} on a tensor of a recording, outside record()")
        return _RECORDERS[-1].__torch_dispatch__(func, types, args, kwargs)  # modes were off

    def __format__(self, spec: str) -> str:
        return self.item().__format__(spec) if self.dim() == 0 else super().__format__(spec)

    def tolist(self) -> Any:
        with _disable_current_modes(), _Replay() as replay:
            return replay.tensor(_RECORDERS[-1].ref(self)).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        with _disable_current_modes(), _Replay() as replay:
            return replay.tensor(_RECORDERS[-1].ref(self)).numpy()


def _relayout(tensor: torch.Tensor, meta: torch.Tensor) -> None:
    """Give the caller's `tensor` the size and strides an in-place op gave `meta` (t_(),
    unsqueeze_(), resize_() and the like)."""
    if not isinstance(tensor, _Pending) or _View.of(tensor) == _View.of(meta):
        return
    if tensor.untyped_storage()._cdata != meta.untyped_storage()._cdata:
        raise DeferredInitError("record() cannot follow a tensor onto another storage (set_)")
    with torch._C._DisableTorchDispatch():  # metadata only: no data is touched
        tensor.as_strided_(meta.shape, meta.stride(), meta.storage_offset())


class _Recorder(TorchDispatchMode):
    """Records every op and runs it on meta tensors; random ops also run on real scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[int, tuple[_Storage, torch.UntypedStorage]] = {}  # by StorageImpl
        self.twins: dict[_Storage, torch.UntypedStorage] = {}  # meta stand-ins of constants

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.prim.device.default:
            return getattr(args[0], _HOME)
        named = zip(func._schema.arguments, args, strict=False)  # positional ones, by name
        bound = dict(kwargs or {}, **{arg.name: value for arg, value in named})
        tensors = _leaves(bound, torch.Tensor)
        kind = _kind(func)
        if kind.view and not any(isinstance(t, _Pending) or t.is_meta for t in tensors):
            return func(**bound)  # a view of a real tensor from outside (numpy() makes some)
        op = _Op(func, tree_map(self.ref, bound))
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(data): ours to write into
            op.kwargs["self"].storage.owned = True
        if kind.reads:  # the factory looks at values: compute them for real
            with _Replay() as replay:
                return replay.run(op)
        device, meta = self._device(op), tree_map(self._meta, bound)
        try:
            out = func(**meta)
        except (NotImplementedError, RuntimeError):  # no meta kernel, or data-dependent shape
            out = None
        if kind.random:
            op.rng = self._draw(op, device, out)
        if out is None:
            out = self._shaped_by_running(op, meta)
        self._log_writes(op, meta)
        self._adopt(op, out, device)
        written = [t for name in kind.mutated for t in _leaves(bound[name], torch.Tensor)]
        changed = [t for name in kind.mutated for t in _leaves(meta[name], torch.Tensor)]
        for tensor, after in zip(written, changed, strict=True):
            _relayout(tensor, after)
        return tree_map(lambda x: self._pending(x, written, device), out)

    def ref(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = self._node(leaf)
        return _Ref(storage, len(storage.writes), _View.of(leaf))

    def _node(self, tensor: torch.Tensor) -> _Storage:
        data = tensor.untyped_storage()
        if data._cdata in self.known:
            return self.known[data._cdata][0]
        storage = _Storage(data.device, data.nbytes(), _View.of(tensor))
        if data.device != _META:  # a real tensor: a constant, seen through a meta twin
            storage.constant, storage.constant_version = tensor, tensor._version
            self.twins[storage] = twin = torch.UntypedStorage(data.nbytes(), device=_META)
            self.known[twin._cdata] = (storage, twin)
        self.known[data._cdata] = (storage, data)  # a meta one was made before record()
        return storage

    def _meta(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.device):
            return _META
        if isinstance(leaf, _Pending):
            return _View.of(leaf).on(leaf.untyped_storage())
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
            return _View.of(leaf).on(self.twins[self._node(leaf)])
        return leaf

    def _pending(self, out: Any, written: list[torch.Tensor], device: torch.device) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        for tensor in written:  # in-place and out= ops return the very tensor passed in
            same = tensor.untyped_storage()._cdata == out.untyped_storage()._cdata
            if same and _View.of(tensor) == _View.of(out):
                return tensor
        return _Pending(out, device)

    def _device(self, op: _Op) -> torch.device:
        device = op.kwargs.get("device")
        if isinstance(device, torch.device):
            return device
        refs = sorted(_leaves(op.kwargs, _Ref), key=lambda ref: ref.view.size == ())
        return refs[0].storage.device if refs else torch.get_default_device()

    def _draw(self, op: _Op, device: torch.device, out: Any) -> tuple[torch.Generator, Any]:
        """Advance the RNG exactly as factory() would, by running `op` on real scratch."""
        func, kind = op.func, _kind(op.func)
        like = kind.name.endswith("_like")  # such an op reads only the shape
        with _Replay() as replay:
            kwargs = replay.inputs(op, scratch=op.kwargs if like else kind.mutated)
        outs = _leaves(out, torch.Tensor)
        if not kind.mutated and len(outs) == 1 and (variant := kind.out):
            names = {arg.name for arg in variant._schema.arguments}  # `out` has the dtype
            kwargs = {k: v for k, v in kwargs.items() if k in names}
            func, kwargs["out"] = variant, _scratch(_View.of(outs[0]), device)  # not the heap
        generator = op.kwargs.get("generator") or _default_generator(device)
        state = generator.get_state()
        with torch.no_grad():
            func(**kwargs)  # the values are dropped at once: only the RNG advance matters
        return generator, state

    def _shaped_by_running(self, op: _Op, meta: dict[str, Any]) -> Any:
        with _Replay() as replay:
            real = replay.run(op)
        written = [meta[name] for name in _kind(op.func).mutated]
        if written:
            return written[0] if len(written) == 1 else tuple(written)
        return tree_map(
            lambda x: torch.empty_like(x, device=_META) if isinstance(x, torch.Tensor) else x, real
        )

    def _log_writes(self, op: _Op, meta: dict[str, Any]) -> None:
        kind = _kind(op.func)
        mutated = kind.mutated
        reads = {ref.storage for name, value in op.kwargs.items() if name not in mutated
                 for ref in _leaves(value, _Ref)}  # fmt: skip
        logged: set[_Storage] = set()
        for name in mutated:
            refs, tensors = _leaves(op.kwargs[name], _Ref), _leaves(meta[name], torch.Tensor)
            for ref, tensor in zip(refs, tensors, strict=True):
                storage = ref.storage
                if storage in logged:
                    continue
                if storage.constant is not None and not storage.owned:
                    raise DeferredInitError(
                        f"{op.func} writes into a tensor made outside the factory; "
                        "record() cannot reproduce that side effect"
                    )
                whole = tensor.numel() * tensor.element_size() == storage.nbytes
                unread = storage not in reads and kind.name in _OVERWRITES
                if unread and whole and tensor.is_contiguous():
                    storage.resets.append(len(storage.writes))
                storage.writes.append(op)
                logged.add(storage)

    def _adopt(self, op: _Op, out: Any, device: torch.device) -> None:
        outputs = _leaves(out, torch.Tensor)
        for tensor in outputs:
            data = tensor.untyped_storage()
            new = data._cdata not in self.known  # else a view of a recorded tensor
            storage = _Storage(device, data.nbytes(), _View.of(tensor), make=op) if new else None
            if storage is not None:
                self.known[data._cdata] = (storage, data)
            op.made.append(storage)
        names = {arg.name for arg in op.func._schema.arguments}
        if not _leaves(op.kwargs, _Ref) and len(outputs) == 1:  # a factory: pin today's defaults
            for name, value in (("dtype", outputs[0].dtype), ("device", device)):
                if name in names and op.kwargs.get(name) is None:
                    op.kwargs[name] = value


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False)]
    return dict(named + [*module.named_buffers(remove_duplicate=False)])


def _own_state(owner: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*owner._parameters.items(), *owner._buffers.items()]
    return [(name, tensor) for name, tensor in named if tensor is not None]


def _prune(roots: list[_Ref]) -> None:
    """Forget every recorded op (and constant) that no root depends on."""
    needed: dict[_Storage, set[int]] = {}  # write indices to keep, -1 for `make`
    stack = list(roots)
    while stack:
        ref = stack.pop()
        keep = needed.setdefault(ref.storage, set())
        for i in range(ref.storage.start(ref.version), ref.version):
            if i not in keep:
                keep.add(i)
                op = ref.storage.make if i < 0 else ref.storage.writes[i]
                stack.extend(_leaves(op.kwargs, _Ref) if op is not None else [])
    for storage, keep in needed.items():
        storage.writes = [op if i in keep else None for i, op in enumerate(storage.writes)]
        if -1 not in keep:
            storage.make = storage.constant = None


def record(factory: Callable[[], nn.Module]) -> nn.Module:
    """Run `factory()` recording how each parameter and buffer gets its values; return the
    model with all of them on the meta device. The global RNGs end in the state a real
    `factory()` call leaves them in. Raises DeferredInitError for what cannot be deferred
    (writing into tensors made outside the factory, reading raw data). Not thread-safe."""
    recorder = _Recorder()
    _RECORDERS.append(recorder)
    try:
        with recorder:
            module = factory()
    except (RuntimeError, TypeError, NotImplementedError) as error:
        if isinstance(error, DeferredInitError) or not re.search("meta|storage", str(error)):
            raise
        raise DeferredInitError(
            f"the factory needs tensor data that a recording does not have ({error}); "
            "reads through .item(), bool(), .tolist() or .numpy() can be served"
        ) from error
    finally:
        _RECORDERS.remove(recorder)
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory returned {type(module).__name__}, not an nn.Module")
    done: dict[int, tuple[torch.Tensor, _Ref]] = {}  # _Pending or its stand-in -> both

    def to_meta(pending: torch.Tensor) -> tuple[torch.Tensor, _Ref]:
        if id(pending) not in done:
            ref = recorder.ref(pending)
            meta = _like(pending, _View.of(pending).on(pending.untyped_storage()))
            meta = _replace(module, pending, meta, drop={_HOME, "_is_param"})
            done[id(pending)] = done[id(meta)] = (meta, ref)
        return done[id(pending)]

    for owner in module.modules():
        state = [(n, t) for n, t in _own_state(owner) if isinstance(t, _Pending) or id(t) in done]
        if state:  # kept on the module: deep copies of a Parameter drop its __dict__
            owner.__dict__[_ATTR] = {name: to_meta(tensor)[1] for name, tensor in state}
        for name, value in list(vars(owner).items()):  # plain tensor attributes: meta too
            if isinstance(value, _Pending):
                owner.__dict__[name] = to_meta(value)[0]
    _prune([ref for _, ref in done.values()])
    return module


def _recorded(module: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor, _Ref]]:
    """(name relative to `module`, owner, tensor, ref) of each state tensor still to do."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        refs = owner.__dict__.get(_ATTR, {})
        for name, tensor in _own_state(owner):
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
    moved: dict[_Storage, torch.UntypedStorage] = {}  # so tensors sharing storage still do
    with _Replay() as replay:
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
            _replace(module, tensor, _like(tensor, value.to(tensor.dtype)))  # as after .half()
    for owner in module.modules():  # forget what is done, and so the recording it needed
        refs = owner.__dict__.get(_ATTR, {})
        for name in [name for name, tensor in _own_state(owner) if not tensor.is_meta]:
            refs.pop(name, None)


@contextmanager
def borrowed(owner: nn.Module) -> Iterator[None]:
    """Real values for `owner`'s own recorded parameters and buffers (not its children's)
    while the body runs, meta again after it, the recording kept: a module can be run or
    copied from without the rank keeping it."""
    refs = owner.__dict__.get(_ATTR, {})
    pending = [name for name, tensor in _own_state(owner) if name in refs and tensor.is_meta]
    kept = {name: refs[name] for name in pending}
    materialize(owner, pending)
    try:
        yield
    finally:
        for name, tensor in _own_state(owner):
            if name in kept and not tensor.is_meta:
                _replace(owner, tensor, _like(tensor, torch.empty_like(tensor, device=_META)))
        owner.__dict__.setdefault(_ATTR, {}).update(kept)


def _like(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as a tensor of `tensor`'s kind: a Parameter if it is one, same requires_grad."""
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(value, requires_grad=tensor.requires_grad)
    return value.requires_grad_(tensor.requires_grad)


def _replace(
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
            for name in [name for name, tensor in _own_state(owner) if tensor is old]:
                setattr(owner, name, new)
        return new
