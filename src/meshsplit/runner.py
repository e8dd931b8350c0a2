"""How one data-parallel replica runs a step: the Runner contract and the single-stage runner.

A runner owns this process's part of the model (the whole model when pp == 1, one stage
otherwise). Given this replica's slice of the global batch it runs forward and backward
over the micro-batches, leaving gradients in `.grad`, and returns its share of the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

__all__: list[str] = []

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_weight(loss_fn: LossFn, rows: int, global_rows: int) -> float:
    """Factor that turns a micro-batch loss into its share of the global-batch loss.

    A mean-reduced loss over `rows` of `global_rows` samples weighs rows / global_rows;
    a sum-reduced loss is already additive.
    """
    if getattr(loss_fn, "reduction", "mean") == "sum":
        return 1.0
    return rows / global_rows


class Runner(Protocol):
    """One replica's part of the model and the way a step flows through it."""

    module: nn.Module

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def backward_passes(self) -> int:
        """Backward passes that reach each parameter in one step (for overlapping grad sync)."""
        ...

    def train_batch(
        self, inputs: torch.Tensor, targets: torch.Tensor, global_rows: int
    ) -> torch.Tensor:
        """Forward + backward of this replica's rows; the weighted loss, valid on every rank."""
        ...

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Output of the whole model for `inputs`, on every rank of this replica (no grad)."""
        ...

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This process's parameters and buffers under the original model's names."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the model runs: {'stages': [{'stage', 'layers', 'parameters', ...}], ...}."""
        ...


class LocalRunner:
    """pp == 1: the whole model runs here; micro-batches accumulate gradients."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, micro_batches: int) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def backward_passes(self) -> int:
        return self.micro_batches

    def train_batch(
        self, inputs: torch.Tensor, targets: torch.Tensor, global_rows: int
    ) -> torch.Tensor:
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(
            inputs.chunk(self.micro_batches), targets.chunk(self.micro_batches), strict=True
        ):
            loss = self.loss_fn(self.module(x), y) * loss_weight(self.loss_fn, len(x), global_rows)
            loss.backward()
            total += loss.detach()
        return total

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module(inputs)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def describe(self) -> dict[str, Any]:
        return {
            "stages": [
                {
                    "stage": 0,
                    "layers": [name for name, _ in self.module.named_children()],
                    "parameters": sum(p.numel() for p in self.module.parameters()),
                }
            ]
        }
