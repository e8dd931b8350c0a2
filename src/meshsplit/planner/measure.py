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
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from meshsplit.batch import LossFn, call_model, rows, take_rows
from meshsplit.experts.split import CALL, experts_in
from meshsplit.gather import ALL_GATHER
from meshsplit.job.traffic import count_traffic
from meshsplit.memory.report import optimizer_tensors, tensor_bytes
from meshsplit.pipeline.cuts import Cuts, find_cuts
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.simulate import fake_group
from meshsplit.planner.workload import Item, Line, Traffic, Workload
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.parallelize import OptimizerFactory, parallelize
from meshsplit.runtime.rank_memory import counting_only

__all__: list[str] = []

_COLLECTIVES = {"all_reduce": "all_reduce", ALL_GATHER: "all_gather"}
"""torch.distributed functions the tp layers call -> the operation the cost model prices."""


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
    inputs, targets = batch
    global_rows = rows(inputs)
    wanted = sizes or [global_rows >> k for k in range(7)]
    sizes = sorted({max(1, min(n, global_rows)) for n in [*wanted, global_rows]})
    rng, threads_before = torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(threads or threads_before)
    items: dict[int, tuple[Item, ...]] = {}
    refused: dict[int, str] = {}
    try:
        sizes, too_few = _runnable_sizes(model, inputs, targets, sizes, loss_fn, precision)
        for width in widths:
            try:
                with fake_group(0, width):
                    items[width] = _items(model, inputs, targets, width, sizes, loss_fn, precision)
            except PlanError as error:
                refused[width] = str(error)
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
                with _autocast(engine):
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


def _autocast(engine: Engine) -> AbstractContextManager[Any]:
    """The autocast the engine's workers run forward and loss in (nothing under fp32)."""
    return engine.precision.autocast()


def _items(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    width: int,
    sizes: list[int],
    loss_fn: LossFn | None,
    precision: str,
) -> tuple[Item, ...]:
    engine = _split(model, width, loss_fn, inputs, precision)
    module = engine.module
    with _autocast(engine):
        timed = [
            find_cuts(module, take_rows(inputs, slice(0, n)), Plan(), lambda c: c) for n in sizes
        ]
    cuts, high = timed[-1], sizes[-1]
    counts = _count(
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
                trainable=any(p.requires_grad for p in part.parameters()),
                forward_flops_per_row=count.flops[0] / high,
                backward_flops_per_row=count.flops[1] / high,
                forward_traffic=count.traffic(0, high),
                backward_traffic=count.traffic(1, high),
                expert_bytes=sum(
                    tensor_bytes(list(part.get_submodule(path).parameters()))
                    for path in experts_in(part)
                ),
                experts_calls=count.experts_calls,
                dispatch_bytes_per_row=count.dispatch_bytes / high,
            )
        )
    engine.close()
    return tuple(result)


class _Counts:
    """What one item did in one forward and backward."""

    def __init__(self) -> None:
        self.saved = 0
        self.flops = [0.0, 0.0]
        self.calls: list[dict[str, list[float]]] = [defaultdict(lambda: [0, 0.0]) for _ in range(2)]
        self.storages: set[int] = set()
        self.output_bytes = 0
        """Bytes of the item's output tensors, as the item made them."""
        self.compact_output_bytes = 0
        """The same with floating tensors at 2 bytes each (bf16 or fp16 on the wire)."""
        self.experts_calls = 0
        self.dispatch_bytes = 0
        """Bytes of the (token, slot) rows handed to the item's experts modules."""

    def sized(self, _: nn.Module, __: Any, output: Any) -> None:
        """A forward hook on the item: the bytes of what it made, as made and compacted."""
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        self.output_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.compact_output_bytes = sum(
            t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors
        )

    def dispatched(self, _: nn.Module, args: Any, kwargs: Any, __: Any) -> None:
        """A forward hook on an experts module: the rows ep would send, tokens x top-k."""
        passed = [*args, *(kwargs[name] for name in CALL if name in kwargs)]
        hidden, index = passed[0], passed[1]
        self.experts_calls += 1
        self.dispatch_bytes += hidden.numel() * hidden.element_size() * index.shape[-1]

    def compact(self, boundary_bytes: int) -> float:
        """`boundary_bytes` of the item's outputs with floating tensors at 2 bytes each."""
        if not self.output_bytes:
            return boundary_bytes / 2
        return boundary_bytes * self.compact_output_bytes / self.output_bytes

    def traffic(self, direction: int, rows_: int) -> tuple[Traffic, ...]:
        return tuple(
            Traffic(operation=op, calls=int(calls), bytes_per_row=nbytes / rows_)
            for op, (calls, nbytes) in sorted(self.calls[direction].items())
        )


class _Attribution(TorchDispatchMode):
    """Charges FLOPs, saved bytes and collectives to the item running now."""

    def __init__(self, counts: list[_Counts], parameters: set[int]) -> None:
        super().__init__()
        self.counts = counts
        self.parameters = parameters
        self.current = len(counts) - 1
        self.direction = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.counts[self.current].flops[self.direction] += counter(*args, **kwargs, out_val=out)
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        count = self.counts[self.current]
        key = tensor.untyped_storage().data_ptr()
        if self.direction == 0 and key not in self.parameters and key not in count.storages:
            count.storages.add(key)
            count.saved += tensor.numel() * tensor.element_size()
        return tensor

    def record(self, operation: str, nbytes: int) -> None:
        """A collective the running item called (heard through `count_traffic`)."""
        if operation in _COLLECTIVES:
            entry = self.counts[self.current].calls[self.direction][_COLLECTIVES[operation]]
            entry[0] += 1
            entry[1] += nbytes


def _count(cuts: Cuts, engine: Engine, inputs: Any, targets: Any) -> list[_Counts]:
    """One forward and backward of the split model with every op charged to its item."""
    counts = [_Counts() for _ in cuts.names]
    module = engine.module
    parameters = {t.untyped_storage().data_ptr() for t in module.state_dict().values()}
    mode = _Attribution(counts, parameters)
    with ExitStack() as stack:
        for index, item in enumerate(cuts.modules):
            for sub in item.modules():
                stack.enter_context(_charging(sub, index, mode))
            stack.callback(item.register_forward_hook(counts[index].sized).remove)
            for path in experts_in(item):
                experts = item.get_submodule(path)
                hook = experts.register_forward_hook(counts[index].dispatched, with_kwargs=True)
                stack.callback(hook.remove)
        stack.enter_context(count_traffic(mode))
        stack.enter_context(saved_tensors_hooks(mode.pack, lambda t: t))
        stack.enter_context(mode)
        with _autocast(engine):
            output = call_model(module, inputs)
            loss = engine.loss_fn(output, targets)
        mode.direction, mode.current = 1, len(counts) - 1
        loss.backward()
    module.zero_grad(set_to_none=True)
    return counts


@contextmanager
def _charging(module: nn.Module, index: int, mode: _Attribution) -> Iterator[None]:
    """While `module` runs forward, charge item `index`; when its outputs' gradients arrive,
    charge its backward."""

    def before(*_: Any) -> None:
        if mode.direction == 0:
            mode.current = index

    def after(_: Any, __: Any, output: Any) -> None:
        for value in pytree.tree_leaves(output):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(lambda grad: _backward_of(mode, index))

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _backward_of(mode: _Attribution, index: int) -> None:
    mode.current = index


def _whole_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    items: tuple[Item, ...] | None,
    precision: str,
    repeats: int = 3,
) -> dict[str, Any]:
    """Loss, optimizer and overhead from real steps of the unsplit model in this process."""
    plan = Plan(precision=precision)
    with counting_only():
        engine = parallelize(copy.deepcopy(model), plan, optimizer=optimizer, loss_fn=loss_fn)
    engine.memory.track = False
    n = rows(inputs)
    with torch.no_grad(), _autocast(engine):
        output = call_model(engine.module, inputs)  # what the loss reads, made once
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    steps, optimizer_s, loss_s = [], [], []
    for _ in range(repeats + 1):
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
        for p, grad in zip(trainable, kept, strict=True):
            p.grad = grad
        loss_s.append(_time_loss(engine, output, targets))
    parameter_bytes = tensor_bytes(trainable)
    state = tensor_bytes(optimizer_tensors(engine.optimizer))
    loss_forward, loss_backward = min(loss_s[1:])
    parts = min(optimizer_s[1:]) + loss_forward + loss_backward
    if items is not None:
        parts += sum(i.forward.at(n) + i.backward.at(n) for i in items)
    engine.close()
    return {
        "loss_forward": Line.per_row(loss_forward / n),
        "loss_backward": Line.per_row(loss_backward / n),
        "optimizer_s_per_byte": min(optimizer_s[1:]) / max(1, parameter_bytes),
        "optimizer_state_per_byte": state / max(1, parameter_bytes),
        "step_overhead_s": max(0.0, min(steps[1:]) - parts),
        "parameter_bytes": tensor_bytes([*model.parameters(), *model.buffers()]),
    }


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
    with _autocast(engine):
        loss = engine.loss_fn(leaves, targets)
    middle = time.perf_counter()
    loss.backward()
    return middle - started, time.perf_counter() - middle
