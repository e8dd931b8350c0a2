"""Measure a model's workload on this device: each item at each tp width, in one process.

For each width k, the model is split exactly as a worker splits it (rank 0 of a fake
process group of k ranks, in which collectives return at once), cut into the items the
layer split cuts between, and profiled at two micro-batch sizes; one further forward and
backward counts, per item, the collectives it calls over tp, the bytes autograd saves for
it, its FLOPs and the rows its experts modules are handed (what Plan.ep would dispatch). A
real step of the unsplit model gives the optimizer's seconds per byte and the engine's own
overhead per step. Under mixed precision every forward and loss runs
under the autocast a worker uses, so times, bytes and traffic are the low dtype's on this
device. Nothing here predicts; `cost.py` does.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import LossFn, call_model, rows, take_rows
from meshsplit.batchnorm import BatchNorm
from meshsplit.experts.split import experts_in
from meshsplit.job.allocator import keep_freed_memory
from meshsplit.memory.report import optimizer_tensors, tensor_bytes
from meshsplit.pipeline.cuts import find_cuts
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.counting import autocast_of, count_items
from meshsplit.planner.simulate import fake_group
from meshsplit.planner.workload import Item, Line, Workload
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.parallelize import OptimizerFactory, parallelize
from meshsplit.runtime.rank_memory import counting_only

__all__: list[str] = []


def measure_workload(
    model: nn.Module,
    batch: tuple[Any, Any],
    *,
    widths: list[int],
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    threads: int | None = None,
    sizes: list[int] | None = None,
    precision: str = "fp32",
) -> Workload:
    """The workload of `model` on the global `batch`, at each tp width in `widths`, timed
    with `threads` compute threads (what each worker will have; default: as now) at the
    micro-batch rows in `sizes` (default: every power of two of the batch down to 1/64),
    under Plan.precision `precision`."""
    if dist.is_initialized():
        raise RuntimeError("measure the workload outside ms.launch (it simulates ranks)")
    keep_freed_memory()  # time the items with the heap behaving as the workers' will
    inputs, targets = batch
    global_rows = rows(inputs)
    wanted = sizes or [global_rows >> k for k in range(7)]
    sizes = sorted({max(1, min(n, global_rows)) for n in [*wanted, global_rows]})
    rng, threads_before = torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(threads or threads_before)
    items: dict[int, tuple[Item, ...]] = {}
    refused: dict[int, str] = {}
    starts: tuple[int, ...] | None = None  # where a stage may begin: anywhere unless found
    try:
        sizes, too_few = _runnable_sizes(model, inputs, targets, sizes, loss_fn, precision)
        for width in widths:
            try:
                with fake_group(0, width):
                    items[width], found = _items(
                        model, inputs, targets, width, sizes, loss_fn, precision
                    )
            except PlanError as error:
                refused[width] = str(error)
            else:
                starts = found if width == 1 else starts
        with fake_group(0, 1):
            whole = _whole_step(model, inputs, targets, optimizer, loss_fn, items.get(1), precision)
    finally:
        torch.set_rng_state(rng)
        torch.set_num_threads(threads_before)
    return Workload(
        items=items,
        precision=precision,
        refused=refused,
        global_rows=global_rows,
        min_rows=sizes[0] if too_few else 1,
        min_rows_reason=too_few,
        experts=tuple(experts_in(model).values()),
        cut_starts=starts,
        **whole,
    )


def _runnable_sizes(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    sizes: list[int],
    loss_fn: LossFn | None,
    precision: str,
) -> tuple[list[int], str]:
    """The sizes from the smallest micro-batch the model trains on, and what it said below.

    Some models refuse a few rows (BatchNorm after a 1x1 feature map needs more than one
    value per channel); the plans that would give them that few are infeasible, not errors.
    """
    with fake_group(0, 1):
        engine = _split(model, 1, loss_fn, inputs, precision)
    complaint = ""
    try:
        for index, n in enumerate(sizes[:-1]):
            try:
                with autocast_of(engine):
                    output = call_model(engine.module, take_rows(inputs, slice(0, n)))
                    loss = engine.loss_fn(output, take_rows(targets, slice(0, n)))
                loss.backward()
                return sizes[index:], complaint
            except (ValueError, RuntimeError) as error:
                complaint = f"{n} rows: {error}"
        return sizes[-1:], complaint  # the whole batch: if it fails, measuring says why
    finally:
        engine.module.zero_grad(set_to_none=True)
        engine.close()


def _split(
    model: nn.Module, width: int, loss_fn: LossFn | None, inputs: Any, precision: str
) -> Engine:
    plan = Plan(tp=width, precision=precision)
    with counting_only():
        engine = parallelize(copy.deepcopy(model), plan, loss_fn=loss_fn)
    engine.prepare(inputs)
    engine.memory.track = False
    return engine


def _items(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    width: int,
    sizes: list[int],
    loss_fn: LossFn | None,
    precision: str,
) -> tuple[tuple[Item, ...], tuple[int, ...] | None]:
    """The items at tp `width`, and the items a stage may begin at (the layer split's own
    answer for block pieces, found as it balanced them; None: anywhere)."""
    engine = _split(model, width, loss_fn, inputs, precision)
    module = engine.module
    with autocast_of(engine):
        timed = [
            find_cuts(module, take_rows(inputs, slice(0, n)), Plan(), lambda c: c) for n in sizes
        ]
    cuts, high = timed[-1], sizes[-1]
    counts = count_items(
        cuts, engine, take_rows(inputs, slice(0, high)), take_rows(targets, slice(0, high))
    )
    result = []
    for index, name in enumerate(cuts.names):
        count, part = counts[index], cuts.modules[index]
        forward = [(n, t.costs[index].forward_ms / 1e3) for n, t in zip(sizes, timed, strict=True)]
        backward = [
            (n, t.costs[index].backward_ms / 1e3) for n, t in zip(sizes, timed, strict=True)
        ]
        result.append(
            Item(
                name=name,
                forward=Line(tuple(forward)),
                backward=Line(tuple(backward)),
                parameter_bytes=tensor_bytes([*part.parameters(), *part.buffers()]),
                output_bytes_per_row=cuts.costs[index].activation_bytes / high,
                compact_output_bytes_per_row=count.compact(cuts.costs[index].activation_bytes)
                / high,
                saved_bytes_per_row=count.saved / high,
                exit_bytes_per_row=count.exits / high,
                trainable=any(p.requires_grad for p in part.parameters()),
                forward_flops_per_row=count.flops[0] / high,
                backward_flops_per_row=count.flops[1] / high,
                forward_ops=count.ops[0],
                backward_ops=count.ops[1],
                forward_traffic=count.traffic(0, high),
                backward_traffic=count.traffic(1, high),
                expert_bytes=sum(
                    tensor_bytes(list(part.get_submodule(path).parameters()))
                    for path in experts_in(part)
                ),
                experts_calls=count.experts_calls,
                dispatch_bytes_per_row=count.dispatch_bytes / high,
                batch_norm_channels=tuple(
                    m.num_features for m in part.modules() if isinstance(m, BatchNorm)
                ),
            )
        )
    engine.close()
    return tuple(result), cuts.cut_starts


def _whole_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    items: tuple[Item, ...] | None,
    precision: str,
    repeats: int = 7,
    window_s: float = 0.5,
) -> dict[str, Any]:
    """Loss, optimizer and overhead from real steps of the unsplit model in this process:
    `repeats` after an untimed one, more while they take under `window_s` (the overhead is
    a small difference of two larger times: three steps' median moved it 0-15 ms a step on
    a 35 ms transformer step between runs here)."""
    plan = Plan(precision=precision)
    with counting_only():
        engine = parallelize(copy.deepcopy(model), plan, optimizer=optimizer, loss_fn=loss_fn)
    engine.memory.track = False
    n = rows(inputs)
    with torch.no_grad(), autocast_of(engine):
        output = call_model(engine.module, inputs)  # what the loss reads, made once
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    steps: list[float] = []
    optimizer_s: list[float] = []
    accumulate_s: list[float] = []
    loss_s: list[tuple[float, float]] = []
    started_all = time.perf_counter()
    while len(steps) <= repeats or time.perf_counter() - started_all < window_s:
        started = time.perf_counter()
        engine.train_step(inputs, targets)
        steps.append(time.perf_counter() - started)
        # the step drops the gradients after it used them, and an optimizer skips a
        # parameter without one: give each a gradient, or this times a loop over nothing
        kept = [p.grad for p in trainable]
        for p in trainable:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        started = time.perf_counter()
        engine.optimizer.step()
        optimizer_s.append(time.perf_counter() - started)
        accumulate_s.append(_time_accumulate(trainable))
        for p, grad in zip(trainable, kept, strict=True):
            p.grad = grad
        loss_s.append(_time_loss(engine, output, targets))
    parameter_bytes = tensor_bytes(trainable)
    state = tensor_bytes(optimizer_tensors(engine.optimizer))
    loss_forward, loss_backward = (statistics.median(t) for t in zip(*loss_s[1:], strict=True))
    # each step less the parts timed beside it, then the median: paired, their noise cancels
    beyond = [
        step - optimizer - sum(loss)
        for step, optimizer, loss in zip(steps[1:], optimizer_s[1:], loss_s[1:], strict=True)
    ]
    items_s = 0.0 if items is None else sum(i.forward.at(n) + i.backward.at(n) for i in items)
    engine.close()
    return {
        "loss_forward": Line.per_row(loss_forward / n),
        "loss_backward": Line.per_row(loss_backward / n),
        "optimizer_s_per_byte": statistics.median(optimizer_s[1:]) / max(1, parameter_bytes),
        "optimizer_state_per_byte": state / max(1, parameter_bytes),
        "accumulate_s_per_byte": statistics.median(accumulate_s[1:]) / max(1, parameter_bytes),
        "step_overhead_s": max(0.0, statistics.median(beyond) - items_s),
        "parameter_bytes": tensor_bytes([*model.parameters(), *model.buffers()]),
    }


def _time_accumulate(trainable: list[nn.Parameter]) -> float:
    """Seconds to add one more micro-batch's gradients to every parameter's (autograd's
    accumulation: each gradient read twice and written once; the new one is `.grad` too)."""
    started = time.perf_counter()
    with torch.no_grad():
        for p in trainable:
            assert p.grad is not None, "the caller gave every parameter a gradient"
            p.grad.add_(p.grad)
    return time.perf_counter() - started


def _time_loss(engine: Engine, output: Any, targets: Any) -> tuple[float, float]:
    """Seconds of the loss's forward (under the engine's autocast) and backward on the
    model's (detached) output."""
    leaves = pytree.tree_map(
        lambda t: (
            t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
        ),
        output,
    )
    started = time.perf_counter()
    with autocast_of(engine):
        loss = engine.loss_fn(leaves, targets)
    middle = time.perf_counter()
    loss.backward()
    return middle - started, time.perf_counter() - middle
