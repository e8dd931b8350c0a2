"""The Engine: one training step on the global batch, whatever the split, and `parallelize`.

`parallelize(model, plan)` applies the plan in one order — batch-dependent layers (BatchNorm
over dp), operator split, layer split, data-parallel sync, optimizer — each step knowing
nothing of the next. The splits follow the model's data flow, so they wait for one
micro-batch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from meshsplit import phases, tensor
from meshsplit.batch import LossFn, rows, scores, split_rows, to_device
from meshsplit.batchnorm import (
    batchnorm_state,
    commit_batchnorm,
    convert_batchnorm,
    describe_batchnorm,
    discard_batchnorm,
)
from meshsplit.data_parallel import (
    GradientSync,
    Sync,
    gather_rows,
    gather_shards,
    ps,
    shard_optimizer,
    shard_state,
)
from meshsplit.job.guard import StepGuard
from meshsplit.job.launch import before_exit
from meshsplit.memory import compress, lazy_model, offload, pools, reclaim, recompute
from meshsplit.memory.lazy_model import ModelSource
from meshsplit.memory.report import (
    MemoryReport,
    baseline_bytes,
    optimizer_bytes,
    peak_bytes,
    reset_peak,
    tensor_bytes,
)
from meshsplit.mesh import Mesh
from meshsplit.phases import phase
from meshsplit.pipeline.blocks import piece_names
from meshsplit.pipeline.runner import PipelineRunner
from meshsplit.plan import Plan, PlanError
from meshsplit.runtime import checkpoint, training
from meshsplit.runtime.rank_memory import RankMemory
from meshsplit.runtime.runner import LocalRunner, Runner
from meshsplit.runtime.start import broadcast_from_first_rank, share_random_stream
from meshsplit.tensor.collectives import staging

__all__ = ["Engine", "parallelize"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def parallelize(
    model: ModelSource,
    plan: Plan,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    example_inputs: Any = None,
) -> Engine:
    """Split `model` over the running processes as `plan` says and return its Engine.

    Every rank must call this with the same model built the same way; rank 0's initial
    parameters are broadcast so all replicas and shards start from one model. `model` may
    also be a zero-argument factory (or a model on the meta device): then each rank builds
    only its own part, from rank 0's random stream, with the values `factory()` gives in one
    process (see lazy_model.py). The operator split follows the model's data flow and the
    layer split profiles it, both on one micro-batch: `example_inputs` (a tensor or a
    dict/tuple of them), or else the first batch the engine sees.
    """
    ps.refuse_after_servers_left()
    mesh = Mesh.build(plan)
    lazy = lazy_model.is_lazy(model)
    if lazy and plan.sync == "ps":
        raise PlanError(
            "sync='ps' keeps the whole model on every worker and server: pass the built "
            "model, not a factory or a meta-device model"
        )
    if lazy:
        share_random_stream(mesh, everywhere=True)  # every rank records the same model
        model = lazy_model.build(model)
        baseline = baseline_bytes(None, mesh.device)
    else:
        assert isinstance(model, nn.Module)
        baseline = baseline_bytes(model, mesh.device)
        model = model.to(mesh.device)
        broadcast_from_first_rank(model)
    if mesh.is_server:
        ps.serve(model, plan, optimizer or _default_optimizer, pools.preallocate_optimizer_state)
    reset_peak(mesh.device)
    share_random_stream(mesh)
    engine = Engine(
        plan=plan,
        mesh=mesh,
        model=model,
        loss_fn=loss_fn if loss_fn is not None else nn.CrossEntropyLoss(),
        make_optimizer=optimizer or _default_optimizer,
        baseline_bytes=baseline,
        lazy=lazy,
    )
    if example_inputs is not None or not engine.needs_example:
        engine.build(example_inputs)
    return engine


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


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
        self.operator_split: list[tensor.Decision] = []
        self.batchnorm: list[str] = []
        """Names of the BatchNorm layers whose statistics span the dp group (see batchnorm.py)."""
        self.lazy = lazy
        """Whether each rank builds only its part (the model came as a factory or on meta)."""
        self.baseline_bytes = baseline_bytes
        """Process memory besides the model when it was handed over (see MemoryReport)."""
        self._parts: _Parts | None = None
        self._pending_load: Path | None = None
        self._offload: offload.Offload | None = None
        self._closed = False
        self._guard = StepGuard(mesh, lambda: {"step": self.steps + 1, "phase": phases.current()})
        self.skipped_steps = 0
        """Steps whose update was dropped for a non-finite loss or gradient (nonfinite='skip')."""
        self.memory = RankMemory(plan, mesh)
        """This rank's budget and the live-tensor count of each step (see rank_memory.py)."""

    @property
    def needs_example(self) -> bool:
        """Whether splitting waits for a micro-batch (operator split by data flow, profiling,
        recompute chosen from what each block saves)."""
        plan = self.plan
        return plan.pp > 1 or plan.tp > 1 or plan.chooses_recompute

    def build(self, example_inputs: Any) -> _Parts:
        """Split the model and create this rank's runner, gradient sync and optimizer (once)."""
        if self._parts is not None:
            return self._parts
        if example_inputs is None and self.needs_example:
            raise PlanError(
                f"Plan {self.plan.describe()} splits the model along its data flow, found on "
                "one micro-batch; pass example_inputs= to parallelize, or call "
                "train_step/predict first"
            )
        model, plan = self.model, self.plan
        if self.lazy:  # BatchNorm layers are rebuilt, with their values: give them values
            lazy_model.keep(model, batchnorm_state(model), self.mesh.device)
        self.batchnorm = convert_batchnorm(model, self._dp_statistics, plan.micro_batches)
        blocks = piece_names(model) if plan.checkpoint in ("always", "auto") else []
        profile = None
        runner: Runner
        with lazy_model.while_splitting(model, self.lazy):
            if plan.tp > 1:
                self.operator_split = tensor.parallelize(
                    model, self.mesh, plan.tp_plan, example=example_inputs,
                    realize=lazy_model.realize_tree,
                )  # fmt: skip
            if plan.chooses_recompute:
                profile = recompute.measure_blocks(model, blocks, example_inputs)
            if plan.pp > 1:
                wrap = recompute.for_stages(plan.checkpoint, plan.pp)
                runner = PipelineRunner(model, self.mesh, plan, self.loss_fn, example_inputs, wrap)
            else:
                runner = LocalRunner(model, self.loss_fn, plan.micro_batches)
        if self.lazy:
            lazy_model.keep(model, runner.local_state_dict(), self.mesh.device)
        if plan.pp == 1 and plan.checkpoint == "always":
            recompute.recompute_blocks(model, blocks)
        sync, optimizer = self._training_state(runner)
        self._parts = _Parts(runner=runner, sync=sync, optimizer=optimizer)
        on_servers = plan.sync == "ps"  # the optimizer state is there, none here
        self.preallocated = pools.preallocate(
            optimizer, self.mesh.device, reserve_memory=plan.reserve_memory,
            budget_bytes=plan.budget_bytes, state=not on_servers,
        )  # fmt: skip
        held = ps.stateless_optimizer if on_servers else self._make_optimizer
        self.memory.fit(model, runner, self._parts.sync, held, profile)
        if self._pending_load is not None:
            path, self._pending_load = self._pending_load, None
            checkpoint.load(self, path)
        return self._parts

    def _training_state(self, runner: Runner) -> tuple[Sync, torch.optim.Optimizer]:
        """The gradient sync over dp and the optimizer, sharded as Plan.zero says."""
        plan, group = self.plan, self.mesh.group("dp")
        offload.check(plan, self.mesh.device)
        if plan.sync == "ps":
            client = ps.ParameterClient(runner.parameters(), plan)
            before_exit(client.close)  # the servers wait for every worker's goodbye
            return client, ps.ServerOptimizer(runner.parameters(), client)
        if plan.zero >= 2:
            shard = functools.partial(
                shard_state, group=group, stage=plan.zero, bucket_mb=plan.bucket_mb
            )
            if isinstance(runner, PipelineRunner):  # a stage's items run alone, it never does
                sharded = shard(
                    runner.module,
                    runner.items(),
                    root_runs=False,
                    keep_whole=runner.tied.parameters,
                )
                runner.reread_state()
            else:
                sharded = shard(runner.module, piece_names(runner.module), root_runs=True)
            return sharded, self._make_optimizer(runner.parameters())
        params = list(runner.parameters())
        sync = GradientSync(params, group, plan.bucket_mb)
        if plan.zero == 1:
            return sync, shard_optimizer(self._make_optimizer, params, group)
        optimizer = self._make_optimizer(params)
        if plan.offload == "optimizer":
            self._offload = offload.host_state(optimizer, self.mesh.device)
        return sync, optimizer

    def prepare(self, inputs: Any) -> None:
        """Split the model now for global batches like `inputs`, as the first train_step would."""
        self._built(inputs)

    def _built(self, batch: Any = None) -> _Parts:
        """The split model, built now from one micro-batch of `batch` if not built yet."""
        if self._parts is not None:
            return self._parts
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

    def _replica_rows(self, batch: Any) -> Any:
        """This dp replica's contiguous slice of a global batch (a tensor or a pytree)."""
        return to_device(split_rows(batch, self.plan.dp)[self.mesh.rank("dp")], self.mesh.device)

    def train_step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step on the global batch; its mean loss, the same on every rank."""
        if self._closed:
            raise RuntimeError(
                "engine is closed: it gave back its buffers and optimizer "
                "state; build a new one with ms.parallelize to train again"
            )
        global_rows = rows(inputs)
        self.plan.check_batch(global_rows)
        if rows(targets) != global_rows:
            raise ValueError(f"inputs have {global_rows} rows but targets have {rows(targets)}")
        parts = self._built(inputs)
        parts.runner.train(True)
        x, y = self._replica_rows(inputs), self._replica_rows(targets)
        with (
            self._guard.naming_timeouts(),
            self.memory.step(parts.runner, parts.sync, parts.optimizer, self.steps + 1),
        ):
            parts.sync.begin_step(parts.runner.backward_passes())
            with (
                compress.packing(self.plan.compress, parts.runner.module),
                offload.saved_on_host(self.plan),
                self._guard.naming_bad_input(parts.runner.module, inputs, self.loss_fn),
            ):
                loss = parts.runner.train_batch(x, y, global_rows)
            with phase("gradient sync"):
                parts.sync.finish()
                parts.runner.finish_gradients()
            finite = self._guard.finite(
                self.plan.nonfinite,
                loss,
                parts.sync.gradient_tensors(),
                parts.runner.module.named_parameters(),
                rows=global_rows,
                step=self.steps + 1,
                group=self.peers,
            )
            if finite:
                commit_batchnorm(parts.runner.module)
                with phase("optimizer step"):
                    parts.optimizer.step()
            else:
                discard_batchnorm(parts.runner.module)
                self.skipped_steps += 1
            parts.sync.zero_grad()
        self.steps += 1
        if self._apart:  # no wait for the other workers: this replica's own mean
            return float(loss.item()) * global_rows / rows(x)
        dist.all_reduce(loss, group=self.mesh.group("dp"))
        return float(loss.item())

    @property
    def _apart(self) -> bool:
        """Whether the workers run without waiting for each other (asynchronous parameter
        servers): no collective among them inside a step."""
        return self.plan.sync == "ps" and self.plan.staleness > 0

    @property
    def peers(self) -> dist.ProcessGroup | None:
        """The processes every step agrees with (stop requests, the non-finite check): the
        mesh's, or None when the workers run apart."""
        return None if self._apart else self.mesh.world

    @property
    def _dp_statistics(self) -> dist.ProcessGroup | None:
        """The group BatchNorm's batch statistics span: the dp replicas, unless they run
        apart (then each worker normalises with its own rows)."""
        return None if self._apart else self.mesh.group("dp")

    def _newest_parameters(self) -> None:
        """Asynchronous parameter servers: every worker takes the servers' newest parameters
        (what waits applied), so outputs and state agree across workers."""
        if self._apart and isinstance(sync := self._built().sync, ps.ParameterClient):
            sync.flush()

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The model's output for `inputs` (eval mode, no grad), in full on every rank."""
        runner = self._built(inputs).runner
        runner.train(False)
        self._newest_parameters()
        with self._guard.naming_bad_input(runner.module, inputs, self.loss_fn):
            output = runner.forward(self._replica_rows(inputs))
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
            self._refuse_checkpoints_on_servers()
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
        self._newest_parameters()
        local = gather_shards(self.runner.local_state_dict())
        if self.plan.tp > 1:
            local = tensor.unshard_state_dict(self.model, local, self.mesh.group("tp"))
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
        self._refuse_checkpoints_on_servers()
        if self._parts is None and self.needs_example:
            return checkpoint.save(_Unsplit(self), directory)
        self._built()
        return checkpoint.save(self, directory)

    def load(self, directory: str | os.PathLike[str]) -> Path:
        """Resume from a checkpoint written under this plan or any other; every rank calls.

        Before the model is split (a plan that waits for its first batch) the checkpoint is
        checked now and read as soon as the split exists.
        """
        self._refuse_checkpoints_on_servers()
        path = checkpoint.resolve(directory)
        if self._parts is None and self.needs_example:
            checkpoint.check_readable(path)
            self._pending_load = path
            return path
        self._built()
        return checkpoint.load(self, path)

    def _refuse_checkpoints_on_servers(self) -> None:
        if self.plan.sync == "ps":
            raise PlanError(
                "checkpoints of sync='ps' plans are not supported: the optimizer state lives "
                "on the parameter servers; save full_state_dict() instead, or train with "
                "sync='allreduce' to checkpoint and resume"
            )

    def memory_report(self) -> MemoryReport:
        """This rank's peak memory and the bytes its parameters, gradients and optimizer hold."""
        peak = self.memory.peak
        return MemoryReport(
            rank=dist.get_rank(),
            peak_bytes=peak_bytes(self.mesh.device),
            tensor_peak_bytes=peak.bytes if peak is not None else None,
            tensor_peak_phase=peak.phase if peak is not None else None,
            tensor_breakdown=dict(peak.breakdown) if peak is not None else None,
            baseline_bytes=self.baseline_bytes,
            parameter_bytes=tensor_bytes(self.runner.parameters()),
            gradient_bytes=self.sync.gradient_bytes(),
            optimizer_bytes=optimizer_bytes(self.optimizer),
            device=str(self.mesh.device),
        )

    def describe(self) -> dict[str, Any]:
        """The plan, where each part of the model runs (per stage when pp > 1), each layer's
        operator split, and the rule for batch-dependent layers."""
        runner = self.runner
        return {
            "plan": self.plan.as_dict(),
            **runner.describe(),
            "operator_split": [decision.as_dict() for decision in self.operator_split],
            "batchnorm": describe_batchnorm(self.batchnorm, self.plan.dp, self.plan.micro_batches),
            "memory": self.memory.budget.as_dict() if self.memory.budget is not None else None,
        }

    def close(self) -> None:
        """Give back what the engine took: its hooks, gradient buckets, optimizer state (and
        its files under offload), pipeline receive pools and the staging buffers of its own
        tp group, then the freed heap to the OS. The model, the process group (and the
        staging buffers of a tp group that is the whole world, shared by every engine) stay
        for the caller; the engine then refuses to train."""
        self._closed = True
        self._guard.close()
        if self._parts is None:
            return
        parts = self._parts
        parts.sync.close()
        buffers = [*parts.sync.gradient_tensors(), *parts.runner.communication_buffers()]
        if self.plan.tp > 1 and (tp_group := self.mesh.group("tp")) is not dist.group.WORLD:
            buffers += staging(tp_group).buffers
        for param in parts.runner.parameters():
            param.grad = None
        reclaim.free_storages(buffers)
        pools.local_optimizer(parts.optimizer).state.clear()
        if self._offload is not None:
            self._offload.close()
            self._offload = None
        reclaim.trim_heap()


class _Unsplit:
    """An engine not split yet, as a checkpoint sees it: the whole model, no optimizer state."""

    def __init__(self, engine: Engine) -> None:
        self.plan, self.mesh = engine.plan, engine.mesh
        self.steps, self.data_position = engine.steps, engine.data_position
        self.runner = LocalRunner(engine.model, engine.loss_fn, 1)
        self.optimizer = None

    def shard_layouts(self) -> dict[str, tuple[int, int]]:
        return {}


@dataclass
class _Parts:
    """What exists once the model is split: this rank's runner, its grad sync, its optimizer."""

    runner: Runner
    sync: Sync
    optimizer: torch.optim.Optimizer
