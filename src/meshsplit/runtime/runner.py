"""How one data-parallel replica runs a step: the Runner contract and the single-stage runner.

A runner owns this process's part of the model (the whole model when pp == 1, one stage
otherwise). Given this replica's slice of the global batch it runs forward and backward
over the micro-batches, leaving gradients in `.grad`, and returns its share of the loss.
Batches are pytrees (see `batch.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from meshsplit.batch import LossFn, call_model, loss_weight, rows, split_rows, tensors
from meshsplit.phases import phase
from meshsplit.precision import Precision
from meshsplit.sharded_views import ViewWatch

__all__: list[str] = []


class Runner(Protocol):
    """One replica's part of the model and the way a step flows through it."""

    module: nn.Module

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool) -> None:
        """Training or eval mode for everything this rank runs."""
        ...

    def backward_passes(self) -> int:
        """Backward passes that reach each parameter in one step (for overlapping grad sync)."""
        ...

    def finish_gradients(self) -> None:
        """Complete gradients after the dp sync (e.g. sum tied parameters over stages)."""
        ...

    def train_batch(self, inputs: Any, targets: Any, global_rows: int) -> torch.Tensor:
        """Forward + backward of this replica's rows; the weighted loss on the ranks that
        compute it (every rank of the replica, or a pipeline's last stage), 0 elsewhere."""
        ...

    def forward(self, inputs: Any) -> Any:
        """Output of the whole model for `inputs`, on every rank of this replica (no grad)."""
        ...

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This process's parameters and buffers under the original model's names."""
        ...

    def parameter_names(self) -> dict[torch.Tensor, str]:
        """This process's parameters, each with its name in the original model."""
        ...

    def communication_buffers(self) -> list[torch.Tensor]:
        """Buffers this runner keeps for traffic with other ranks (pipeline receive pools)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the model runs: {'stages': [{'stage', 'layers', 'parameters', ...}], ...}."""
        ...


class LocalRunner:
    """pp == 1: the whole model runs here; micro-batches accumulate gradients."""

    def __init__(
        self, module: nn.Module, loss_fn: LossFn, micro_batches: int, precision: Precision
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.precision = precision
        self.loss_so_far = torch.zeros(())
        """The step's weighted loss over the micro-batches run so far (each added before its
        backward): what the gradient sync's riders carry (runtime/agreement.py)."""
        self._views: ViewWatch | None = None
        """Under ZeRO 2/3: the views the sharded units return, made on the first step."""

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def train(self, mode: bool) -> None:
        """Switch the mode when it differs (a walk over every module, each step otherwise);
        as in a plain loop, a submodule set apart by hand stays as it was set."""
        if self.module.training != mode:
            self.module.train(mode)

    def backward_passes(self) -> int:
        return self.micro_batches

    def finish_gradients(self) -> None:
        """Nothing to add: the whole model is here."""

    def train_batch(self, inputs: Any, targets: Any, global_rows: int) -> torch.Tensor:
        total = self.loss_so_far = torch.zeros((), device=tensors(inputs)[0].device)
        pieces = zip(
            split_rows(inputs, self.micro_batches),
            split_rows(targets, self.micro_batches),
            strict=True,
        )
        for micro, (x, y) in enumerate(pieces):
            with phase(f"forward, micro-batch {micro}"), self.precision.autocast():
                loss = self._loss(x, y) * loss_weight(self.loss_fn, rows(x), global_rows)
            total += loss.detach()  # before backward, whose gradient sync may read it
            with phase(f"backward, micro-batch {micro}"):
                self.precision.backward(loss)
        return total

    def _loss(self, x: Any, y: Any) -> torch.Tensor:
        """The loss of one micro-batch. The output dies with the loss's forward, as in plain
        PyTorch: no name holds it (and its size) over backward."""
        if not isinstance(self.module, FSDPModule):
            return self.loss_fn(call_model(self.module, x), y)
        if self._views is None:
            self._views = ViewWatch(self.module)
        with self._views.watching():  # FSDP2 warns of every view; those changed are refused
            loss = self.loss_fn(call_model(self.module, x), y)
        self._views.check()
        return loss

    def forward(self, inputs: Any) -> Any:
        with self.precision.autocast():
            return call_model(self.module, inputs)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def parameter_names(self) -> dict[torch.Tensor, str]:
        return {p: name for name, p in self.module.named_parameters()}

    def communication_buffers(self) -> list[torch.Tensor]:
        return []

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
