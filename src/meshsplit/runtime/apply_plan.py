"""apply_plan: a plan applied to this rank's model in one order, one package per step.

Every split, and every memory policy, is one numbered step below; a step knows nothing of
the steps after it, and the order is the only place where they meet. Read this function to
know what `parallelize(model, plan)` does to a model (the spirit of torchtitan's
`parallelize_llama`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit import data_parallel, tensor
from meshsplit.batch import LossFn
from meshsplit.batchnorm import batchnorm_state, convert_batchnorm
from meshsplit.batchnorm_subclasses import normalise_over, own_forwards
from meshsplit.data_parallel import ShardUnits, Sync
from meshsplit.experts import (
    ExpertGroups,
    ExpertSplit,
    expert_groups,
    find_experts,
    parameters_of,
    split_experts,
)
from meshsplit.memory import lazy_model, offload, pools, reclaim, recompute
from meshsplit.mesh import Mesh
from meshsplit.pipeline.blocks import piece_names
from meshsplit.pipeline.runner import PipelineRunner
from meshsplit.plan import Plan
from meshsplit.precision import Precision
from meshsplit.runtime.rank_memory import RankMemory
from meshsplit.runtime.runner import LocalRunner, Runner
from meshsplit.tensor.staged import forget_staging, staging

__all__: list[str] = []

OptimizerFactory = data_parallel.sync.OptimizerFactory


@dataclass
class Applied:
    """What exists once the plan is applied to this rank."""

    runner: Runner
    """This rank's part of the model and how a step flows through it."""
    sync: Sync
    optimizer: torch.optim.Optimizer
    operator_split: list[tensor.Decision]
    tp_sums: tensor.TpGradientSum | None
    """The gradients of layers kept whole inside split pairs, summed over tp each step."""
    batchnorm: list[str]
    """The BatchNorm layers whose statistics span the dp group."""
    preallocated: pools.Preallocated
    offloaded: offload.Offload | None
    """Optimizer state held on the host (Plan.offload='optimizer'), to close with the engine."""
    expert_split: list[ExpertSplit]
    """The experts modules divided over ep (none without Plan.ep)."""
    expert_groups: ExpertGroups | None

    def close(self, plan: Plan, mesh: Mesh) -> None:
        """Give back what applying the plan took: hooks, gradient buckets, optimizer state
        (and its files under offload), pipeline receive pools and the staging buffers of
        this tp group (a tp group that is the whole world, which every engine shares, only
        forgets them: an engine still open makes new ones), then the freed heap to the OS."""
        self.sync.close()
        buffers = [*self.sync.gradient_tensors(), *self.runner.communication_buffers()]
        if plan.tp > 1:
            tp_group = mesh.group("tp")
            if tp_group is not dist.group.WORLD:  # no other engine's: freed now
                buffers += staging(tp_group).buffers
            forget_staging(tp_group)
        for param in self.runner.parameters():
            param.grad = None
        reclaim.free_storages(buffers)
        pools.local_optimizer(self.optimizer).state.clear()
        if self.offloaded is not None:
            self.offloaded.close()
            self.offloaded = None
        reclaim.trim_heap()


def apply_plan(
    *,
    model: nn.Module,
    plan: Plan,
    mesh: Mesh,
    loss_fn: LossFn,
    make_optimizer: OptimizerFactory,
    example: Any,
    lazy: bool,
    memory: RankMemory,
    precision: Precision,
    restore: Callable[[Applied], None] | None = None,
) -> Applied:
    """Split `model` for this rank as `plan` says; `example` is one micro-batch (None when
    no step needs one), `lazy` whether the model is still a recording (memory/lazy_model.py).
    """
    offload.check(plan, mesh.device)
    # 1. Batch-dependent layers: BatchNorm's statistics span the dp replicas' rows (each
    #    worker's own when the workers run apart).
    if lazy:  # BatchNorm layers are rebuilt, with their values: give them values
        lazy_model.keep(model, batchnorm_state(model), mesh.device)
    statistics = None if plan.asynchronous else mesh.group("dp")
    batchnorm = convert_batchnorm(model, statistics, plan.micro_batches)
    if statistics is not None and dist.get_world_size(statistics) > 1:
        for _, module in own_forwards(model):  # timm's BatchNormAct2d: its F.batch_norm calls
            normalise_over(module, statistics)
    blocks = piece_names(model) if plan.recompute in ("always", "auto") else []
    operator_split: list[tensor.Decision] = []
    runner: Runner
    with lazy_model.while_splitting(model, lazy):
        # 2. Operator split: each split operator's weight divided over tp, along the data flow.
        if plan.tp > 1:
            operator_split = tensor.parallelize(
                model, mesh, plan.tp_plan, example=example, realize=lazy_model.realize_tree
            )
        # 3. Expert split: each experts module's experts divided over ep of the dp ranks
        #    (before the layer split, which cuts the model with them in place).
        experts: list[ExpertSplit] = []
        groups = None
        if plan.ep > 1:
            groups = expert_groups(mesh, plan.ep)
            found = find_experts(model, plan.ep_plan)
            experts = split_experts(
                model, found, groups.ep, plan.capacity_factor, realize=lazy_model.realize
            )
        # What each block saves, measured on the whole model before the layer split cuts it
        # (recompute='auto' chooses from it in step 7).
        with precision.autocast():  # what each block saves under the plan's precision
            profile = (
                recompute.measure_blocks(model, blocks, example) if plan.chooses_recompute else None
            )
        # 4. Layer split: this rank's stage of a profile-balanced pipeline, or the whole model.
        if plan.pp > 1:
            runner = PipelineRunner(model, mesh, plan, loss_fn, example, precision)
        else:
            runner = LocalRunner(model, loss_fn, plan.micro_batches, precision)
    if lazy:
        lazy_model.keep(model, runner.local_state_dict(), mesh.device)
    # 5. Data-parallel sync, sharded state or parameter servers, and the optimizer to match.
    state = data_parallel.training_state(
        plan,
        mesh.group("dp"),
        runner.module,
        runner.parameters,
        make_optimizer,
        _shard_units(runner),
        _expert_parameters(runner, model, experts, groups),
    )
    if isinstance(runner, PipelineRunner):
        runner.reread_state()  # sharding gave its items new tensors
    tp_sums = (
        tensor.TpGradientSum.of(operator_split, runner.parameter_names(), mesh.group("tp"))
        if plan.tp > 1
        else None
    )
    # 6. Memory pools: the optimizer state made now (on the host under offload), not in step 1.
    offloaded = None
    if plan.offload == "optimizer":
        offloaded = offload.host_state(state.optimizer, mesh.device)
    preallocated = pools.preallocate(
        state.optimizer,
        mesh.device,
        reserve_memory=plan.reserve_memory,
        budget_bytes=plan.budget_bytes,
        state=state.holds_optimizer_state,
    )
    # 7. Recompute, held to the budget: whole stages or every block as Plan.recompute says,
    #    or under 'auto' the blocks that make this rank fit memory_budget for the least time
    #    (chosen against the state the steps above left here, on every rank at once).
    chosen = memory.fit(runner, state.sync, state.counted_optimizer, profile)
    if isinstance(runner, PipelineRunner):
        runner.recompute_stage(recompute.for_stages(plan.recompute, plan.pp))
    recompute.recompute_blocks(model, recompute.blocks_for(plan.recompute, plan.pp, blocks, chosen))
    applied = Applied(
        runner=runner,
        sync=state.sync,
        optimizer=state.optimizer,
        operator_split=operator_split,
        tp_sums=tp_sums,
        batchnorm=batchnorm,
        preallocated=preallocated,
        offloaded=offloaded,
        expert_split=experts,
        expert_groups=groups,
    )
    # 8. A checkpoint asked for before the split existed is read into it now.
    if restore is not None:
        restore(applied)
    return applied


def _expert_parameters(
    runner: Runner, model: nn.Module, splits: list[ExpertSplit], groups: ExpertGroups | None
) -> data_parallel.ExpertParameters | None:
    """This rank's expert parameters (of its stage), summed over the ranks holding the same."""
    if groups is None:
        return None
    here = {id(p) for p in runner.parameters()}
    held = [p for p in parameters_of(model, splits) if id(p) in here]
    return data_parallel.ExpertParameters(held, groups.same_experts)


def _shard_units(runner: Runner) -> ShardUnits:
    """Where ZeRO 2/3 cuts this rank's part: a stage's items run alone and the stage never
    does; a whole model runs itself and its blocks."""
    if isinstance(runner, PipelineRunner):
        return ShardUnits(runner.items(), root_runs=False, keep_whole=tuple(runner.tied.parameters))
    return ShardUnits(piece_names(runner.module), root_runs=True)
