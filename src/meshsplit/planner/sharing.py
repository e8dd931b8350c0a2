"""How workers on one host slow each other down, measured for one model in real workers.

On a host whose cores the workers share, the cost model needs numbers that no isolated
profile shows: how much longer a step takes when every worker runs one at once, what a
message between pipeline stages costs (its receiver sleeps, then waits for a core), and
what a blocking collective costs when every rank is busy between them.
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
from meshsplit.job.launch import launch, picklable
from meshsplit.job.worker import threads_per_worker
from meshsplit.mesh import job_timeout
from meshsplit.pipeline.schedules import Action
from meshsplit.plan import Plan
from meshsplit.planner.schedule_cost import plan_actions, shared_slowdowns, simulate_pipeline
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
    lockstep_s: dict[int, tuple[tuple[float, float], ...]]
    """group size -> (bytes per rank, seconds) a blocking all-reduce of that payload adds to
    a rank when every worker is busy between collectives (an operator split): its peers
    must first get a core, at every hop of the collective."""


def measure_sharing(
    model: nn.Module,
    batch: tuple[Any, Any],
    workers: int,
    *,
    cores: int,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    window_s: float = 0.4,
) -> Sharing:
    """How `workers` processes on this host's `cores` slow each other down, for this model.

    A matmul loop understates the slowdown (a step is many small ops), and an idle pair of
    ranks understates what a message or a collective costs when the ranks compete for cores.
    """
    results = launch(
        _plain_steps,
        workers,
        args=(model, batch, optimizer, loss_fn, window_s),
        start_method=_start_method(optimizer, loss_fn),
    )
    sizes = results[0][3]
    return Sharing(
        slowdown=trials_slowdown(results[0][0], [r[1] for r in results]),
        message_s=_message_s_matching(
            Plan(pp=workers, micro_batches=2 * workers), results[0][2], cores
        ),
        lockstep_s={size: _slowest([r[3][size] for r in results]) for size in sizes},
    )


def trials_slowdown(alone: list[float], together: list[list[float]]) -> float:
    """The median over trials of the slowest worker's step (`together[worker][trial]`) over
    the step alone in the same trial, never below 1: a burst of the host's other load in
    one window moves one trial, not the median."""
    slowest = [max(steps[trial] for steps in together) for trial in range(len(alone))]
    return max(1.0, statistics.median(s / a for s, a in zip(slowest, alone, strict=True)))


def _slowest(tables: list[tuple[tuple[float, float], ...]]) -> tuple[tuple[float, float], ...]:
    """Per payload, the slowest rank's seconds: a collective ends when its last rank's does."""
    return tuple((points[0][0], max(p[1] for p in points)) for points in zip(*tables, strict=True))


def _start_method(*factories: Any) -> str:
    """How to start the measuring workers: by forkserver, as every launch, unless the user's
    factories cannot travel by pickle (a lambda, as `ms.Trainer` takes them: it forks too)
    and CUDA is not initialised here, which a forked worker could not use."""
    if torch.cuda.is_initialized() or picklable(*factories):
        return "forkserver"
    return "fork"


def _plain_steps(
    model: nn.Module,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    window_s: float,
    trials: int = 3,
) -> tuple[list[float], list[float], Bursts, dict[int, tuple[tuple[float, float], ...]]]:
    """Runs in each worker, `trials` times in turn: rank 0's step time alone while the others
    wait in a barrier (in the job, so no process outside it is still starting or ending),
    then every rank's with all of them stepping at once; then a pipeline's bursts and how
    long it lasted, and the seconds of a collective in lockstep. In turn, because a burst of
    the host's other load in one window moved a single pair's ratio between 1.0 and 1.4."""
    workers = dist.get_world_size()
    step = _plain_step(model, batch, optimizer, loss_fn, workers)
    alone, together = [], []
    for _ in range(trials):
        alone.append(_mean_step_s(step, window_s) if not dist.get_rank() else 0.0)
        dist.barrier()  # the others start together: without it the first would step alone
        together.append(_mean_step_s(step, window_s))
        dist.barrier()  # rank 0 steps alone again only once the others stopped
    return alone, together, _pipeline_bursts(), _lockstep_s()


def _plain_step(
    model: nn.Module,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    workers: int,
) -> Callable[[], None]:
    """One unsplit step on 1/workers of the batch, with the threads one of `workers` local
    workers gets."""
    torch.set_num_threads(threads_per_worker(workers))
    inputs, targets = batch
    share = max(1, rows(inputs) // workers)
    x, y = take_rows(inputs, slice(0, share)), take_rows(targets, slice(0, share))
    plain = copy.deepcopy(model)
    step_optimizer = (optimizer or (lambda p: torch.optim.SGD(p, lr=0.01)))(plain.parameters())
    loss_of = loss_fn or nn.CrossEntropyLoss()

    def step() -> None:
        step_optimizer.zero_grad()
        loss_of(call_model(plain, x), y).backward()
        step_optimizer.step()

    return step


def _mean_step_s(step: Callable[[], None], window_s: float) -> float:
    """Seconds per step over at least `window_s` (and 4 steps) after two untimed ones.

    A mean over a window, not a median of steps: workers on too few cores take turns in
    slices of several milliseconds, so most single steps run at full speed and the median
    misses the sharing that the step count over the window shows.
    """
    for _ in range(2):
        step()
    count, started = 0, time.perf_counter()
    while count < 4 or time.perf_counter() - started < window_s:
        step()
        count += 1
    return (time.perf_counter() - started) / count


@dataclass(frozen=True)
class Bursts:
    """A pipeline of every worker, with bursts of work as its stages, run for real: what the
    cost model's replay of it must reproduce (`_message_s_matching`)."""

    forward_s: float
    """One forward burst on a rank computing alone."""
    backward_s: float
    slowdown: float
    """How much longer a burst takes when every rank computes one at once."""
    measured_s: float
    """The pipeline's step, median of rounds, on the slowest rank."""


def _pipeline_bursts(rounds: int = 10) -> Bursts:
    """A 1F1B pipeline over every rank, its stages bursts of work, timed with real messages.

    A message between stages costs more than its bytes here: the receiver sleeps, and the
    sender's transport thread and the receiver must each get a core back from the other
    workers' compute. A message around an idle ring misses most of that; this measures it
    where it happens.
    """
    world = dist.get_world_size()
    plan = Plan(pp=world, micro_batches=2 * world)
    rank, work = dist.get_rank(), torch.randn(128, 128)
    activation = torch.zeros(8192)  # 32 KiB each way, about a small model's boundary
    actions = plan_actions(plan)[rank]
    burst = _FORWARD_MATMULS + _BACKWARD_MATMULS
    dist.barrier()
    alone = torch.tensor([_burst_s(work, burst, rounds) if not rank else 0.0])
    dist.broadcast(alone, 0)  # rank 0's, the others waiting here
    together = _burst_s(work, burst, rounds)  # every rank at once, no messages
    steps = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        _run_pipeline(actions, rank, world, activation, work)
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        steps.append(float(elapsed))
    forward_s = float(alone) * _FORWARD_MATMULS / burst
    return Bursts(
        forward_s, float(alone) - forward_s, together / float(alone), statistics.median(steps)
    )


def _burst_s(work: torch.Tensor, matmuls: int, rounds: int) -> float:
    """Seconds of one burst, the mean of `rounds`."""
    started = time.perf_counter()
    for _ in range(rounds):
        _matmuls(work, matmuls)
    return (time.perf_counter() - started) / rounds


_FORWARD_MATMULS, _BACKWARD_MATMULS = 3, 6
"""One stage's burst per micro-batch: ~0.3 ms forward and twice that backward on one core."""


def _run_pipeline(
    actions: list[Action], rank: int, world: int, buffer: torch.Tensor, work: torch.Tensor
) -> None:
    """This rank's 1F1B actions with real messages: activations forward, gradients back."""
    sends = []
    for action in actions:
        forward = action.kind == "F"
        source = rank - 1 if forward else rank + 1
        if 0 <= source < world:
            dist.recv(buffer, source, tag=int(not forward))
        _matmuls(work, _FORWARD_MATMULS if forward else _BACKWARD_MATMULS)
        target = rank + 1 if forward else rank - 1
        if 0 <= target < world:
            sends.append(dist.isend(buffer.clone(), target, tag=int(not forward)))
    for send in sends:
        if send is not None:  # None only for a rank outside the group, which this is not
            send.wait()


def _message_s_matching(plan: Plan, bursts: Bursts, cores: int) -> float:
    """The per-message seconds at which the cost model's replay of `plan` (these bursts on
    every stage, the ranks sharing the cores as the cost model shares them) lasts as long as
    measured: 0 when even free messages do not reach it (bisection; `simulate_pipeline`
    directly, leaving the planner's replay cache alone)."""
    actions = plan_actions(plan)
    slowdown = shared_slowdowns(bursts.slowdown, plan.pp, cores, 1)

    def replayed(message_s: float) -> float:
        stages = [bursts.forward_s] * plan.pp, [bursts.backward_s] * plan.pp
        messages = [message_s] * plan.pp
        return max(i.end_s for i in simulate_pipeline(actions, *stages, messages, None, slowdown))

    low, high = 0.0, bursts.measured_s
    if replayed(low) >= bursts.measured_s:
        return 0.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if replayed(middle) < bursts.measured_s else (low, middle)
    return low


_LOCKSTEP_MATMULS = 1
"""The work between two collectives: ~0.4 ms on one core, an operator-split layer's worth."""

LOCKSTEP_PAYLOADS = (4, 64 << 10, 512 << 10, 2 << 20)
"""Bytes per rank of the all-reduces timed in lockstep: a token, and the sizes of the
activations an operator split reduces in a small model's step."""


def _lockstep_s(rounds: int = 30) -> dict[int, tuple[tuple[float, float], ...]]:
    """Per group size (pairs, and every rank), per payload: seconds an all-reduce adds after
    each burst of work when every rank works and then synchronises, less the burst run by
    all ranks at once without synchronising (the mean: a step pays every one). Larger
    payloads never cost less than smaller ones (the noise between them is not a saving)."""
    world = dist.get_world_size()
    if world == 1:
        return {}
    rank, work = dist.get_rank(), torch.randn(256, 256)
    bound = job_timeout(torch.device("cpu"))  # new_group's default would be 30 minutes
    pairs = [dist.new_group([2 * i, 2 * i + 1], timeout=bound) for i in range(world // 2)]
    groups = {2: pairs[rank // 2] if rank < 2 * len(pairs) else None, world: None}

    dist.barrier()
    loaded = _burst_s(work, _LOCKSTEP_MATMULS, rounds)
    result = {}
    for size, group in sorted(groups.items()):
        points, least = [], 0.0
        for payload in LOCKSTEP_PAYLOADS:
            message = torch.zeros(payload // 4)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(rounds):
                _matmuls(work, _LOCKSTEP_MATMULS)
                dist.all_reduce(message, group=group)
            least = max(least, (time.perf_counter() - started) / rounds - loaded)
            points.append((float(payload), least))
        result[size] = tuple(points)
    return result


def _matmuls(work: torch.Tensor, count: int) -> None:
    """A burst of work between messages or collectives: `count` products of `work`."""
    for _ in range(count):
        work @ work
