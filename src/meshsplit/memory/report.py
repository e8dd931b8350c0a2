"""This rank's memory: peak bytes, and what parameters, gradients and optimizer state hold."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes held by one rank."""

    rank: int
    peak_bytes: int
    """Peak resident memory of the process (CPU) or peak allocated memory (GPU)."""
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    device: str

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in this rank's optimizer state (momenta, step counts).

    Under ZeRO the state lives in the inner optimizer, which holds this rank's shard only.
    """
    local = getattr(optimizer, "optim", optimizer)
    return tensor_bytes(
        value
        for state in local.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device`: allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
