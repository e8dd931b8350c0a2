"""Sharded training state over dp (ZeRO): stage 1 here; 2 and 3 stand on FSDP2."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__: list[str] = []


def shard_optimizer(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    params: list[nn.Parameter],
    group: dist.ProcessGroup,
) -> torch.optim.Optimizer:
    """ZeRO stage 1: each dp rank keeps and steps the state of ~1/dp of the parameters.

    Gradients are still all-reduced in full; after its step each rank broadcasts the
    parameters it owns, so every replica ends the step with the same weights. The user's
    factory is probed once on a dummy parameter to learn the optimizer class and settings.
    """
    probe = make_optimizer([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(probe)).parameters
    settings = {key: value for key, value in probe.defaults.items() if key in accepted}
    return ZeroRedundancyOptimizer(
        params, optimizer_class=type(probe), process_group=group, **settings
    )
