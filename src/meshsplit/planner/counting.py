"""What each item of a split model does in one forward and backward: its FLOPs, the bytes
autograd saves for it, what its modules holding parameters make (zero bubble's W reads their
gradients), its collectives over tp and the rows its experts are handed. `measure.py` turns
the counts into the workload's items.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from meshsplit.batch import call_model
from meshsplit.experts.split import dispatched_bytes, experts_in
from meshsplit.gather import ALL_GATHER
from meshsplit.job.traffic import count_traffic
from meshsplit.pipeline.cuts import Cuts
from meshsplit.planner.workload import Traffic
from meshsplit.runtime.engine import Engine

__all__: list[str] = []

_COLLECTIVES = {"all_reduce": "all_reduce", ALL_GATHER: "all_gather"}
"""torch.distributed functions the tp layers call -> the operation the cost model prices."""


def autocast_of(engine: Engine) -> AbstractContextManager[Any]:
    """The autocast the engine's workers run forward and loss in (nothing under fp32)."""
    return engine.precision.autocast()


class _Counts:
    """What one item did in one forward and backward."""

    def __init__(self) -> None:
        self.saved = 0
        self.exits = 0
        """Bytes of what the item's modules holding parameters made (see Item)."""
        self.flops = [0.0, 0.0]
        self.ops = [0, 0]
        """Operators dispatched in forward and in backward (on a GPU, a kernel launch each)."""
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

    def exited(self, _: nn.Module, __: Any, output: Any) -> None:
        """A forward hook on a module holding parameters: the bytes it made."""
        tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        self.exits += sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)

    def dispatched(self, experts: nn.Module, args: Any, kwargs: Any, __: Any) -> None:
        """A forward hook on an experts module: the rows ep would send, tokens x top-k."""
        self.experts_calls += 1
        self.dispatch_bytes += dispatched_bytes(experts, args, kwargs)

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
    """Charges operators, FLOPs, saved bytes and collectives to the item running now."""

    def __init__(self, counts: list[_Counts], parameters: set[int]) -> None:
        super().__init__()
        self.counts = counts
        self.parameters = parameters
        self.current = len(counts) - 1
        self.direction = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counts[self.current].ops[self.direction] += 1
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


def count_items(cuts: Cuts, engine: Engine, inputs: Any, targets: Any) -> list[_Counts]:
    """One forward and backward of the split model with every op charged to its item."""
    counts = [_Counts() for _ in cuts.names]
    module = engine.module
    parameters = {t.untyped_storage().data_ptr() for t in module.state_dict().values()}
    mode = _Attribution(counts, parameters)
    with ExitStack() as stack:
        for index, item in enumerate(cuts.modules):
            for sub in item.modules():
                stack.enter_context(_charging(sub, index, mode))
                if any(True for _ in sub.parameters(recurse=False)):
                    stack.callback(sub.register_forward_hook(counts[index].exited).remove)
            stack.callback(item.register_forward_hook(counts[index].sized).remove)
            for path in experts_in(item):
                experts = item.get_submodule(path)
                hook = experts.register_forward_hook(counts[index].dispatched, with_kwargs=True)
                stack.callback(hook.remove)
        stack.enter_context(count_traffic(mode))
        stack.enter_context(saved_tensors_hooks(mode.pack, lambda t: t))
        stack.enter_context(mode)
        with autocast_of(engine):
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
