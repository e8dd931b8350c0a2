"""This rank's memory: peak bytes, and what parameters, gradients and optimizer state hold."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from meshsplit.mesh import local_tensor

__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes held by one rank."""

    rank: int
    peak_bytes: int
    """Peak resident memory of the process (CPU) or peak allocated memory (GPU)."""
    baseline_bytes: int
    """What the process held, besides the model, when it was handed to meshsplit (CPU: torch,
    libraries, data; 0 on GPU), so peak_bytes - baseline_bytes is what the split model and
    its training added."""
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    device: str
    tensor_peak_bytes: int | None = None
    """Peak of live tensor bytes during the last train_step (CPU: counted at the dispatcher;
    GPU: the allocator's peak allocated); None before a tracked step."""
    tensor_peak_phase: str | None = None
    """Where that peak fell, e.g. 'backward, micro-batch 3' (CPU only)."""
    tensor_breakdown: dict[str, int] | None = None
    """The live bytes at that peak by category (see memory/tracker.py; CPU only)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of `tensors` (a DTensor counts its local shard)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in this rank's optimizer state (momenta, step counts).

    Under ZeRO the state lives in the inner optimizer, which holds this rank's shard only.
    """
    return tensor_bytes(optimizer_tensors(optimizer))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of this rank's optimizer state (the inner optimizer's under ZeRO)."""
    local = getattr(optimizer, "optim", optimizer)
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield local_tensor(value)


def _proc_status_bytes(field: str) -> int | None:
    """A memory figure (kB) from /proc/self/status, in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> int:
    """Resident memory of this process now (Linux); the lifetime peak elsewhere."""
    now = _proc_status_bytes("VmRSS")
    return now if now is not None else _lifetime_peak()


def reset_peak(device: torch.device) -> None:
    """Start peak tracking afresh: the allocator's peak on GPU, the RSS high-water mark on
    Linux (writing 5 to /proc/self/clear_refs); elsewhere the lifetime peak stands."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def baseline_bytes(model: torch.nn.Module | None, device: torch.device) -> int:
    """Memory held now, less the model's own tensors (None: a model not built yet): the part
    training is not responsible for."""
    if device.type == "cuda":
        return 0
    held = tensor_bytes(model.state_dict().values()) if model is not None else 0
    return resident_bytes() - held


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device` since `reset_peak`: allocator peak on GPU,
    RSS high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _proc_status_bytes("VmHWM")
    return peak if peak is not None else _lifetime_peak()


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
