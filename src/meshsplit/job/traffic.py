"""Count what a rank hands to torch.distributed: calls and payload bytes per operation.

Used by `meshsplit compare` (bytes communicated per step) and by tests that check how many
collectives a step makes. It wraps the module-level functions of `torch.distributed` for
the duration of a `with` block, so every caller that looks them up as `dist.<name>` is seen.
`isend`/`irecv` stay unwrapped (`P2POp` checks their identity) and are counted inside
`batch_isend_irecv`.
Payload bytes are the bytes of the tensors this rank contributes (all-reduce: the tensor;
all-gather: this rank's input; broadcast: the tensor; send: the tensor), not wire bytes.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

__all__: list[str] = []


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)):
        return sum(_nbytes(t) for t in tensor)
    return 0


# operation name -> which argument holds the payload this rank contributes
_PAYLOAD: dict[str, Callable[..., int]] = {
    "all_reduce": lambda tensor, *a, **k: _nbytes(tensor),
    "broadcast": lambda tensor, *a, **k: _nbytes(tensor),
    "reduce_scatter_tensor": lambda output, input, *a, **k: _nbytes(input),
    "all_gather_into_tensor": lambda output, input, *a, **k: _nbytes(input),
    "all_gather_single": lambda output, input, *a, **k: _nbytes(input),
    "all_gather": lambda outputs, tensor, *a, **k: _nbytes(tensor),
    "all_to_all_single": lambda output, input, *a, **k: _nbytes(input),
    "send": lambda tensor, *a, **k: _nbytes(tensor),
    "recv": lambda tensor, *a, **k: 0,
    "barrier": lambda *a, **k: 0,
}


@dataclass
class Traffic:
    """Calls and payload bytes per torch.distributed operation, seen on this rank."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def record(self, operation: str, nbytes: int) -> None:
        self.calls[operation] += 1
        self.bytes[operation] += nbytes


class Recorder(Protocol):
    """Hears each operation with its payload bytes (a Traffic, or a caller's own tally)."""

    def record(self, operation: str, nbytes: int) -> None: ...


R = TypeVar("R", bound=Recorder)


@contextmanager
def count_traffic(recorder: R | None = None) -> Iterator[R | Traffic]:
    """Within the block, count every torch.distributed operation this process starts (into
    `recorder` when one is given, else into a fresh Traffic)."""
    traffic: R | Traffic = recorder if recorder is not None else Traffic()
    originals = {name: getattr(dist, name) for name in (*_PAYLOAD, "batch_isend_irecv")}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            traffic.record(name, _PAYLOAD[name](*args, **kwargs))
            return original(*args, **kwargs)

        return wrapper

    def batched(ops: list[Any]) -> Any:
        for op in ops:
            name = getattr(op.op, "__name__", "")
            traffic.record(name, _nbytes(op.tensor) if name == "isend" else 0)
        return originals["batch_isend_irecv"](ops)

    try:
        for name in _PAYLOAD:
            setattr(dist, name, counted(name, originals[name]))
        dist.batch_isend_irecv = batched  # type: ignore[assignment]
        yield traffic
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
