"""Activation recomputation: keep a stage's inputs, drop what its layers save, redo it in backward.

A stage under recompute stores only the tensors it received (and the micro-batch) per
micro-batch in flight, instead of every activation its layers save for backward; backward
runs the stage's forward again first (torch.utils.checkpoint, non-reentrant, with the RNG
state restored so dropout draws the same mask). Cost: one more forward per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

from meshsplit.plan import CHECKPOINT_POLICIES, PlanError

__all__: list[str] = []


def recomputes(policy: str, stage: int, stages: int) -> bool:
    """Whether `stage` of `stages` recomputes under `policy`.

    'except_last' spares the last stage: under 1F1B its backward follows each forward at
    once, so what it saves is freed almost immediately and recomputing it buys nothing.
    """
    if policy not in CHECKPOINT_POLICIES:
        raise PlanError(
            f"Plan.checkpoint={policy!r} is unknown; use one of {', '.join(CHECKPOINT_POLICIES)}"
        )
    if policy == "always":
        return True
    return policy == "except_last" and stage < stages - 1


Wrap = Callable[[int, Callable[..., Any]], Callable[..., Any]]
"""(stage, its computation) -> the computation as the policy runs it on that stage."""


def for_stages(policy: str, stages: int) -> Wrap:
    """What the layer split runs on each stage under `policy`: recomputed or as it is."""

    def wrap(stage: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not recomputes(policy, stage, stages):
            return fn
        return functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False)

    return wrap
