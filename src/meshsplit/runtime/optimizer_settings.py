"""An optimizer's settings per parameter group (lr, betas, weight decay, a schedule's
initial_lr) as checkpoints keep them: a learning-rate schedule resumes where it was, not at
the values the optimizer factory starts from."""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__: list[str] = []

HOW_IT_RUNS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Settings of how the step runs, not of what it computes: left as this run's factory chose
them (the machine resuming may lack a fused kernel)."""


def settings(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]]]:
    """Each parameter group's settings in a 1-tuple: torch.distributed.checkpoint keeps a
    tuple as one object, where it would flatten a list of dicts into keys that a load must
    then find one by one (and fail on a group or a setting the saving run did not have)."""
    return (
        [
            {k: v for k, v in group.items() if k != "params" and k not in HOW_IT_RUNS}
            for group in optimizer.param_groups
        ],
    )


def restore(optimizer: torch.optim.Optimizer, saved: tuple[list[dict[str, Any]]]) -> None:
    """Put `saved` settings back into `optimizer`'s groups, index by index; when the number
    of groups differs (a factory that groups by what this rank holds), say so and keep the
    factory's."""
    (values,) = saved
    groups = optimizer.param_groups
    if len(values) != len(groups):
        warnings.warn(
            f"the checkpoint holds the settings of {len(values)} optimizer parameter groups and "
            f"this optimizer has {len(groups)}: their settings (lr, ...) stay as the optimizer "
            "factory made them",
            stacklevel=3,
        )
        return
    for group, saved_group in zip(groups, values, strict=True):
        group.update(saved_group)
