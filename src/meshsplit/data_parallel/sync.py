"""Sync: how a replica's gradients meet the others', behind one interface.

Four kinds keep it: all-reduced buckets (allreduce.py), a lone replica's own gradients (no
buckets), FSDP2's reduce-scattered shards (zero.py, ZeRO 2 and 3) and parameter servers
(ps.py). `training_state` is the one place
that picks among them and makes the optimizer to match, so the engine above steps, syncs
and closes any of them the same way and never names a kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.data_parallel import ps
from meshsplit.data_parallel.allreduce import GradientSync, LocalGradients
from meshsplit.data_parallel.experts import WithExperts
from meshsplit.data_parallel.shard_step import step_on_shards
from meshsplit.data_parallel.zero import shard_optimizer, shard_state
from meshsplit.job.context import before_exit
from meshsplit.job.nonfinite import RIDERS
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import REDUCE_DTYPES

__all__: list[str] = []

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Sync(Protocol):
    """One replica's gradient exchange with the others, step by step."""

    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) reach each parameter."""
        ...

    def finish(self) -> None:
        """Wait until this step's gradients are complete on this rank."""
        ...

    def zero_grad(self) -> None: ...

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradients now (buckets, shards)."""
        ...

    def gradient_sums(self) -> list[torch.Tensor]:
        """float32 sums of this rank's gradients: a NaN or infinity anywhere shows in one."""
        ...

    def gradient_bytes(self) -> int:
        """What this rank's gradients take while they exist."""
        ...

    def newest_parameters(self) -> None:
        """Make every replica hold the same, newest parameters before they are read
        (outputs, state dicts); every rank calls."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ShardUnits:
    """Where ZeRO 2/3 may cut a module into FSDP2 units."""

    names: list[str]
    """The submodules each sharded alone (blocks, or a pipeline stage's items)."""
    root_runs: bool
    """Whether the module itself runs forward (then it is a unit too, for the rest)."""
    keep_whole: tuple[nn.Parameter, ...] = ()
    """Parameters another stage also holds (tied): never sharded."""


@dataclass(frozen=True)
class ExpertParameters:
    """The expert parameters this rank holds, and the dp ranks that hold the same ones
    (None: no other rank does, dp == ep)."""

    parameters: list[nn.Parameter]
    same_experts: dist.ProcessGroup | None


def _sync(
    params: list[nn.Parameter],
    group: dist.ProcessGroup | None,
    plan: Plan,
    reduce_dtype: torch.dtype | None,
    riders: int = 0,
) -> GradientSync | LocalGradients:
    """Buckets summed over `group`, or a lone holder's own gradients without one."""
    if group is None:
        return LocalGradients(params)
    scan = plan.nonfinite != "off"
    return GradientSync(
        params, group, plan.bucket_mb, scan=scan, reduce_dtype=reduce_dtype, riders=riders
    )


def rides_gradient_buckets(plan: Plan) -> bool:
    """Whether the step's agreement (`runtime/agreement.py`) rides the first gradient
    bucket's all-reduce under `plan`, for trainable parameters of float32 or wider: when
    all-reduced buckets are the step's only exchange (data parallel alone, no sharded
    gradients, summed in float32: the loss keeps its digits). Else it sends its own."""
    return (
        plan.pp == plan.tp == plan.ep == 1
        and plan.sync == "allreduce"
        and plan.zero <= 1
        and REDUCE_DTYPES[plan.reduce_dtype] is None
    )


def _riders(plan: Plan, params: list[nn.Parameter]) -> int:
    """How many numbers the step's agreement puts in the first gradient bucket: all of them
    where it rides the buckets (`rides_gradient_buckets`), else none."""
    trainable = [p for p in params if p.requires_grad]
    wide = all(p.dtype in (torch.float32, torch.float64) for p in trainable)
    return RIDERS if rides_gradient_buckets(plan) and wide and trainable else 0


@dataclass
class TrainingState:
    """A replica's gradient sync and the optimizer that goes with it."""

    sync: Sync
    optimizer: torch.optim.Optimizer
    counted_optimizer: OptimizerFactory
    """The optimizer whose state this rank holds, for the memory budget (a stateless one
    when the state lives on parameter servers)."""
    holds_optimizer_state: bool


def check_servers(plan: Plan, builds_lazily: bool) -> None:
    """Refuse, before any work, an engine the job's parameter servers cannot serve."""
    ps.refuse_after_servers_left()
    if builds_lazily and plan.sync == "ps":
        raise PlanError(
            "sync='ps' keeps the whole model on every worker and server: pass the built "
            "model, not a factory or a meta-device model"
        )


def serve(
    model: nn.Module,
    plan: Plan,
    make_optimizer: OptimizerFactory,
    make_state: Callable[[torch.optim.Optimizer], object],
) -> None:
    """A parameter server's whole part of the job (it leaves the job's function after)."""
    ps.serve(model, plan, make_optimizer, make_state)


def training_state(
    plan: Plan,
    group: dist.ProcessGroup,
    module: nn.Module,
    parameters: Callable[[], Iterator[nn.Parameter]],
    make_optimizer: OptimizerFactory,
    units: ShardUnits,
    experts: ExpertParameters | None = None,
) -> TrainingState:
    """The gradient sync over the dp `group` and the optimizer, as Plan.sync and Plan.zero
    say: parameter servers, FSDP2 shards (zero 2, 3), or all-reduced buckets with the
    optimizer state whole or dealt over dp (zero 1). `parameters` is read after sharding."""
    reduce_dtype = REDUCE_DTYPES[plan.reduce_dtype]
    if plan.sync == "ps":
        client = ps.ParameterClient(parameters(), plan)
        before_exit(client.close)  # the servers wait for every worker's goodbye
        optimizer = ps.ServerOptimizer(parameters(), client)
        return TrainingState(client, optimizer, ps.stateless_optimizer, False)
    if plan.zero >= 2:
        expert_params = experts.parameters if experts is not None else []
        sharded = shard_state(
            module,
            units.names,
            group,
            stage=plan.zero,
            bucket_mb=plan.bucket_mb,
            reduce_dtype=reduce_dtype,
            root_runs=units.root_runs,
            keep_whole=units.keep_whole,
            ignored=expert_params,
        )
        sync: Sync = sharded
        if experts is not None:  # experts whole on their ep rank, summed over their group
            own = _sync(experts.parameters, experts.same_experts, plan, reduce_dtype)
            sync = WithExperts(sharded, own)
        sharded_optimizer = make_optimizer(parameters())
        step_on_shards(sharded_optimizer)
        return TrainingState(sync, sharded_optimizer, make_optimizer, True)
    params = list(parameters())
    if experts is not None:  # Plan.ep > 1 without ZeRO 2/3
        held = {id(p) for p in experts.parameters}
        dense = [p for p in params if id(p) not in held]
        split = WithExperts(
            _sync(dense, group, plan, reduce_dtype),
            _sync(experts.parameters, experts.same_experts, plan, reduce_dtype),
        )
        stepper: torch.optim.Optimizer = make_optimizer(params)
        if plan.zero == 1 and experts.same_experts is not None:
            # ZeRO 1 over the ranks holding the same experts: they hold the same dense
            # parameters too, so every parameter's owner is among them
            stepper = shard_optimizer(make_optimizer, params, experts.same_experts)
        return TrainingState(split, stepper, make_optimizer, True)
    if plan.zero == 0 and dist.get_world_size(group) == 1:
        return TrainingState(LocalGradients(params), make_optimizer(params), make_optimizer, True)
    sync = _sync(params, group, plan, reduce_dtype, _riders(plan, params))
    if plan.zero == 1:
        return TrainingState(
            sync, shard_optimizer(make_optimizer, params, group), make_optimizer, True
        )
    return TrainingState(sync, make_optimizer(params), make_optimizer, True)
