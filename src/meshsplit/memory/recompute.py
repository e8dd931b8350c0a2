"""Activation recomputation: keep a part's inputs, drop what its layers save, redo it in backward.

Cost: one more forward of the part per micro-batch (torch.utils.checkpoint, non-reentrant, RNG
state restored). Parts are whole pipeline stages or blocks; 'auto' picks the blocks that make a
rank fit its budget for the least added forward time, a min-cost knapsack.
Rationale: docs/internals.md#memoryrecomputepy
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from meshsplit.batch import call_model, tensors

__all__: list[str] = []


def recomputes(policy: str, stage: int, stages: int) -> bool:
    """Whether pipeline `stage` of `stages` recomputes as a whole under `policy`.

    'except_last' spares the last stage: under 1F1B its backward follows each forward at
    once, so what it saves is freed almost immediately and recomputing it buys nothing.
    'auto' chooses blocks, never whole stages. The planner prices the same rule. The policy
    was validated with the Plan.
    """
    return policy == "always" or (policy == "except_last" and stage < stages - 1)


Wrap = Callable[[int, Callable[..., Any]], Callable[..., Any]]
"""(stage, its computation) -> the computation as the policy runs it on that stage."""


def for_stages(policy: str, stages: int) -> Wrap:
    """What the layer split runs on each stage under `policy`: recomputed or as it is."""

    def wrap(stage: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not recomputes(policy, stage, stages):
            return fn
        return functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False)

    return wrap


def blocks_for(policy: str, stages: int, blocks: Sequence[str], chosen: Sequence[str]) -> list[str]:
    """The blocks that recompute one by one: all of them under 'always' on one stage, what
    the budget chose under 'auto', none otherwise (whole stages recompute instead)."""
    if policy == "always" and stages == 1:
        return list(blocks)
    return list(chosen) if policy == "auto" else []


def recompute_blocks(model: nn.Module, names: Sequence[str]) -> None:
    """Make each named submodule recompute its forward in backward (wraps its `forward`)."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(
            torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False
        )


@dataclass(frozen=True)
class BlockCost:
    """One block on one micro-batch: its forward time, what autograd saves inside it (less
    parameters), and its inputs (what recompute keeps instead)."""

    name: str
    forward_ms: float
    saved_bytes: int
    input_bytes: int

    @property
    def saving_bytes(self) -> int:
        """What recomputing the block frees per micro-batch in flight."""
        return max(0, self.saved_bytes - self.input_bytes)


@dataclass(frozen=True)
class BlockProfile:
    blocks: list[BlockCost]
    output_bytes: int
    """The model's floating-point output on the micro-batch (a loss works on it and its
    gradient in backward)."""


def measure_blocks(model: nn.Module, names: Sequence[str], example: Any) -> BlockProfile:
    """One forward with autograd on `example`, watching what each named block saves.

    The graph is dropped at once; every rank runs this the same way (it may contain the
    operator split's collectives).
    """
    modules = {model.get_submodule(name): name for name in names}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[str, dict[int, int]] = {name: {} for name in names}
    inputs: dict[str, int] = dict.fromkeys(names, 0)
    elapsed: dict[str, float] = dict.fromkeys(names, 0.0)
    running: list[tuple[str, float]] = []

    def before(module: nn.Module, args: Any, kwargs: Any) -> None:
        name = modules[module]
        inputs[name] += _bytes(tensors((args, kwargs)))
        running.append((name, time.perf_counter()))

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name, start = running.pop()
        elapsed[name] += (time.perf_counter() - start) * 1e3

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if running and storage.data_ptr() not in parameters:
            saved[running[-1][0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    hooks = [
        handle
        for module in modules
        for handle in (
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True),
        )
    ]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _same):
            output = call_model(model, example)
    finally:
        for handle in hooks:
            handle.remove()
    blocks = [
        BlockCost(name, elapsed[name], sum(saved[name].values()), inputs[name]) for name in names
    ]
    return BlockProfile(blocks=blocks, output_bytes=_bytes(tensors(output)))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _bytes(values: Sequence[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in values if t.is_floating_point())


def choose_blocks(blocks: Sequence[BlockCost], in_flight: int, need_bytes: int) -> list[str]:
    """The blocks to recompute that free at least `need_bytes` for the least forward time.

    A min-cost covering knapsack, solved exactly by dynamic programming over the savings
    rounded to 1/256 of the need; every block with a saving when even all do not free
    enough (the caller reports what is still missing).
    """
    useful = [b for b in blocks if b.saving_bytes > 0]
    if need_bytes <= 0 or not useful:
        return []
    if sum(b.saving_bytes for b in useful) * in_flight < need_bytes:
        return [b.name for b in useful]
    steps = 256
    unit = need_bytes / steps
    best: list[tuple[float, tuple[str, ...]] | None] = [None] * (steps + 1)
    best[0] = (0.0, ())
    for block in useful:
        weight = max(1, int(block.saving_bytes * in_flight / unit + 1e-9))
        for reached in range(steps, -1, -1):
            current = best[reached]
            if current is None:
                continue
            target = min(steps, reached + weight)
            candidate = (current[0] + block.forward_ms, (*current[1], block.name))
            if best[target] is None or candidate[0] < best[target][0]:  # type: ignore[index]
                best[target] = candidate
    chosen = best[steps]
    assert chosen is not None, "the savings cover the need, so the full set is reachable"
    return list(chosen[1])
