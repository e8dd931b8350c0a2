"""Count what a rank hands to torch.distributed: calls and payload bytes per operation.

Used by `meshsplit compare` (bytes communicated per step) and by tests that check how many
collectives a step makes. It listens to the operations intercept.py hears for the duration
of a `with` block, so every caller that looks them up as `dist.<name>` is seen.
`isend`/`irecv` are counted inside `batch_isend_irecv`.
Payload bytes are the bytes of the tensors this rank contributes (all-reduce: the tensor;
all-gather: this rank's input; broadcast: the tensor; send: the tensor), not wire bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from meshsplit.job.intercept import OPERATIONS, listening

__all__: list[str] = []


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)):
        return sum(_nbytes(t) for t in tensor)
    return 0


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

    def hear(name: str, bound: dict[str, Any]) -> None:
        if name == "batch_isend_irecv":
            for op in bound["p2p_op_list"]:
                kind = getattr(op.op, "__name__", "")
                traffic.record(kind, _nbytes(op.tensor) if kind == "isend" else 0)
        elif OPERATIONS[name].counted:
            payload = OPERATIONS[name].payload
            traffic.record(name, 0 if payload is None else _nbytes(bound[payload]))

    with listening(hear):
        yield traffic
