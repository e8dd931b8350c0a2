"""Activation compression: what autograd saves for backward is kept packed, in fewer bytes.

Backward needs every saved activation, but rarely to full precision. While `packing(kind)` is
active, a saved-tensors hook packs each floating activation when it is saved, with one scale
per channel c, and unpacks it when backward reads it:

    bf16:  x̂ = bf16(x)                                   2 bytes/element, |x̂-x| ≤ 2⁻⁸|x|
    int8:  s_c = max|x_c| / 127,  x̂ = s_c·round(x/s_c)    1 byte/element, |x̂-x| ≤ s_c/2
    fp8:   s_c = max|x_c| / 448,  x̂ = s_c·e4m3(x/s_c)     1 byte/element, |x̂-x| ≲ 2⁻⁴|x|

Rationale: docs/internals.md#memorycompresspy
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from meshsplit.memory.tracker import count_saved
from meshsplit.plan import COMPRESSIONS, PlanError

__all__: list[str] = []

MIN_NUMEL = 1024
"""Smaller saved tensors are kept as they are: their scale would cost more than it saves."""

_FP8 = torch.float8_e4m3fn
_LEVELS = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude a packed element holds (int8; float8_e4m3fn's largest finite)."""


@dataclass(eq=False)
class Packed:
    """A saved storage in fewer bytes: codes (and per-channel scales) and how to rebuild it."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    dtype: torch.dtype

    def unpack(self) -> torch.Tensor:
        if self.scale is None:
            return self.codes.to(self.dtype)
        codes = self.codes if self.codes.dtype == torch.int8 else self.codes.float()
        return (codes * self.scale).to(self.dtype)  # int8 promotes to float32 on the way


_Key = tuple[int, int, torch.dtype]


@dataclass(frozen=True)
class View:
    """One saved tensor: a view (shape, stride, offset) of a packed storage."""

    packed: Packed
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def channel_dim(tensor: torch.Tensor) -> int | None:
    """The dim that gets its own scale: 1 for N,C,H,W(,D), else the last; None for 1-D."""
    if tensor.dim() < 2:
        return None
    return 1 if tensor.dim() >= 4 else tensor.dim() - 1


def pack(tensor: torch.Tensor, kind: str) -> Packed:
    """`tensor` (contiguous, floating) packed as `kind` ('bf16', 'int8' or 'fp8')."""
    with torch.no_grad():
        data = tensor.detach()
        if kind == "bf16":
            return Packed(codes=data.to(torch.bfloat16), scale=None, dtype=tensor.dtype)
        channel = channel_dim(data)
        reduce = [d for d in range(data.dim()) if d != channel]
        amax = data.abs().amax(dim=reduce, keepdim=True).to(torch.float32)
        scale = (amax / _LEVELS[kind]).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = data * scale.reciprocal()  # |scaled| <= the largest code, up to rounding
        codes = scaled.round_().to(torch.int8) if kind == "int8" else scaled.to(_FP8)
        return Packed(codes=codes, scale=scale, dtype=tensor.dtype)


class Packer:
    """The pack and unpack hooks of one `packing` block, with its cache of packed storages."""

    def __init__(self, kind: str, modules: tuple[nn.Module, ...]) -> None:
        self.kind = kind
        self.weights = {
            id(t.untyped_storage())
            for module in modules
            for t in (*module.parameters(), *module.buffers())
        }
        """Storages of the modules' parameters and buffers: never packed."""
        self.decisions: dict[str, int] = {"packed": 0, "shared": 0, "kept": 0}
        """How many saved tensors were packed, shared a packed storage, or kept as they are."""
        self._packed: dict[_Key, tuple[weakref.ref[object], weakref.ref[Packed]]] = {}
        """(storage id, version, dtype) -> that storage and its packed copy, while both live."""

    def pack_hook(self, tensor: torch.Tensor) -> torch.Tensor | View:
        if not _plain(tensor):
            return self._keep(tensor)
        storage = tensor.untyped_storage()
        key = (id(storage), tensor._version, tensor.dtype)
        known = self._packed.get(key)
        packed = known[1]() if known is not None and known[0]() is storage else None
        if packed is None:
            if not self._worth_packing(tensor, storage):
                return self._keep(tensor)
            packed = pack(_in_storage_order(tensor), self.kind)
            self._packed[key] = (weakref.ref(storage), weakref.ref(packed))
            self.decisions["packed"] += 1
            count_saved(packed.codes)
            if packed.scale is not None:
                count_saved(packed.scale)
        else:
            self.decisions["shared"] += 1
        return View(
            packed, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
        )

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        self.decisions["kept"] += 1
        count_saved(tensor)
        return tensor

    def _worth_packing(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        base = tensor if tensor._base is None else tensor._base
        return (
            tensor.is_floating_point()
            and tensor.numel() >= MIN_NUMEL
            and id(storage) not in self.weights
            and not isinstance(base, nn.Parameter)
            and not (base.is_leaf and base.requires_grad)
            and _in_storage_order(tensor).is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.numel() * tensor.element_size() == storage.nbytes()
        )

    @staticmethod
    def unpack_hook(saved: torch.Tensor | View) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        whole = saved.packed.unpack()
        return whole.as_strided(saved.shape, saved.stride, saved.offset)


def _in_storage_order(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with its dims permuted by stride, largest first: contiguous when it is a
    transpose of a dense storage (attention's per-head views), so it packs in storage order."""
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    return tensor.permute(order)


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor of its own storage (no subclass such as DTensor, no meta or sparse)."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_meta
    )


@contextmanager
def packing(kind: str, *modules: nn.Module) -> Iterator[Packer | None]:
    """Within the block, tensors saved for backward are packed as `kind` (Plan.compress);
    the parameters and buffers of `modules` never are. 'none' does nothing."""
    if kind not in COMPRESSIONS:
        raise PlanError(f"Plan.compress={kind!r} is unknown; use one of {', '.join(COMPRESSIONS)}")
    if kind == "none":
        yield None
        return
    packer = Packer(kind, modules)
    with saved_tensors_hooks(packer.pack_hook, packer.unpack_hook):
        yield packer
