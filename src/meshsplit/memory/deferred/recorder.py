"""Recording a factory: run it once on the meta device, logging how each tensor gets its values.

`record` runs the user's zero-argument factory under `_Recorder`, a dispatch mode that runs
every op on meta tensors (no data) and logs it into the graph of storages. Each random op
also runs for real on a scratch tensor, after the RNG state it saw is saved, so the RNGs
advance exactly as in a real run and a replay can restore that state.

While the factory runs, its tensors are `_Pending`: meta tensors that report the device a real
run would use: torch.nn.init (trunc_normal_, orthogonal_, ...) skips tensors that say they are
on meta, and Hugging Face skips initialisation when new tensors land there. Once the factory
returns they become plain meta tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from meshsplit.memory.deferred.graph import (
    DeferredInitError,
    Op,
    Ref,
    Storage,
    View,
    leaves,
    op_kind,
    prune,
)
from meshsplit.memory.deferred.replay import (
    RECORDING_ATTR,
    Replay,
    as_kind_of,
    replace_tensor,
    scratch_tensor,
)
from meshsplit.memory.module_state import own_state

_HOME = "_meshsplit_home"  # the device a _Pending tensor reports
_META = torch.device("meta")
# In-place ops that overwrite all of `self` without reading it: a replay may start there.
_OVERWRITES = frozenset(
    ["fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_",
     "exponential_", "cauchy_", "log_normal_", "geometric_"]
)  # fmt: skip
_RECORDERS: list[_Recorder] = []  # the active recording, for _Pending.tolist()/numpy()


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type)  # torch.cuda and the like
    index = backend.current_device() if device.index is None else device.index
    return backend.default_generators[index]


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
        with _disable_current_modes(), Replay() as replay:
            return replay.tensor(_RECORDERS[-1].ref(self)).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        with _disable_current_modes(), Replay() as replay:
            return replay.tensor(_RECORDERS[-1].ref(self)).numpy()


def _relayout(tensor: torch.Tensor, meta: torch.Tensor) -> None:
    """Give the caller's `tensor` the size and strides an in-place op gave `meta` (t_(),
    unsqueeze_(), resize_() and the like)."""
    if not isinstance(tensor, _Pending) or View.of(tensor) == View.of(meta):
        return
    if tensor.untyped_storage()._cdata != meta.untyped_storage()._cdata:
        raise DeferredInitError("record() cannot follow a tensor onto another storage (set_)")
    with torch._C._DisableTorchDispatch():  # metadata only: no data is touched
        tensor.as_strided_(meta.shape, meta.stride(), meta.storage_offset())


class _Recorder(TorchDispatchMode):
    """Records every op and runs it on meta tensors; random ops also run on real scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[int, tuple[Storage, torch.UntypedStorage]] = {}  # by StorageImpl
        self.twins: dict[Storage, torch.UntypedStorage] = {}  # meta stand-ins of constants

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.prim.device.default:
            return getattr(args[0], _HOME)
        named = zip(func._schema.arguments, args, strict=False)  # positional ones, by name
        bound = dict(kwargs or {}, **{arg.name: value for arg, value in named})
        tensors = leaves(bound, torch.Tensor)
        kind = op_kind(func)
        if kind.view and not any(isinstance(t, _Pending) or t.is_meta for t in tensors):
            return func(**bound)  # a view of a real tensor from outside (numpy() makes some)
        op = Op(func, tree_map(self.ref, bound))
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(data): ours to write into
            op.kwargs["self"].storage.owned = True
        if kind.reads:  # the factory looks at values: compute them for real
            with Replay() as replay:
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
        written = [t for name in kind.mutated for t in leaves(bound[name], torch.Tensor)]
        changed = [t for name in kind.mutated for t in leaves(meta[name], torch.Tensor)]
        for tensor, after in zip(written, changed, strict=True):
            _relayout(tensor, after)
        return tree_map(lambda x: self._pending(x, written, device), out)

    def ref(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = self._node(leaf)
        return Ref(storage, len(storage.writes), View.of(leaf))

    def _node(self, tensor: torch.Tensor) -> Storage:
        data = tensor.untyped_storage()
        if data._cdata in self.known:
            return self.known[data._cdata][0]
        storage = Storage(data.device, data.nbytes(), View.of(tensor))
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
            return View.of(leaf).on(leaf.untyped_storage())
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
            return View.of(leaf).on(self.twins[self._node(leaf)])
        return leaf

    def _pending(self, out: Any, written: list[torch.Tensor], device: torch.device) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        for tensor in written:  # in-place and out= ops return the very tensor passed in
            same = tensor.untyped_storage()._cdata == out.untyped_storage()._cdata
            if same and View.of(tensor) == View.of(out):
                return tensor
        return _Pending(out, device)

    def _device(self, op: Op) -> torch.device:
        device = op.kwargs.get("device")
        if isinstance(device, torch.device):
            return device
        refs = sorted(leaves(op.kwargs, Ref), key=lambda ref: ref.view.size == ())
        return refs[0].storage.device if refs else torch.get_default_device()

    def _draw(self, op: Op, device: torch.device, out: Any) -> tuple[torch.Generator, Any]:
        """Advance the RNG exactly as factory() would, by running `op` on real scratch."""
        func, kind = op.func, op_kind(op.func)
        like = kind.name.endswith("_like")  # such an op reads only the shape
        with Replay() as replay:
            kwargs = replay.inputs(op, scratch=op.kwargs if like else kind.mutated)
        outs = leaves(out, torch.Tensor)
        if not kind.mutated and len(outs) == 1 and (variant := kind.out):
            names = {arg.name for arg in variant._schema.arguments}  # `out` has the dtype
            kwargs = {k: v for k, v in kwargs.items() if k in names}
            func, kwargs["out"] = variant, scratch_tensor(View.of(outs[0]), device)  # not the heap
        generator = op.kwargs.get("generator") or _default_generator(device)
        state = generator.get_state()
        with torch.no_grad():
            func(**kwargs)  # the values are dropped at once: only the RNG advance matters
        return generator, state

    def _shaped_by_running(self, op: Op, meta: dict[str, Any]) -> Any:
        with Replay() as replay:
            real = replay.run(op)
        written = [meta[name] for name in op_kind(op.func).mutated]
        if written:
            return written[0] if len(written) == 1 else tuple(written)
        return tree_map(
            lambda x: torch.empty_like(x, device=_META) if isinstance(x, torch.Tensor) else x, real
        )

    def _log_writes(self, op: Op, meta: dict[str, Any]) -> None:
        kind = op_kind(op.func)
        mutated = kind.mutated
        reads = {ref.storage for name, value in op.kwargs.items() if name not in mutated
                 for ref in leaves(value, Ref)}  # fmt: skip
        logged: set[Storage] = set()
        for name in mutated:
            refs, tensors = leaves(op.kwargs[name], Ref), leaves(meta[name], torch.Tensor)
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

    def _adopt(self, op: Op, out: Any, device: torch.device) -> None:
        outputs = leaves(out, torch.Tensor)
        for tensor in outputs:
            data = tensor.untyped_storage()
            new = data._cdata not in self.known  # else a view of a recorded tensor
            storage = Storage(device, data.nbytes(), View.of(tensor), make=op) if new else None
            if storage is not None:
                self.known[data._cdata] = (storage, data)
            op.made.append(storage)
        names = {arg.name for arg in op.func._schema.arguments}
        if not leaves(op.kwargs, Ref) and len(outputs) == 1:  # a factory: pin today's defaults
            for name, value in (("dtype", outputs[0].dtype), ("device", device)):
                if name in names and op.kwargs.get(name) is None:
                    op.kwargs[name] = value


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
    done: dict[int, tuple[torch.Tensor, Ref]] = {}  # _Pending or its stand-in -> both

    def to_meta(pending: torch.Tensor) -> tuple[torch.Tensor, Ref]:
        if id(pending) not in done:
            ref = recorder.ref(pending)
            meta = as_kind_of(pending, View.of(pending).on(pending.untyped_storage()))
            meta = replace_tensor(module, pending, meta, drop={_HOME, "_is_param"})
            done[id(pending)] = done[id(meta)] = (meta, ref)
        return done[id(pending)]

    for owner in module.modules():
        state = [(n, t) for n, t in own_state(owner) if isinstance(t, _Pending) or id(t) in done]
        if state:  # kept on the module: deep copies of a Parameter drop its __dict__
            owner.__dict__[RECORDING_ATTR] = {name: to_meta(tensor)[1] for name, tensor in state}
        for name, value in list(vars(owner).items()):  # plain tensor attributes: meta too
            if isinstance(value, _Pending):
                owner.__dict__[name] = to_meta(value)[0]
    prune([ref for _, ref in done.values()])
    return module
