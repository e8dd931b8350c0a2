"""Pools: what lives for the whole run is allocated before step 1, so step 1 peaks as step 100.

Gradient buckets, tp staging buffers and optimizer state are made at the build (the state by
one zero-gradient step and a reset, kept lazy for an optimizer whose probe shows the reset is
not exact); pipeline receive buffers fill their pool during step 1; on GPU
`Plan.reserve_memory` makes the caching allocator hold the rank's peak before step 1.
Rationale: docs/internals.md#memorypoolspy
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshsplit.memory.report import optimizer_bytes

__all__ = ["allocator_settings", "set_expandable_segments"]

_PROBE_STEPS = 3
_verdicts: dict[Hashable, str | None] = {}
"""(optimizer class, settings) -> None if pre-allocation keeps its trajectory, else why not."""


@dataclass(frozen=True)
class Preallocated:
    """What the build allocated ahead of step 1 on this rank."""

    optimizer_bytes: int
    """Optimizer state made at the build (0: none, or left lazy)."""
    lazy_reason: str | None
    """Why the optimizer state was left to its first step (None: made at the build)."""
    reserved_bytes: int = 0
    """GPU: bytes the caching allocator was made to hold before step 1 (Plan.reserve_memory)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "optimizer_bytes": self.optimizer_bytes,
            "lazy_reason": self.lazy_reason,
            "reserved_bytes": self.reserved_bytes,
        }


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer's inner `.optim`
    (this rank's shard), else the optimizer itself."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the state tensors of every parameter without any: one step with zero gradients
    and lr = 0 (parameters unchanged); gradients are put back as they were.

    The state then holds what that step wrote (a step count of 1, momenta from weight decay):
    right before loading a checkpoint over it; before training, see `preallocate`.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    borrowed = []  # zero gradients already there (views into the buckets) are used in place
    for p in params:
        if p.grad is None or isinstance(p.grad, DTensor) or bool(p.grad.count_nonzero()):
            p.grad = torch.zeros_like(p)
        else:
            borrowed.append(p.grad)
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for grad in borrowed:  # a step may write into its gradients (maximize)
                grad.zero_()


def _reset_state(optimizer: torch.optim.Optimizer) -> None:
    """Every state value back to zero, in place (tensors keep their storage)."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    state[key] = type(value)(0)


def preallocate_optimizer_state(optimizer: torch.optim.Optimizer) -> str | None:
    """Create `optimizer`'s state now, leaving its trajectory exactly as a fresh one's.

    Returns None when the state was made (or already existed), else why it is left lazy.
    """
    local = local_optimizer(optimizer)
    params = [p for group in local.param_groups for p in group["params"]]
    if not params or all(p in local.state for p in params):
        return None
    for group in local.param_groups:
        reason = _verdict(type(local), group, params[0])
        if reason is not None:
            return reason
    create_state(local)
    _reset_state(local)
    return None


def _settings(cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    """The group's settings its class's constructor takes (lr, momentum, betas, ...)."""
    accepted = inspect.signature(cls).parameters
    return {k: v for k, v in group.items() if k != "params" and k in accepted}


def _verdict(
    cls: type[torch.optim.Optimizer], group: dict[str, Any], like: torch.Tensor
) -> str | None:
    """Whether pre-allocated state keeps `cls` with `group`'s settings on its fresh
    trajectory, learnt once on a probe parameter of `like`'s dtype and device."""
    settings = _settings(cls, group)
    key = (cls, repr(sorted(settings.items())), like.dtype, like.device.type)
    if key not in _verdicts:
        try:
            same = _probe(cls, settings, like)
        except Exception as error:  # e.g. an optimizer whose step needs a closure (LBFGS)
            _verdicts[key] = f"{cls.__name__}: a zero-gradient step fails ({error}); left lazy"
        else:
            _verdicts[key] = (
                None
                if same
                else f"{cls.__name__}({settings}) diverges from a fresh optimizer when its "
                "state starts at zero (e.g. SGD with dampening != 0 initialises momentum from "
                "the first gradient); its state is made by the first step"
            )
    return _verdicts[key]


def _probe(cls: type[torch.optim.Optimizer], settings: dict[str, Any], like: torch.Tensor) -> bool:
    """Three steps of one random gradient stream, fresh vs pre-allocated: same bits?"""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(13, generator=generator, dtype=torch.float64).to(like.dtype)
    grads = [
        torch.randn(13, generator=generator, dtype=torch.float64).to(like.dtype)
        for _ in range(_PROBE_STEPS)
    ]
    finals = []
    for preallocated in (False, True):
        param = nn.Parameter(start.to(like.device, copy=True))
        optimizer = cls([param], **settings)
        if preallocated:
            create_state(optimizer)
            _reset_state(optimizer)
        for grad in grads:
            param.grad = grad.to(like.device)
            optimizer.step()
        finals.append(param.detach().to("cpu", copy=True))
    return torch.equal(finals[0], finals[1])


def reserve(device: torch.device, target_bytes: int) -> int:
    """Make the caching allocator hold `target_bytes` in all (allocated + cached) on a CUDA
    `device`: one block of the missing bytes is allocated and freed, so the allocator keeps
    it and step 1 finds its peak already reserved. Returns the bytes of that block (0 on
    CPU, or when the allocator holds enough); clamped to the device's free memory."""
    if device.type != "cuda":
        return 0
    missing = target_bytes - torch.cuda.memory_reserved(device)
    free, _ = torch.cuda.mem_get_info(device)
    size = int(min(missing, free - (64 << 20)))  # leave the driver room
    if size <= 0:
        return 0
    block = torch.empty(size, dtype=torch.uint8, device=device)
    del block
    return size


def allocator_settings() -> dict[str, Any]:
    """The CUDA caching allocator's settings as this process set them: the raw
    PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) string, its key:value pairs, whether
    expandable_segments is on, and the allocator backend (None without CUDA)."""
    raw = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    pairs = dict(
        (item.split(":", 1) + [""])[:2] for item in raw.replace(" ", "").split(",") if item
    )
    return {
        "conf": raw,
        "settings": pairs,
        "expandable_segments": pairs.get("expandable_segments", "False").lower() == "true",
        "backend": torch.cuda.get_allocator_backend() if torch.cuda.is_available() else None,
    }


def set_expandable_segments(enabled: bool = True) -> None:
    """Let the CUDA allocator grow segments in place (less fragmentation as shapes vary).

    Call before the first CUDA allocation of the process, or before `ms.launch` (workers
    inherit the environment); same as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    """
    value = f"expandable_segments:{enabled}"
    settings = allocator_settings()["settings"]
    settings["expandable_segments"] = str(enabled)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(f"{k}:{v}" for k, v in settings.items())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(value)


def preallocate(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    reserve_memory: bool = False,
    budget_bytes: int | None = None,
    state: bool = True,
) -> Preallocated:
    """Everything this rank can allocate before step 1: the optimizer state (unless `state`
    is False: it lives elsewhere, on parameter servers), and on GPU with `reserve_memory`
    the caching allocator's hold on the step's peak (`reserve_target`)."""
    reason = preallocate_optimizer_state(optimizer) if state else "held by the servers"
    reserved = 0
    if reserve_memory and device.type == "cuda":
        reserved = reserve(
            device, reserve_target(torch.cuda.memory_allocated(device), budget_bytes)
        )
    return Preallocated(
        optimizer_bytes=optimizer_bytes(optimizer) if reason is None else 0,
        lazy_reason=reason,
        reserved_bytes=reserved,
    )


def reserve_target(lasting_bytes: int, budget_bytes: int | None) -> int:
    """What the allocator should hold before step 1: 90% of Plan.memory_budget (the peak the
    estimate was checked against; the rest stays for the allocator's small-block pool), or,
    without a budget, the lasting state twice over — a floor for its activations and
    temporaries, not a bound."""
    if budget_bytes is not None:
        return int(0.9 * budget_bytes)
    return 2 * lasting_bytes
