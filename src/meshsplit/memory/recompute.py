"""Activation recomputation: keep a part's inputs, drop what its layers save, redo it in backward.

Cost: one more forward of the part per micro-batch (torch.utils.checkpoint, non-reentrant, RNG
state restored). Parts are whole pipeline stages or blocks; 'auto' picks the blocks that make a
rank fit its budget for the least added forward time, a min-cost knapsack.
Rationale: docs/internals.md#memoryrecomputepy
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from meshsplit.batch import call_model, tensors
from meshsplit.memory.tracker import Holders, LiveTensors, Sample

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
class Stretch:
    """A stretch of the measured step between two block boundaries: the most live bytes in
    it above the model's state, the block running in it, and the blocks whose forward is done
    and backward not begun (what they keep for backward is alive throughout)."""

    peak_bytes: int
    running: str | None
    held: frozenset[str]
    at_loss: bool = False
    """From the model's output to the end of the first block's backward: where a real loss
    and its gradient are alive."""


@dataclass(frozen=True)
class BlockProfile:
    blocks: list[BlockCost]
    output_bytes: int
    """The model's floating-point output on the micro-batch (a loss works on it and its
    gradient in backward)."""
    output_elements: int = 0
    """Elements of that output (a loss may hold float32 copies of it)."""
    kept: list[Stretch] = field(default_factory=list)
    """The measured forward and backward with no block recomputed, stretch by stretch."""
    recomputed: list[Stretch] = field(default_factory=list)
    """The same with every block recomputed."""
    frees: dict[str, int] = field(default_factory=dict)
    """What recomputing each block frees while it is held, measured (kept less recomputed)."""

    def peak_bytes(self, recomputing: Collection[str], loss_bytes: int = 0) -> int:
        """The most live bytes above the model's state in one forward and backward when
        `recomputing` blocks recompute: each stretch from the pass that runs its block as
        chosen, less (or plus) what the held blocks chosen otherwise keep, and `loss_bytes`
        where the loss is alive."""
        chosen = set(recomputing)
        peaks = [
            s.peak_bytes + loss_bytes * s.at_loss - sum(self.frees[b] for b in s.held & chosen)
            for s in self.kept
            if s.running not in chosen
        ] + [
            s.peak_bytes + loss_bytes * s.at_loss + sum(self.frees[b] for b in s.held - chosen)
            for s in self.recomputed
            if s.running in chosen
        ]
        return max(peaks, default=0)


def measure_blocks(model: nn.Module, names: Sequence[str], example: Any) -> BlockProfile:
    """A forward and backward on `example` (the sum of its output as the loss) with no
    block recomputed and again with every block recomputed, counting live tensors.

    Gradients and random and buffer state are left as they were; every rank runs this the
    same way (it may contain the operator split's collectives).
    """
    costs, output = _forward_costs(model, names, example)
    kept, kept_frees = _passes(model, names, example, recompute=False)
    recomputed, recomputed_frees = _passes(model, names, example, recompute=True)
    outputs = [t for t in tensors(output) if t.is_floating_point()]
    return BlockProfile(
        blocks=costs,
        output_bytes=_bytes(outputs),
        output_elements=sum(t.numel() for t in outputs),
        kept=kept,
        recomputed=recomputed,
        frees={n: max(0, kept_frees[n] - recomputed_frees[n]) for n in names},
    )


def _forward_costs(
    model: nn.Module, names: Sequence[str], example: Any
) -> tuple[list[BlockCost], Any]:
    """Each block's forward time, saved bytes (less parameters) and input bytes."""
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
        with (
            _state_kept(model),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, _same),
        ):
            output = call_model(model, example)
    finally:
        for handle in hooks:
            handle.remove()
    blocks = [
        BlockCost(name, elapsed[name], sum(saved[name].values()), inputs[name]) for name in names
    ]
    return blocks, output


def _passes(
    model: nn.Module, names: Sequence[str], example: Any, *, recompute: bool
) -> tuple[list[Stretch], dict[str, int]]:
    """One counted forward and backward; the stretches between block boundaries, and the
    live bytes each block's forward leaves behind."""
    modules = {model.get_submodule(name): name for name in names}
    marks: list[tuple[int, str, str]] = []
    """(sample index, block, 'forward' | 'forward end' | 'backward')."""
    left: dict[str, int] = dict.fromkeys(names, 0)
    device = next(t.device for t in [*tensors(example), *model.parameters()] if not t.is_meta)
    state: Holders = {  # what exists already (views of it are no new bytes)
        "parameters": lambda: [*model.parameters(), *model.buffers()],
        "gradients": lambda: [p.grad for p in model.parameters() if p.grad is not None],
    }
    tracker = LiveTensors(device, state, timeline=True)

    def mark(name: str, what: str) -> None:
        marks.append((len(tracker.samples or []), name, what))

    def before(module: nn.Module, args: Any) -> None:
        left[modules[module]] -= tracker.live_bytes
        mark(modules[module], "forward")

    def after(module: nn.Module, args: Any, output: Any) -> None:
        name = modules[module]
        left[name] += tracker.live_bytes
        mark(name, "forward end")
        for value in tensors(output):
            if value.requires_grad:
                value.register_hook(lambda grad, name=name: mark(name, "backward"))

    hooks = [
        handle
        for module in modules
        for handle in (
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after),
        )
    ]
    own_forward = {module: module.__dict__.get("forward") for module in modules}
    if recompute:
        recompute_blocks(model, names)
    try:
        with _state_kept(model), torch.enable_grad(), tracker:
            base = tracker.live_bytes
            total = _summed(call_model(model, example))
            mark("", "forward end")
            if total.requires_grad:
                total.backward()
            mark("", "backward")
    finally:
        for handle in hooks:
            handle.remove()
        for module, forward in own_forward.items():
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
    return _stretches(tracker.samples or [], marks, base), left


def _summed(output: Any) -> torch.Tensor:
    """The sum of every floating-point output: a loss whose gradient is ones, made as a
    broadcast (no bytes), that keeps nothing of the output."""
    values = [t.sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    return torch.stack(values).sum() if values else torch.zeros(())


def _stretches(
    samples: list[Sample], marks: list[tuple[int, str, str]], base: int
) -> list[Stretch]:
    """Cut the samples at the marks; each stretch knows its running and held blocks."""
    stretches = []
    running: str | None = None
    held: set[str] = set()
    start = 0
    at_loss = False
    backward_begun: set[str] = set()
    for index, name, what in marks:
        if index > start:
            peak = max(sum(s.bytes_by_category) for s in samples[start:index]) - base
            stretches.append(Stretch(peak, running, frozenset(held), at_loss))
        start = index
        if what == "forward":
            running = name
        elif what == "forward end":  # of a block, or of the model (name '')
            running = None
            held |= {name} - {""}
            at_loss = not name
        else:  # a block's backward begins where the one after it (or the loss) ends
            at_loss = not backward_begun and bool(name)
            backward_begun.add(name)
            held.discard(name)
            running = name or None
    return stretches


@contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Run the body and then put back the gradients, buffers and random state it changed."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    for p in parameters:  # the run's gradients live for the whole step: count them as state
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for p, grad in zip(parameters, grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(buffers[name])


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
    unit = need_bytes / 256
    weights = [max(1, int(b.saving_bytes * in_flight / unit + 1e-9)) for b in useful]
    steps = min(256, sum(weights))  # savings rounded down: the full set may fall short of 256
    best: list[tuple[float, tuple[str, ...]] | None] = [None] * (steps + 1)
    best[0] = (0.0, ())
    for block, weight in zip(useful, weights, strict=True):
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
