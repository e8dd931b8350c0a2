"""The Engine: one training step on the global batch, whatever the split, and `parallelize`.

`parallelize(model, plan)` applies the plan in one order — operator split, layer split,
memory policy, data-parallel sync, optimizer — each step knowing nothing of the next.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit import checkpoint, tensor
from meshsplit.data_parallel import GradientSync, shard_optimizer
from meshsplit.memory.report import (
    MemoryReport,
    baseline_bytes,
    optimizer_bytes,
    peak_bytes,
    reset_peak,
    tensor_bytes,
)
from meshsplit.mesh import Mesh
from meshsplit.pipeline.runner import PipelineRunner
from meshsplit.plan import Plan
from meshsplit.runner import LocalRunner, LossFn, Runner

__all__ = ["Engine", "parallelize"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    example_inputs: torch.Tensor | None = None,
) -> Engine:
    """Split `model` over the running processes as `plan` says and return its Engine.

    Every rank must call this with the same model built the same way; rank 0's initial
    parameters are broadcast so all replicas and shards start from one model. A layer split
    profiles the model on `example_inputs` (one micro-batch); without them it waits for the
    first batch the engine sees.
    """
    mesh = Mesh.build(plan)
    baseline = baseline_bytes(model, mesh.device)
    reset_peak(mesh.device)
    model = model.to(mesh.device)
    _broadcast_from_first_rank(model)
    decisions = tensor.parallelize(model, mesh, plan.tp_plan) if plan.tp > 1 else []
    loss = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()

    def build_runner(example: torch.Tensor | None) -> Runner:
        if plan.pp > 1:
            return PipelineRunner(model, mesh, plan, loss, example)
        return LocalRunner(model, loss, plan.micro_batches)

    engine = Engine(
        plan=plan,
        mesh=mesh,
        build_runner=build_runner,
        loss_fn=loss,
        make_optimizer=optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3)),
        operator_split=decisions,
        baseline_bytes=baseline,
    )
    if plan.pp == 1 or example_inputs is not None:
        engine.build(example_inputs)
    return engine


def _broadcast_from_first_rank(model: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


class Engine:
    """Trains one model split over the mesh; every method is called on every rank."""

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: Mesh,
        build_runner: Callable[[torch.Tensor | None], Runner],
        loss_fn: LossFn,
        make_optimizer: OptimizerFactory,
        operator_split: list[tensor.Decision] | None = None,
        baseline_bytes: int = 0,
    ) -> None:
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.steps = 0
        self.data_position = {"epoch": 0, "batch": 0}
        """Where `fit` is in its data: completed epochs and batches of the current one."""
        self._build_runner = build_runner
        self._make_optimizer = make_optimizer
        self.operator_split = operator_split or []
        self.baseline_bytes = baseline_bytes
        """Process memory besides the model when it was handed over (see MemoryReport)."""
        self._parts: _Parts | None = None

    def build(self, example_inputs: torch.Tensor | None) -> _Parts:
        """Create this rank's runner, gradient sync and optimizer (once; the same on all ranks)."""
        if self._parts is not None:
            return self._parts
        runner = self._build_runner(example_inputs)
        params = list(runner.parameters())
        self._parts = _Parts(
            runner=runner,
            sync=GradientSync(params, self.mesh.group("dp"), self.plan.bucket_mb),
            optimizer=(
                shard_optimizer(self._make_optimizer, params, self.mesh.group("dp"))
                if self.plan.zero
                else self._make_optimizer(params)
            ),
        )
        return self._parts

    def _built(self, batch: torch.Tensor | None = None) -> _Parts:
        """The split model, built now from one micro-batch of `batch` if not built yet."""
        if self._parts is not None:
            return self._parts
        example = None
        if batch is not None:
            rows = self._replica_rows(batch)
            example = rows[: max(1, len(rows) // self.plan.micro_batches)]
        return self.build(example)

    @property
    def module(self) -> nn.Module:
        """This process's part of the model."""
        return self.runner.module

    @property
    def runner(self) -> Runner:
        return self._built().runner

    @property
    def sync(self) -> GradientSync:
        return self._built().sync

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._built().optimizer

    def _replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This dp replica's contiguous slice of a global batch."""
        return batch.tensor_split(self.plan.dp)[self.mesh.rank("dp")].to(self.mesh.device)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch; its mean loss, the same on every rank."""
        self.plan.check_batch(len(inputs))
        if len(targets) != len(inputs):
            raise ValueError(f"inputs have {len(inputs)} rows but targets have {len(targets)}")
        parts = self._built(inputs)
        parts.runner.module.train()
        parts.sync.begin_step(parts.runner.backward_passes())
        loss = parts.runner.train_batch(
            self._replica_rows(inputs), self._replica_rows(targets), len(inputs)
        )
        parts.sync.finish()
        parts.optimizer.step()
        parts.sync.zero_grad()
        self.steps += 1
        dist.all_reduce(loss, group=self.mesh.group("dp"))
        return float(loss.item())

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for `inputs` (eval mode, no grad), in full on every rank."""
        runner = self._built(inputs).runner
        runner.module.eval()
        rows = inputs.tensor_split(self.plan.dp)
        mine = runner.forward(rows[self.mesh.rank("dp")].to(self.mesh.device))
        if self.plan.dp == 1:
            return mine
        longest = len(rows[0])
        padded = mine.new_zeros((longest, *mine.shape[1:]))
        padded[: len(mine)] = mine
        gathered = mine.new_empty((self.plan.dp * longest, *mine.shape[1:]))
        dist.all_gather_single(gathered, padded, group=self.mesh.group("dp"))
        pieces = gathered.split(longest)
        return torch.cat([piece[: len(part)] for piece, part in zip(pieces, rows, strict=True)])

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 512
    ) -> dict[str, float]:
        """Mean loss and accuracy (argmax of the last dimension) over a dataset."""
        total_loss, correct, positions = 0.0, 0, 0
        for start in range(0, len(inputs), batch_size):
            x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
            output = self.predict(x).cpu()
            total_loss += float(self.loss_fn(output, y)) * len(y)
            correct += int((output.argmax(-1) == y).sum())
            positions += y.numel()
        return {"loss": total_loss / len(inputs), "accuracy": correct / positions}

    def fit(
        self,
        dataset: tuple[torch.Tensor, torch.Tensor],
        *,
        epochs: int,
        batch_size: int,
        eval_data: tuple[torch.Tensor, torch.Tensor] | None = None,
        seed: int = 0,
        show: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Train up to `epochs` epochs over shuffled global batches; one metrics row per epoch.

        Continues from `data_position` (set by `load`); with `checkpoint_dir`, saves after
        every epoch.
        """
        from meshsplit.training import fit

        return fit(
            self,
            dataset,
            epochs=epochs,
            batch_size=batch_size,
            eval_data=eval_data,
            seed=seed,
            show=show,
            checkpoint_dir=checkpoint_dir,
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state dict (same keys and shapes as the original), on CPU."""
        local = self.runner.local_state_dict()
        if self.plan.tp > 1:
            local = tensor.unshard_state_dict(self.module, local, self.mesh.group("tp"))
        local = {k: v.detach().cpu().clone() for k, v in local.items()}
        if self.plan.pp == 1:
            return local
        parts: list[Any] = [None] * self.plan.pp
        dist.all_gather_object(parts, local, group=self.mesh.group("pp"))
        return {key: value for part in parts for key, value in part.items()}

    def shard_dims(self) -> dict[str, int]:
        """State-dict name -> dimension split over tp, for every tensor the operator split cut."""
        return tensor.shard_dims(self.module) if self.plan.tp > 1 else {}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write a checkpoint (model, optimizer, steps, RNG, data position); every rank calls."""
        return checkpoint.save(self, directory)

    def load(self, directory: str | os.PathLike[str]) -> Path:
        """Resume from a checkpoint written under this plan or any other; every rank calls."""
        return checkpoint.load(self, directory)

    def memory_report(self) -> MemoryReport:
        """This rank's peak memory and the bytes its parameters, gradients and optimizer hold."""
        return MemoryReport(
            rank=dist.get_rank(),
            peak_bytes=peak_bytes(self.mesh.device),
            baseline_bytes=self.baseline_bytes,
            parameter_bytes=tensor_bytes(self.runner.parameters()),
            gradient_bytes=self.sync.gradient_bytes(),
            optimizer_bytes=optimizer_bytes(self.optimizer),
            device=str(self.mesh.device),
        )

    def describe(self) -> dict[str, Any]:
        """The plan, where each part of the model runs (per stage when pp > 1), and each
        layer's operator split."""
        return {
            "plan": self.plan.as_dict(),
            **self.runner.describe(),
            "operator_split": [decision.as_dict() for decision in self.operator_split],
        }

    def close(self) -> None:
        """Release hooks and buffers; the process group stays for the caller."""
        if self._parts is not None:
            self._parts.sync.close()


@dataclass
class _Parts:
    """What exists once the model is split: this rank's runner, its grad sync, its optimizer."""

    runner: Runner
    sync: GradientSync
    optimizer: torch.optim.Optimizer
