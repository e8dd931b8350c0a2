"""Offload: optimizer state out of the compute device's memory, saved activations off the GPU.

`Plan.offload='optimizer'` steps the caller's own optimizer on host copies of the parameters
(ZeRO-Offload) or, when compute is already on the host, keeps its state in file-backed pages
the kernel may evict (ZeRO-Infinity's NVMe idea); `'activations'` moves what autograd saves to
pinned host memory. None of these changes the numbers: the same optimizer does the same
arithmetic. Rationale: docs/internals.md#memoryoffloadpy
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import weakref
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.hooks import RemovableHandle

from meshsplit.memory import reclaim
from meshsplit.plan import Plan, PlanError

__all__: list[str] = []


def check(plan: Plan, device: torch.device) -> None:
    """Refuse, at build, an offload this rank cannot do."""
    if plan.offload == "none":
        return
    if plan.offload == "activations" and device.type != "cuda":
        raise PlanError(
            "Plan.offload='activations' moves tensors saved for backward from the GPU to the "
            f"host; this rank computes on {device.type}, where they already are; use "
            "offload='optimizer' or compress='bf16'"
        )
    if plan.zero > 0:
        why = (
            "offload keeps the whole optimizer of this rank's parameters, unsharded"
            if plan.offload == "optimizer"
            else "moving saved activations to the host is not proven together with ZeRO yet"
        )
        raise PlanError(
            f"Plan.offload={plan.offload!r} with zero={plan.zero} is not supported: {why}; "
            f"use zero=0 with offload={plan.offload!r}, or zero={plan.zero} with offload='none'"
        )
    if plan.offload != "activations":
        return
    if plan.compress != "none":
        raise PlanError(
            f"Plan.offload='activations' with compress={plan.compress!r}: both repack the "
            "tensors saved for backward and only one repacking can run; use one of them"
        )


def saved_on_host(plan: Plan) -> AbstractContextManager[Any]:
    """The context forward and backward run in: saved tensors to pinned host memory under
    offload='activations', nothing otherwise."""
    if plan.offload == "activations":
        return save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


class HostCopies:
    """The optimizer steps on the host over fp32 copies of the parameters it updates.

    Before the step: gradients device -> host (pinned buffers), `.data` -> the host copy.
    After: the host copy -> the device parameter, `.data` and `.grad` put back. A parameter
    changed outside the step (a checkpoint loaded, a user's edit: its version counter moved)
    is copied to the host first. Works, unpinned, for parameters already on the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = [
            p for group in optimizer.param_groups for p in group["params"]
        ]
        self._gpu = any(p.is_cuda for p in self.params)
        self.masters = [self._host_like(p) for p in self.params]
        """fp32 host copies of the parameters (their own dtype if not floating point)."""
        self.grads = [self._host_like(p) for p in self.params]
        with torch.no_grad():
            for master, p in zip(self.masters, self.params, strict=True):
                master.copy_(p.detach())
        self._versions = [p._version for p in self.params]
        self._device: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._hooks: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._to_host),
            optimizer.register_step_post_hook(self._to_device),
            optimizer.register_load_state_dict_post_hook(self._state_to_host),
        ]

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if p.is_floating_point() else p.dtype
        return torch.empty(p.shape, dtype=dtype, device="cpu", pin_memory=self._gpu)

    def _wait(self) -> None:
        if self._gpu:
            torch.cuda.synchronize()

    @torch.no_grad()
    def _to_host(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for i, p in enumerate(self.params):
            if p._version != self._versions[i]:
                self.masters[i].copy_(p.detach(), non_blocking=self._gpu)
            if p.grad is not None:
                self.grads[i].copy_(p.grad, non_blocking=self._gpu)
        self._wait()
        self._device = []
        for p, master, grad in zip(self.params, self.masters, self.grads, strict=True):
            device_grad = p.grad
            self._device.append((p.data, device_grad))
            p.grad = None
            p.data = master
            p.grad = grad if device_grad is not None else None

    @torch.no_grad()
    def _to_device(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for (data, _), master in zip(self._device, self.masters, strict=True):
            data.copy_(master, non_blocking=self._gpu)
        self._wait()
        for i, (p, (data, grad)) in enumerate(zip(self.params, self._device, strict=True)):
            p.grad = None
            p.data = data
            p.grad = grad
            self._versions[i] = p._version
        self._device = []

    def _state_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """`load_state_dict` casts state to each parameter's device: bring it back."""
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    state[key] = value.cpu()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.masters, self.grads, self.params = [], [], [], []


class FileState:
    """The optimizer's state tensors in files mapped into memory, released after each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | None = None) -> None:
        self.optimizer = optimizer
        root = directory or os.environ.get("MESHSPLIT_OFFLOAD_DIR") or tempfile.gettempdir()
        self.directory = Path(tempfile.mkdtemp(prefix="meshsplit-offload-", dir=root))
        """Where the state files are made (each unlinked once mapped); removed by close."""
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._made = 0
        self._hooks: list[RemovableHandle] = [
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_load_state_dict_post_hook(lambda _: self._after_step()),
        ]

    def tensors(self) -> list[torch.Tensor]:
        """The state tensors that live in files."""
        return [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and reclaim.is_file_backed(value)
        ]

    def _after_step(self, *_: Any) -> None:
        """Move new state (the first step's, a loaded state dict's) into files; release all."""
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if _worth_a_file(value):
                    state[key] = self._mapped_copy(value)
        for tensor in self.tensors():
            reclaim.release_pages(tensor)

    def _mapped_copy(self, value: torch.Tensor) -> torch.Tensor:
        path = self.directory / f"state-{self._made}.bin"
        self._made += 1
        mapped = torch.from_file(str(path), shared=True, size=value.numel(), dtype=value.dtype)
        with contextlib.suppress(OSError):  # the mapping keeps the file's pages alive
            path.unlink()
        return mapped.view(value.shape).copy_(value)

    def close(self) -> None:
        """Stop following the optimizer and remove the directory; the mappings go with the
        last reference to the state."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._remove()


def _worth_a_file(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.numel() * value.element_size() >= mmap.PAGESIZE
        and not reclaim.is_file_backed(value)
    )


Offload = HostCopies | FileState
"""What `host_state` set up for one optimizer (close() undoes it)."""


def host_state(
    optimizer: torch.optim.Optimizer, device: torch.device, directory: str | None = None
) -> Offload:
    """Keep `optimizer`'s state on the host: host copies when computing on a GPU, files
    mapped into memory when computing on the host already."""
    if device.type == "cuda":
        return HostCopies(optimizer)
    return FileState(optimizer, directory)
