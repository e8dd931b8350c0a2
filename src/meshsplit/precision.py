"""Mixed precision (Plan.precision): forward and loss under autocast, fp32 master state.

Parameters, gradients and optimizer state stay float32, as with `torch.autocast` in a plain
loop; only what runs inside forward and loss takes the low dtype. fp16's narrow range adds
a dynamic loss scale with `torch.amp.GradScaler`'s rule, kept as a Python float that every
rank updates from the step's one agreed decision: no collective and no host sync of its own.
Backward starts from each micro-batch's own loss times the scale, as GradScaler on that
micro-batch would, not from its (smaller) share of the global loss: fp16 overflows at the
same magnitudes as on the whole batch in one process (a weight's gradient sums over fewer
rows, each weighing more), so a split skips the steps a plain loop skips.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from meshsplit.plan import Plan

__all__: list[str] = []

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
REDUCE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


class LossScale:
    """GradScaler's dynamic scale: 2**16 to start, halved on an overflowing step, doubled
    after `interval` clean steps in a row."""

    def __init__(self, initial: float = 2.0**16, interval: int = 2000) -> None:
        self.value = initial
        self.interval = interval
        self.clean_steps = 0
        """Steps without overflow since the scale last changed (GradScaler's growth tracker)."""

    def update(self, overflow: bool) -> None:
        if overflow:
            self.value *= 0.5
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.interval:
            self.value *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class Precision:
    """How this rank's step treats dtypes: the autocast around forward and loss, and the
    loss scale (fp16 only) applied to the loss before backward and taken off the gradients
    after they are synchronised."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.name = plan.precision
        self.dtype = AUTOCAST_DTYPES[plan.precision]
        """The autocast dtype (None: plain fp32)."""
        self.device_type = device.type
        self.loss_scale = LossScale() if plan.precision == "fp16-mixed" else None
        self.reduce_dtype = REDUCE_DTYPES[plan.reduce_dtype]
        self.multiplier = 1.0
        """What this step's backward multiplies its loss by (the scale over the share)."""

    def begin_step(self, share: float) -> None:
        """Set this step's backward multiplier: `share` is what one micro-batch's loss
        weighs in the global loss (see batch.loss_weight)."""
        self.multiplier = 1.0 if self.loss_scale is None else self.loss_scale.value / share

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward and loss run in (nothing under fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from a micro-batch's weighted `loss`, times the multiplier under fp16
        (outside autocast, as in a plain loop)."""
        if self.multiplier != 1.0:
            loss = loss * self.multiplier
        loss.backward()

    def unscale(self, gradients: list[torch.Tensor]) -> None:
        """Take the multiplier off synchronised gradients, in place (nothing without one)."""
        if self.multiplier != 1.0 and gradients:
            torch._foreach_mul_(gradients, 1.0 / self.multiplier)

    def stepped(self, finite: bool) -> None:
        """Move the loss scale after a step every rank agreed was finite or not."""
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=not finite)
