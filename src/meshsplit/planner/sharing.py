"""How workers on one host slow each other down, measured for one model in real workers.

On a host whose cores the workers share, the cost model needs two numbers that no isolated
profile shows: how much longer a step takes when every worker runs one at once, and what a
message costs to a rank that sleeps waiting for it (it may then wait for a core too).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.batch import LossFn, call_model, rows, take_rows
from meshsplit.job.launch import launch
from meshsplit.job.worker import threads_per_worker
from meshsplit.mesh import job_timeout
from meshsplit.pipeline.schedules import Action
from meshsplit.plan import Plan
from meshsplit.planner.schedule_cost import plan_actions, replay
from meshsplit.runtime.parallelize import OptimizerFactory

__all__: list[str] = []


@dataclass(frozen=True)
class Sharing:
    """What `workers` processes on one host cost each other, for one model."""

    slowdown: float
    """How much longer this model's own step takes when every worker runs one at once (each
    with the threads a worker gets) than in one such process alone."""
    message_s: float
    """One small message between the stages of a pipeline of every worker, as the cost
    model's schedule replay must price it to match a real one (see `_pipeline_message_s`)."""
    lockstep_s: dict[int, float]
    """group size -> what one small blocking collective adds to a rank when every worker is
    busy between collectives (an operator split): its peers must first get a core."""


def measure_sharing(
    model: nn.Module,
    batch: tuple[Any, Any],
    workers: int,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    steps: int = 6,
) -> Sharing:
    """How `workers` processes on this host slow each other down, for this model.

    A matmul loop understates the slowdown (a step is many small ops), and an idle pair of
    ranks understates what a message or a collective costs when the ranks compete for cores.
    """
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:  # alone: here, with the threads a worker gets, leaving this process as it was
        alone = _step_median(model, batch, optimizer, loss_fn, steps, workers)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    together = launch(
        _plain_steps, workers, args=(model, batch, optimizer, loss_fn, steps, workers)
    )
    sizes = together[0][2]
    return Sharing(
        slowdown=max(1.0, max(t for t, _, _ in together) / alone),
        message_s=max(m for _, m, _ in together),
        lockstep_s={size: max(r[2][size] for r in together) for size in sizes},
    )


def _plain_steps(
    model: nn.Module,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    steps: int,
    workers: int,
) -> tuple[float, float, dict[int, float]]:
    """Runs in each worker: its step time (below), the seconds of one message around a ring
    of the workers, and of a collective in lockstep."""
    step = _step_median(model, batch, optimizer, loss_fn, steps, workers)
    return step, _pipeline_message_s(), _lockstep_s()


def _step_median(
    model: nn.Module,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    steps: int,
    workers: int,
) -> float:
    """The median of `steps` unsplit steps on 1/workers of the batch, with the threads one
    of `workers` local workers gets."""
    torch.set_num_threads(threads_per_worker(workers))
    inputs, targets = batch
    share = max(1, rows(inputs) // workers)
    x, y = take_rows(inputs, slice(0, share)), take_rows(targets, slice(0, share))
    plain = copy.deepcopy(model)
    step_optimizer = (optimizer or (lambda p: torch.optim.SGD(p, lr=0.01)))(plain.parameters())
    loss_of = loss_fn or nn.CrossEntropyLoss()
    times = []
    for _ in range(steps + 2):
        started = time.perf_counter()
        step_optimizer.zero_grad()
        loss_of(call_model(plain, x), y).backward()
        step_optimizer.step()
        times.append(time.perf_counter() - started)
    return sorted(times[2:])[len(times[2:]) // 2]


def _pipeline_message_s(rounds: int = 6) -> float:
    """Seconds per message that the cost model's replay of a 1F1B pipeline over every rank
    needs to reproduce that pipeline run for real, with bursts of work as its stages.

    A message between stages costs more than its bytes here: the receiver sleeps, and the
    sender's transport thread and the receiver must each get a core back from the other
    workers' compute. A message around an idle ring misses most of that; this measures it
    where it happens, and in the units the replay prices (stretched, as every burst is when
    all workers compute).
    """
    world = dist.get_world_size()
    if world == 1:
        return 0.0
    plan = Plan(pp=world, micro_batches=2 * world)
    rank, work = dist.get_rank(), torch.randn(128, 128)
    activation = torch.zeros(8192)  # 32 KiB each way, about a small model's boundary

    def burst(matmuls: int) -> None:
        for _ in range(matmuls):
            work @ work

    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        burst(_FORWARD_MATMULS + _BACKWARD_MATMULS)
    together = (time.perf_counter() - started) / rounds  # every rank at once, no messages
    forward_s = together * _FORWARD_MATMULS / (_FORWARD_MATMULS + _BACKWARD_MATMULS)
    steps = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        _run_pipeline(plan_actions(plan)[rank], rank, world, activation, burst)
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        steps.append(float(elapsed))
    measured = statistics.median(steps)
    return _message_s_matching(plan, forward_s, together - forward_s, measured)


_FORWARD_MATMULS, _BACKWARD_MATMULS = 3, 6
"""One stage's burst per micro-batch: ~0.3 ms forward and twice that backward on one core."""


def _run_pipeline(
    actions: list[Action], rank: int, world: int, buffer: torch.Tensor, burst: Callable[[int], None]
) -> None:
    """This rank's 1F1B actions with real messages: activations forward, gradients back."""
    sends = []
    for action in actions:
        forward = action.kind == "F"
        source = rank - 1 if forward else rank + 1
        if 0 <= source < world:
            dist.recv(buffer, source, tag=int(not forward))
        burst(_FORWARD_MATMULS if forward else _BACKWARD_MATMULS)
        target = rank + 1 if forward else rank - 1
        if 0 <= target < world:
            sends.append(dist.isend(buffer.clone(), target, tag=int(not forward)))
    for send in sends:
        if send is not None:  # None only for a rank outside the group, which this is not
            send.wait()


def _message_s_matching(plan: Plan, forward_s: float, backward_s: float, measured: float) -> float:
    """The per-message seconds at which `replay` of `plan` (these burst times on every
    stage) lasts `measured`: 0 when even free messages do not reach it (bisection)."""

    def replayed(message_s: float) -> float:
        stages = [forward_s] * plan.pp, [backward_s] * plan.pp, [message_s] * plan.pp
        return max(interval.end_s for interval in replay(plan, *stages, [0.0] * plan.pp))

    low, high = 0.0, measured
    if replayed(low) >= measured:
        return 0.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if replayed(middle) < measured else (low, middle)
    return low


def _lockstep_s(rounds: int = 12) -> dict[int, float]:
    """Per group size (pairs, and every rank): seconds a small all-reduce adds after each
    burst of work when every rank works and then synchronises, less the burst run by all
    ranks at once without synchronising."""
    world = dist.get_world_size()
    if world == 1:
        return {}
    rank, token, work = dist.get_rank(), torch.zeros(1), torch.randn(256, 256)
    bound = job_timeout(torch.device("cpu"))  # new_group's default would be 30 minutes
    pairs = [dist.new_group([2 * i, 2 * i + 1], timeout=bound) for i in range(world // 2)]
    groups = {2: pairs[rank // 2] if rank < 2 * len(pairs) else None, world: None}

    def burst() -> None:
        for _ in range(4):
            work @ work

    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        burst()
    loaded = (time.perf_counter() - started) / rounds
    result = {}
    for size, group in sorted(groups.items()):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            burst()
            dist.all_reduce(token, group=group)
        result[size] = max(0.0, (time.perf_counter() - started) / rounds - loaded)
    return result
