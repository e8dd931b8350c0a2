"""How workers on one host slow each other down, measured for one model in real workers.

On a host whose cores the workers share, the cost model needs two numbers that no isolated
profile shows: how much longer a step takes when every worker runs one at once, and what a
message costs to a rank that sleeps waiting for it (it may then wait for a core too).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.batch import LossFn, call_model, rows, take_rows
from meshsplit.engine import OptimizerFactory
from meshsplit.launch import launch, threads_per_worker

__all__: list[str] = []


def measure_sharing(
    model: nn.Module,
    batch: tuple[Any, Any],
    workers: int,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    steps: int = 6,
) -> tuple[float, float]:
    """How `workers` processes on this host slow each other down, for this model.

    Returns (slowdown, message_s): how much longer this model's own step takes when all of
    them run it at once (each with the threads a worker gets) than in one such process
    alone, and what one small message costs from a rank that is waiting for it to its
    reader, passed around a ring while the rest wait (a pipeline filling). A matmul loop
    understates the first (a step is many small ops); an idle pair of ranks understates
    the second (a woken rank waits for a core).
    """
    alone = launch(_plain_steps, 1, args=(model, batch, optimizer, loss_fn, steps, workers))
    together = launch(
        _plain_steps, workers, args=(model, batch, optimizer, loss_fn, steps, workers)
    )
    slowdown = max(t for t, _ in together) / alone[0][0]
    return max(1.0, slowdown), max(m for _, m in together)


def _plain_steps(
    model: nn.Module,
    batch: tuple[Any, Any],
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    steps: int,
    workers: int,
) -> tuple[float, float]:
    """Runs in each worker: the median of `steps` unsplit steps on 1/workers of the batch,
    and the seconds of one message around a ring of the workers."""
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
    return sorted(times[2:])[len(times[2:]) // 2], _ring_message_s()


def _ring_message_s(rounds: int = 8) -> float:
    """Seconds per hop of a token around every rank, each hop after a short burst of work,
    less the burst: a waiting rank's wake-up and one small message."""
    world = dist.get_world_size()
    if world == 1:
        return 0.0
    rank, token, work = dist.get_rank(), torch.zeros(1), torch.randn(128, 128)
    started = time.perf_counter()
    for _ in range(5):
        work @ work
    burst = (time.perf_counter() - started) / 5
    dist.barrier()
    started = time.perf_counter()
    for _ in range(rounds):
        if rank != 0:
            dist.recv(token, (rank - 1) % world)
        work @ work
        dist.send(token, (rank + 1) % world)
        if rank == 0:
            dist.recv(token, world - 1)
    return max(0.0, (time.perf_counter() - started) / (rounds * world) - burst)
