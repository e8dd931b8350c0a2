"""Live tensor bytes on one device, by category, counted at the dispatcher as ops allocate.

A `TorchDispatchMode` sees every storage an op creates and a weak reference hears it freed;
what holds a byte says what it is for. Unlike torch's `MemTracker` it needs no module hooks,
which clash with `autograd.grad` and with our stages' own hooks. Peaks are labelled with their
step phase, and a budget is checked at the end of every phase.
Rationale: docs/internals.md#memorytrackerpy
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshsplit import phases

__all__ = ["MemoryBudgetError"]

_active: list[LiveTensors] = []
"""The trackers counting now, innermost last (a step nests in no other, a test may)."""


def count_saved(tensor: torch.Tensor) -> None:
    """Count `tensor` as kept for backward by every active tracker.

    An inner saved-tensors hook (compression, offload) shadows the tracker's own, so it
    calls this for what it keeps instead of the tensor autograd handed it.
    """
    for tracker in _active:
        tracker._see(tensor, "activations")


CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "temporaries")
"""Where a byte goes. parameters: parameters and module buffers (the model's state, and
autocast's low-precision copies of the weights that backward keeps);
buffers: communication buffers (gradient buckets are gradients); temporaries: the rest."""

_RANK = {
    name: i
    for i, name in enumerate(
        ("parameters", "gradients", "optimizer", "buffers", "activations", "temporaries")
    )
}
"""A storage held for two reasons counts once, under the earlier one here: a weight autograd
saves for backward is a parameter, a received activation lives in a receive buffer."""


def _weight_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is autocast's low-precision copy of a parameter, or a view of one (a
    cast straight from a Parameter): the weight in another dtype, held once per step
    whatever the batch."""
    step = tensor.grad_fn
    for _ in range(3):  # a linear saves the copy's transpose
        if step is None or step.name() not in VIEWS or not step.next_functions:
            break
        step = step.next_functions[0][0]
    if step is None or step.name() != "ToCopyBackward0" or not step.next_functions:
        return False
    leaf = getattr(step.next_functions[0][0], "variable", None)
    return isinstance(leaf, nn.Parameter)


VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0"}
"""Backward nodes of the views a layer saves of its weight."""


Holders = dict[str, Callable[[], Iterable[torch.Tensor]]]
"""category -> the tensors that category holds now (re-read at every phase end)."""


class MemoryBudgetError(RuntimeError):
    """A rank's live tensor bytes went past Plan.memory_budget during a step."""


@dataclass
class Sample:
    """Live bytes per category after one allocation or free (for pictures of a step)."""

    event: int
    phase: str
    bytes_by_category: tuple[int, ...]


@dataclass
class Peak:
    bytes: int = 0
    phase: str = "idle"
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))


class _Storage:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, nbytes: int, category: str, ref: weakref.ref[Any]) -> None:
        self.nbytes, self.category, self.ref = nbytes, category, ref


class LiveTensors(TorchDispatchMode):
    """Count live tensor storages on `device` while active (use as a context manager).

    Tensors that exist on entry are counted if a holder names them; `budget` (bytes) raises
    MemoryBudgetError at the end of the first phase whose peak exceeded it.
    """

    def __init__(
        self,
        device: torch.device,
        holders: Holders,
        *,
        budget: int | None = None,
        where: str = "",
        timeline: bool = False,
    ) -> None:
        super().__init__()
        self.device = device
        self._on_cpu = device.type == "cpu"
        self.holders = holders
        self.budget = budget
        self.where = where
        """Who this is, for messages (e.g. 'rank 3, step 2')."""
        self.peak = Peak()
        self.samples: list[Sample] | None = [] if timeline else None
        self._live: dict[int, _Storage] = {}
        self._totals = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._events = 0
        self._phase_peak = 0
        self._phase_peak_breakdown: dict[str, int] = {}
        self._contexts: list[Any] = []
        self._lock = threading.RLock()
        """Storages may die on another thread (a collective's worker dropping the last
        reference), so the counts change under a lock."""

    # -- entering and leaving ---------------------------------------------------------

    def __enter__(self) -> LiveTensors:
        samples, self.samples = self.samples, None  # what is held on entry: one sample
        self._classify_holders()
        self.samples = samples
        self._phase_peak = self._total
        self._note_peak()
        saved = saved_tensors_hooks(self._pack, _unpack)
        listening = phases.listening(self._phase_ended)
        saved.__enter__()
        listening.__enter__()
        self._contexts = [listening, saved]
        super().__enter__()
        _active.append(self)
        self._contexts.insert(0, _following_fsdp_storage(self._resized))
        self._contexts[0].__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        super().__exit__(*exc)
        for context in self._contexts:
            context.__exit__(*exc)
        self._contexts = []
        with self._lock:  # the weak references call back into this tracker: let them go
            self._live.clear()

    @property
    def live_bytes(self) -> int:
        return self._total

    def breakdown(self) -> dict[str, int]:
        return dict(self._totals)

    # -- counting -----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no tree to walk
            self._see(out, "temporaries")
            return out
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._see(value, "temporaries")
        return out

    def _see(self, tensor: torch.Tensor, category: str) -> None:
        if isinstance(tensor, DTensor):  # a wrapper: what this rank holds is its shard
            tensor = tensor._local_tensor
        if not (tensor.is_cpu if self._on_cpu else tensor.device == self.device):
            return  # (a meta tensor is on no device)
        if tensor.layout != torch.strided:
            return
        with self._lock:
            self._count(tensor.untyped_storage(), category)

    def _count(self, storage: torch.UntypedStorage, category: str) -> None:
        key = id(storage)
        known = self._live.get(key)
        if known is not None and known.ref() is storage:
            if _RANK[category] < _RANK[known.category]:
                self._move(known, category)
            return
        if storage.filename is not None:  # mapped from a file (memory/offload.py): page cache
            return
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, functools.partial(self._freed, key))
        self._live[key] = _Storage(nbytes, category, ref)
        self._totals[category] += nbytes
        self._total += nbytes
        self._note_peak()

    def _resized(self, tensor: torch.Tensor) -> None:
        """FSDP2 frees and refills a gathered parameter by resizing its storage in place,
        which no op or weak reference reports: follow the new size (it is a parameter)."""
        if tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        with self._lock:
            known = self._live.get(id(storage))
            if known is None or known.ref() is not storage:
                self._count(storage, "parameters")
                return
            if known.category != "parameters":
                self._move(known, "parameters")
            change = storage.nbytes() - known.nbytes
            known.nbytes += change
            self._totals["parameters"] += change
            self._total += change
            self._note_peak()

    def _move(self, storage: _Storage, category: str) -> None:
        self._totals[storage.category] -= storage.nbytes
        self._totals[category] += storage.nbytes
        storage.category = category

    def _freed(self, key: int, _: object = None) -> None:
        with self._lock:
            storage = self._live.pop(key, None)
            if storage is not None:
                self._totals[storage.category] -= storage.nbytes
                self._total -= storage.nbytes
                self._sample()

    def _note_peak(self) -> None:
        self._sample()
        if self._total > self._phase_peak:
            self._phase_peak = self._total
            self._phase_peak_breakdown = dict(self._totals)
        if self._total > self.peak.bytes:
            self.peak = Peak(
                bytes=self._total, phase=phases.current(), breakdown=dict(self._totals)
            )

    def _sample(self) -> None:
        self._events += 1
        if self.samples is not None:
            totals = tuple(self._totals[c] for c in CATEGORIES)
            self.samples.append(Sample(self._events, phases.current(), totals))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor saved for backward; keep an alias of it, not the tensor itself: a
        node saving its own output would otherwise hold it in a cycle (output -> node ->
        output) that only a backward without retain_graph breaks, and zero bubble's W runs
        with it (split_backward.py)."""
        self._see(tensor, "parameters" if _weight_copy(tensor) else "activations")
        return tensor.detach()

    def _classify_holders(self) -> None:
        for category, tensors in self.holders.items():
            for tensor in tensors():
                self._see(tensor, category)

    def _phase_ended(self, name: str) -> None:
        self._classify_holders()
        if self.budget is not None and self._phase_peak > self.budget:
            raise MemoryBudgetError(
                f"{self.where}: {name} held {format_bytes(self._phase_peak)} of live tensors, "
                f"over Plan.memory_budget={format_bytes(self.budget)} "
                f"({describe_breakdown(self._phase_peak_breakdown)}); see "
                "ms.estimate_memory for a plan that fits, e.g. recompute='auto'"
            )
        self._phase_peak = self._total


@contextmanager
def _following_fsdp_storage(resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `resized(tensor)` after each of FSDP2's in-place storage frees and refills."""
    original = (_fsdp_param.alloc_storage, _fsdp_param.free_storage)

    def wrap(function: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def resize(tensor: torch.Tensor) -> None:
            function(tensor)
            resized(tensor)

        return resize

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = map(wrap, original)  # type: ignore[assignment]
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = original


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe_breakdown(breakdown: dict[str, int]) -> str:
    """'parameters 1.2 MiB, activations 3.4 MiB, ...' for the categories that hold anything."""
    return ", ".join(f"{c} {format_bytes(n)}" for c, n in breakdown.items() if n)
