"""BatchNorm subclasses with a forward of their own (timm's BatchNormAct2d, which adds the
activation): their `F.batch_norm` calls normalise over the dp group's rows, as the
converted layers of `batchnorm.py` do, instead of each replica's own.

The subclass's forward runs as written; a TorchFunctionMode active only inside it answers
its `F.batch_norm` calls in training with the statistics of the micro-batch over dp (the
same all-gather of (n, μ, M2) and the same backward), and updates the running statistics it
passed with the momentum it passed, once per call (a micro-batch), as PyTorch would; a
forward run again for recomputation leaves them alone.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from meshsplit.batchnorm import BatchNorm, Normalize, moments, recomputing

__all__: list[str] = []


_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The modules whose forward `normalise_over` wrapped already."""


def own_forwards(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each BatchNorm subclass whose forward is its own: a user's, not
    meshsplit's converted layer (which normalises over dp itself)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm)
        and type(module).forward not in (_BatchNorm.forward, BatchNorm.forward)
    ]


def normalise_over(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make `module`'s own forward normalise over `group` (in place, once)."""
    if module in _WRAPPED:
        return
    mode = _OverGroup(group)
    forward: Callable[..., Any] = module.forward
    name = type(module).__name__

    def over_group(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with mode:
            output = forward(*args, **kwargs)
        if self.training and not mode.calls:
            warnings.warn(
                f"{name}'s forward normalises without F.batch_norm: under dp it uses this "
                "replica's rows only",
                stacklevel=2,
            )
        mode.calls = 0
        return output

    module.forward = types.MethodType(over_group, module)
    _WRAPPED.add(module)


class _OverGroup(TorchFunctionMode):
    """Answers `F.batch_norm` in training with the statistics over `group`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.calls = 0
        """F.batch_norm calls answered since the forward began."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            self.calls += 1
            return _batch_norm(self.group, *args, **kwargs)
        return func(*args, **kwargs)


def _batch_norm(
    group: dist.ProcessGroup,
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """F.batch_norm with the batch statistics of every replica's rows."""
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    count, mean, m2 = moments(input.detach(), group)
    if running_mean is not None and running_var is not None and not recomputing():
        with torch.no_grad():
            unbiased = m2 / (count - 1).clamp(min=1)
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return Normalize.apply(input, mean, m2 / count, eps, weight, bias, count, group)
