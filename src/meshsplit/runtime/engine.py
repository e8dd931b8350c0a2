"""The Engine: one training step on the global batch, whatever the split.

Every method is called on every rank. The plan is applied once, by `apply_plan`, on the first
micro-batch the engine sees (or `example_inputs`): the splits follow the model's data flow,
so they wait for one. The engine then keeps the step: train, predict, evaluate, fit, save,
load and close, the same for every split and every kind of gradient sync.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from meshsplit import experts, phases, tensor
from meshsplit.batch import LossFn, loss_weight, rows, scores, shapes, split_rows, to_device
from meshsplit.batchnorm import commit_batchnorm, describe_batchnorm, discard_batchnorm
from meshsplit.data_parallel import Sync, gather_rows, gather_shards
from meshsplit.job.guard import StepGuard
from meshsplit.memory import compress, offload, pools
from meshsplit.memory.report import MemoryReport
from meshsplit.mesh import Mesh
from meshsplit.phases import phase
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import Precision
from meshsplit.runtime import agreement, checkpoint, training
from meshsplit.runtime.apply_plan import Applied, OptimizerFactory, apply_plan
from meshsplit.runtime.rank_memory import RankMemory
from meshsplit.runtime.runner import LocalRunner, Runner

__all__ = ["Engine"]


class Engine:
    """Trains one model split over the mesh; every method is called on every rank."""

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: Mesh,
        model: nn.Module,
        loss_fn: LossFn,
        make_optimizer: OptimizerFactory,
        baseline_bytes: int = 0,
        lazy: bool = False,
    ) -> None:
        self.plan = plan
        self.mesh = mesh
        self.model = model
        """The caller's model, split in place (other stages' weights released)."""
        self.loss_fn = loss_fn
        self.steps = 0
        self.data_position = {"epoch": 0, "batch": 0}
        """Where `fit` is in its data: completed epochs and batches of the current one."""
        self._make_optimizer = make_optimizer
        self.lazy = lazy
        """Whether each rank builds only its part (the model came as a factory or on meta)."""
        self.baseline_bytes = baseline_bytes
        """Process memory besides the model when it was handed over (see MemoryReport)."""
        self._applied: Applied | None = None
        self._pending_load: Path | None = None
        self._closed = False
        self._guard = StepGuard(mesh, lambda: {"step": self.steps + 1, "phase": phases.current()})
        self.skipped_steps = 0
        """Steps whose update every rank dropped: an fp16 loss scale that overflowed, or a
        non-finite loss or gradient under nonfinite='skip'."""
        self.precision = Precision(plan, mesh.device)
        """The autocast and (fp16) loss scale every forward and backward of this engine use."""
        self.memory = RankMemory(plan, mesh)
        """This rank's budget and the live-tensor count of each step (see rank_memory.py)."""

    @property
    def needs_example(self) -> bool:
        """Whether splitting waits for a micro-batch (operator split by data flow, profiling,
        recompute chosen from what each block saves)."""
        plan = self.plan
        return plan.pp > 1 or plan.tp > 1 or plan.chooses_recompute

    def build(self, example_inputs: Any) -> Applied:
        """Apply the plan to the model on one micro-batch (once); see apply_plan.py."""
        if self._applied is not None:
            return self._applied
        if example_inputs is None and self.needs_example:
            raise PlanError(
                f"Plan {self.plan.describe()} splits the model along its data flow, found on "
                "one micro-batch; pass example_inputs= to parallelize, or call "
                "train_step/predict first"
            )
        self._applied = apply_plan(
            model=self.model,
            plan=self.plan,
            mesh=self.mesh,
            loss_fn=self.loss_fn,
            make_optimizer=self._make_optimizer,
            example=example_inputs,
            lazy=self.lazy,
            memory=self.memory,
            precision=self.precision,
            restore=self._restore if self._pending_load is not None else None,
        )
        return self._applied

    def _restore(self, applied: Applied) -> None:
        """Read the checkpoint `load` was given before the split existed."""
        path, self._pending_load = self._pending_load, None
        assert path is not None
        self._checkpoint_load(self._training(applied), path)

    def prepare(self, inputs: Any) -> None:
        """Split the model now for global batches like `inputs`, as the first train_step would."""
        self._built(inputs)

    def _built(self, batch: Any = None) -> Applied:
        """The split model, built now from one micro-batch of `batch` if not built yet."""
        if self._applied is not None:
            return self._applied
        example = None
        if batch is not None:  # the same rows on every rank, so every rank decides the same
            first = split_rows(batch, self.plan.dp)[0]
            example = split_rows(first, min(rows(first), self.plan.micro_batches))[0]
            example = to_device(example, self.mesh.device)
        return self.build(example)

    @property
    def module(self) -> nn.Module:
        """This process's part of the model."""
        return self.runner.module

    @property
    def runner(self) -> Runner:
        return self._built().runner

    @property
    def sync(self) -> Sync:
        return self._built().sync

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._built().optimizer

    @property
    def operator_split(self) -> list[tensor.Decision]:
        """Each layer's operator-split decision (none before the split or without tp)."""
        return self._applied.operator_split if self._applied is not None else []

    @property
    def dropped_tokens(self) -> int:
        """Token slots this rank's experts modules dropped so far (Plan.capacity_factor)."""
        return experts.dropped_tokens(self.model, self._built().expert_split)

    @property
    def preallocated(self) -> pools.Preallocated:
        """What was allocated before step 1 (see memory/pools.py)."""
        return self._built().preallocated

    @property
    def peers(self) -> dist.ProcessGroup | None:
        """The processes every step agrees with (stop requests, the non-finite check): the
        mesh's, or None when the workers run apart."""
        return None if self.plan.asynchronous else self.mesh.world

    def _replica_rows(self, batch: Any) -> Any:
        """This dp replica's contiguous slice of a global batch (a tensor or a pytree)."""
        return to_device(split_rows(batch, self.plan.dp)[self.mesh.rank("dp")], self.mesh.device)

    @overload
    def train_step(
        self, inputs: Any, targets: Any, *, as_tensor: Literal[False] = ...
    ) -> float: ...
    @overload
    def train_step(
        self, inputs: Any, targets: Any, *, as_tensor: Literal[True]
    ) -> torch.Tensor: ...
    def train_step(self, inputs: Any, targets: Any, *, as_tensor: bool = False) -> Any:
        """One optimizer step on the global batch; its mean loss, the same on every rank: a
        float (one host sync a step), or with `as_tensor` a 0-dim float64 tensor on the mesh's
        device, which under Plan(nonfinite="off") without fp16's loss scale never waits for
        the device (the check and the scale decide on the host: with either, the sync stays)."""
        if self._closed:
            message = "engine is closed: it gave back its buffers and optimizer state"
            raise RuntimeError(f"{message}; build a new one with ms.parallelize to train again")
        global_rows = rows(inputs)
        self.plan.check_batch(global_rows)
        if rows(targets) != global_rows:
            raise ValueError(f"inputs have {global_rows} rows but targets have {rows(targets)}")
        parts = self._built(inputs)
        parts.runner.train(True)
        x, y = self._replica_rows(inputs), self._replica_rows(targets)
        share = agreement.loss_share(self.plan, self.mesh, global_rows, rows(x))
        scaled = self.precision.loss_scale is not None
        with (
            self._guard.naming_timeouts(),
            self.memory.step(
                parts.runner, parts.sync, parts.optimizer, self.steps + 1, shapes(inputs)
            ),
        ):
            parts.sync.begin_step(parts.runner.backward_passes())
            agreement.begin(
                parts.sync, parts.runner, share=share, rows=global_rows, plan=self.plan,
                overflow_skips=scaled,
            )  # fmt: skip
            micro_rows = rows(x) // self.plan.micro_batches
            self.precision.begin_step(loss_weight(self.loss_fn, micro_rows, global_rows))
            with (
                compress.packing(self.plan.compress, parts.runner.module),
                offload.saved_on_host(self.plan),
                self._guard.naming_bad_input(parts.runner.module, inputs, self.loss_fn),
            ):
                loss = parts.runner.train_batch(x, y, global_rows)
            with phase("gradient sync"):
                parts.sync.finish()
                parts.runner.finish_gradients()
                if parts.tp_sums is not None:
                    parts.tp_sums.all_reduce()
            agreed = agreement.finish(
                parts.sync, parts.runner, loss, share=share, rows=global_rows, plan=self.plan,
                step=self.steps + 1, where=self._guard.where, group=self.peers,
                overflow_skips=scaled, on_host=not as_tensor,
            )  # fmt: skip
            if agreed.finite:
                if scaled:  # fp16: the list itself costs a walk over the parameters
                    self.precision.unscale(parts.sync.gradient_tensors())
                if parts.batchnorm:  # a walk over every module: only when there is one
                    commit_batchnorm(parts.runner.module)
                with phase("optimizer step"):
                    parts.optimizer.step()
            else:
                discard_batchnorm(parts.runner.module)
                self.skipped_steps += 1
            self.precision.stepped(agreed.finite)
            parts.sync.zero_grad()
        self.steps += 1
        if not as_tensor:
            return agreed.loss
        return torch.as_tensor(agreed.loss, dtype=torch.float64, device=self.mesh.device)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The model's output for `inputs` (eval mode, no grad), in full on every rank."""
        parts = self._built(inputs)
        parts.runner.train(False)
        parts.sync.newest_parameters()
        with self._guard.naming_bad_input(parts.runner.module, inputs, self.loss_fn):
            output = parts.runner.forward(self._replica_rows(inputs))
        if self.plan.dp == 1:
            return output
        replica_rows = [rows(part) for part in split_rows(inputs, self.plan.dp)]
        group = self.mesh.group("dp")
        return pytree.tree_map(lambda t: gather_rows(t, replica_rows, group), output)

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any, batch_size: int = 512) -> dict[str, float]:
        """Mean loss, and accuracy where the outputs are class scores (see batch.scores)."""
        cpu = torch.device("cpu")
        return scores(
            lambda x: to_device(self.predict(x), cpu), self.loss_fn, inputs, targets, batch_size
        )

    def fit(
        self,
        dataset: tuple[Any, Any],
        *,
        epochs: int,
        batch_size: int,
        eval_data: tuple[Any, Any] | None = None,
        seed: int = 0,
        show: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Train up to `epochs` epochs over shuffled global batches; one metrics row per epoch.

        Continues from `data_position` (set by `load`); with `checkpoint_dir`, saves after
        every epoch, and a generation torchrun restarted (--max-restarts) first loads the
        latest complete checkpoint there, so it goes on where the last one saved.
        """
        if checkpoint_dir is not None:
            checkpoint.check_plan(self.plan)
        if checkpoint_dir is not None and self.steps == 0 and training.restarted(checkpoint_dir):
            self.load(checkpoint_dir)
        return training.fit(
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
        self.sync.newest_parameters()
        local = gather_shards(self.runner.local_state_dict())
        if self.plan.tp > 1:
            local = tensor.unshard_state_dict(self.model, local, self.mesh.group("tp"))
        applied = self._built()
        if applied.expert_groups is not None:
            local = experts.unshard_experts(local, applied.expert_split, applied.expert_groups.ep)
        local = {k: v.detach().cpu().clone() for k, v in local.items()}
        if self.plan.pp == 1:
            return local
        parts: list[Any] = [None] * self.plan.pp
        dist.all_gather_object(parts, local, group=self.mesh.group("pp"))
        return {key: value for part in parts for key, value in part.items()}

    def shard_layouts(self) -> dict[str, tuple[int, int]]:
        """State-dict name -> (dimension, parts) split over tp, for every tensor the operator
        split cut (parts > 1: a fused tensor such as qkv, split within each part)."""
        return tensor.shard_layouts(self.model) if self.plan.tp > 1 else {}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write a checkpoint (model, optimizer, steps, RNG, data position); every rank calls.

        Before the model is split every rank still holds all of it, and there is no optimizer
        state yet: that is what is saved then.
        """
        checkpoint.check_plan(self.plan)
        applied = self._applied if self.needs_example else self._built()
        return checkpoint.save(self._training(applied), directory)

    def load(self, directory: str | os.PathLike[str]) -> Path:
        """Resume from a checkpoint written under this plan or any other; every rank calls.

        Before the model is split (a plan that waits for its first batch) the checkpoint is
        checked now and read as soon as the split exists.
        """
        checkpoint.check_plan(self.plan)
        path = checkpoint.resolve(directory)
        if self._applied is None and self.needs_example:
            checkpoint.check_readable(path)
            self._pending_load = path
            return path
        return self._checkpoint_load(self._training(self._built()), path)

    def _training(self, applied: Applied | None) -> checkpoint.Training:
        """What a checkpoint sees of this engine: before the split, the whole model and no
        optimizer state."""
        expert_names, expert_group = set(), None
        if applied is None:
            runner: Runner = LocalRunner(self.model, self.loss_fn, 1, self.precision)
            optimizer, layouts = None, {}
        else:
            runner, optimizer, layouts = applied.runner, applied.optimizer, self.shard_layouts()
            if applied.expert_groups is not None:
                expert_names = experts.expert_layouts(applied.expert_split)
                expert_group = applied.expert_groups.ep
        return checkpoint.Training(
            plan=self.plan,
            mesh=self.mesh,
            runner=runner,
            optimizer=optimizer,
            layouts=layouts,
            steps=self.steps,
            data_position=self.data_position,
            precision=self.precision,
            expert_names=expert_names,
            expert_group=expert_group,
        )

    def _checkpoint_load(self, state: checkpoint.Training, path: Path) -> Path:
        loaded = checkpoint.load(state, path)
        self.steps, self.data_position = state.steps, state.data_position
        return loaded

    def memory_report(self) -> MemoryReport:
        """This rank's peak memory and the bytes its parameters, gradients and optimizer hold."""
        parts = self._built()
        return self.memory.report(parts.runner, parts.sync, parts.optimizer, self.baseline_bytes)

    def describe(self) -> dict[str, Any]:
        """The plan, where each part of the model runs (per stage when pp > 1), each layer's
        operator split, and the rule for batch-dependent layers."""
        applied = self._built()
        plan = self.plan
        return {
            "plan": plan.as_dict(),
            **applied.runner.describe(),
            "operator_split": [decision.as_dict() for decision in applied.operator_split],
            "expert_split": [split.as_dict() for split in applied.expert_split],
            "batchnorm": describe_batchnorm(applied.batchnorm, plan.dp, plan.micro_batches),
            "memory": self.memory.budget.as_dict() if self.memory.budget is not None else None,
        }

    def close(self) -> None:
        """Give back what the engine took: its hooks, gradient buckets, optimizer state (and
        its files under offload), pipeline receive pools and the staging buffers of its own
        tp group (one that is the whole world, shared by every engine, forgets them), then
        the freed heap to the OS. The model and the process group stay for the caller; the
        engine then refuses to train."""
        self._closed = True
        self._guard.close()
        if self._applied is not None:
            self._applied.close(self.plan, self.mesh)
