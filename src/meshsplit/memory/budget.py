"""Plan.memory_budget on one rank, before its first step: refuse what cannot fit, and pick
what 'auto' recomputes so the rest does.

What a rank holds for good is known exactly once the model is split; the activations are
measured on the example: the whole model's forward and backward peak (pp = 1), or a stage's
saved bytes per micro-batch in flight. The run enforces the budget (tracker.py) and
`ms.estimate_memory` simulates the whole step.
Rationale: docs/internals.md#memorybudgetpy
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from meshsplit.memory.recompute import BlockCost, BlockProfile, choose_blocks
from meshsplit.memory.report import optimizer_bytes
from meshsplit.memory.tracker import Holders, LiveTensors, describe_breakdown, format_bytes
from meshsplit.plan import PlanError

__all__: list[str] = []

_PROBE_SIZES = (1024, 2048)


@dataclass(frozen=True)
class OptimizerNeed:
    state_bytes: int
    """What the optimizer holds after its first step."""
    step_bytes: int
    """What its step allocates for a moment on top (foreach kernels' temporaries)."""


def optimizer_need(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    shards: int = 1,
) -> OptimizerNeed:
    """What the optimizer will hold for `params` (1/shards under ZeRO), learnt from probe
    steps: state bytes per element and per parameter from one parameter of two sizes; the
    step's momentary bytes from one parameter and from two, which tells an optimizer that
    works on all parameters at once (foreach) from one that works on one at a time."""
    low, high = _PROBE_SIZES
    try:
        one_low, state_low = _probe(make_optimizer, [low])
        one_high, state_high = _probe(make_optimizer, [high])
        two_low, _ = _probe(make_optimizer, [low, low])
    except Exception:  # an optimizer that needs a closure (LBFGS): no prediction
        return OptimizerNeed(0, 0)
    trainable = [p for p in params if p.requires_grad]
    state = _scaled([state_low, state_high], trainable) // shards
    per_element = (one_high - one_low) / (high - low)
    all_at_once = two_low > 1.5 * one_low
    sizes = [p.nbytes for p in trainable] or [0]
    counted = sum(sizes) // shards if all_at_once else max(sizes)
    return OptimizerNeed(state, int(per_element * counted / 4))


def _probe(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], sizes: list[int]
) -> tuple[int, int]:
    """(momentary, lasting) bytes of one step on zero parameters of `sizes` (float32)."""
    probes = [nn.Parameter(torch.zeros(size)) for size in sizes]
    optimizer = make_optimizer(probes)
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    held: Holders = {
        "parameters": lambda: [t for p in probes for t in (p, p.grad) if t is not None]
    }
    with LiveTensors(torch.device("cpu"), held) as tracker:
        optimizer.step()
    lasting = optimizer_bytes(optimizer)
    return max(0, tracker.peak.bytes - 2 * sum(p.nbytes for p in probes) - lasting), lasting


def _scaled(measured: list[int], params: Sequence[torch.Tensor]) -> int:
    """Bytes for `params` from bytes measured on the float32 probes."""
    low, high = _PROBE_SIZES
    per_element = (measured[1] - measured[0]) / (high - low)
    per_parameter = max(0.0, measured[0] - per_element * low)
    return int(sum(per_element * p.nbytes / 4 + per_parameter for p in params))


@dataclass
class RankBudget:
    """What this rank needs against its budget, and what 'auto' chose to recompute."""

    budget_bytes: int
    static: dict[str, int]
    """parameters, gradients and optimizer bytes, held for the whole run."""
    in_flight: int
    """Micro-batches whose activations this rank holds at once (its schedule's peak)."""
    activation_bytes: int
    """Saved activations of those micro-batches, after recompute."""
    working_bytes: int
    """Backward's working set on top (see fit_budget)."""
    recompute: list[str] = field(default_factory=list)
    """Blocks chosen to recompute ('auto')."""
    added_forward_ms: float = 0.0
    """Forward time recompute adds per micro-batch."""

    @property
    def need_bytes(self) -> int:
        """The predicted backward peak: lasting state, activations, working set."""
        return sum(self.static.values()) + self.activation_bytes + self.working_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "need_bytes": self.need_bytes}


PEAK_MARGIN = 0.05
"""Room kept between a measured backward peak and the budget: a step's live bytes vary by a
few percent from the profiled pass (communication temporaries, allocation order)."""


def fit_budget(
    *,
    where: str,
    budget_bytes: int,
    static: dict[str, int],
    optimizer_step_bytes: int,
    profile: BlockProfile | None,
    local_blocks: Sequence[str],
    in_flight: int,
    auto: bool,
    weight_copy_bytes: int = 0,
    refuse: bool = True,
) -> RankBudget:
    """Refuse a rank whose lasting state alone passes its budget; under 'auto' choose the
    blocks whose recompute brings its peak under it, or refuse, naming the budget that fits
    (`refuse=False`: say what is needed instead, recomputing all that helps).

    With the whole model here and one micro-batch in flight the peak is the profile's
    measured forward and backward; a pipeline stage's is its saved tensors per micro-batch in
    flight plus one block's and twice the model's output (the loss's input and gradient).
    `weight_copy_bytes`: autocast's low-precision copies of the weights, alive in a step.
    """
    held = sum(static.values())
    if refuse and held + optimizer_step_bytes > budget_bytes:
        raise PlanError(
            f"{where} holds {format_bytes(held)} before any activation "
            f"({describe_breakdown(static)}; the optimizer step adds "
            f"{format_bytes(optimizer_step_bytes)}), over Plan.memory_budget "
            f"{format_bytes(budget_bytes)}; split the model further (larger pp or tp), shard "
            "the optimizer state (zero=True) or raise the budget"
        )
    blocks = [b for b in profile.blocks if b.name in local_blocks] if profile else []
    estimate: _MeasuredPeak | _StagePeak
    chosen: list[str] = []
    if (
        profile is not None
        and profile.kept
        and in_flight == 1
        and len(blocks) == len(profile.blocks)
    ):
        estimate = _MeasuredPeak(profile, held, weight_copy_bytes)
        if auto:
            chosen = _choose(estimate, blocks, budget_bytes)
    else:
        estimate = _StagePeak(blocks, profile, held, in_flight)
        if auto:
            room = int(budget_bytes / (1 + PEAK_MARGIN))
            chosen = choose_blocks(blocks, in_flight, estimate.need([]) - room)
    picked = [b for b in blocks if b.name in chosen]
    activations, working = estimate.parts(chosen)
    result = RankBudget(
        budget_bytes=budget_bytes,
        static=static,
        in_flight=in_flight,
        activation_bytes=activations,
        working_bytes=working,
        recompute=chosen,
        added_forward_ms=sum(b.forward_ms for b in picked),
    )
    if refuse and auto and _with_margin(result.need_bytes) > budget_bytes:
        fitting = -(-_with_margin(result.need_bytes) // 1024)
        raise PlanError(
            f"{where} needs {format_bytes(result.need_bytes)} even with recompute='auto' "
            f"recomputing all {len(chosen)} blocks that save anything "
            f"({describe_breakdown(static)}, activations {format_bytes(activations)} for "
            f"{in_flight} micro-batches in flight, backward working set "
            f"{format_bytes(working)}), over Plan.memory_budget {format_bytes(budget_bytes)}; "
            f"memory_budget='{fitting}KiB' fits ({PEAK_MARGIN:.0%} kept for the run's "
            "variation), or use more micro-batches, a larger pp or tp"
        )
    return result


def _with_margin(need_bytes: int) -> int:
    return int(need_bytes * (1 + PEAK_MARGIN))


class _MeasuredPeak:
    """The whole model's peak when some blocks recompute: the lasting state, the profile's
    measured forward and backward, a loss's float32 copies of the output, weight copies."""

    def __init__(self, profile: BlockProfile, held: int, weight_copy_bytes: int) -> None:
        self.profile, self.held, self.weight_copies = profile, held, weight_copy_bytes
        self.loss = 2 * 4 * profile.output_elements

    def frees(self, block: BlockCost) -> int:
        return self.profile.frees.get(block.name, 0)

    def parts(self, chosen: Sequence[str]) -> tuple[int, int]:
        return self.profile.peak_bytes(chosen, self.loss), self.weight_copies

    def need(self, chosen: Sequence[str]) -> int:
        return self.held + sum(self.parts(chosen))


class _StagePeak:
    """A pipeline stage's peak: saved tensors of the micro-batches in flight, one block's
    rematerialised and the model's output twice (the loss's input and its gradient)."""

    def __init__(
        self, blocks: Sequence[BlockCost], profile: BlockProfile | None, held: int, in_flight: int
    ) -> None:
        self.blocks, self.held, self.in_flight = blocks, held, in_flight
        self.working = max((b.saved_bytes for b in blocks), default=0)
        self.working += 2 * (profile.output_bytes if profile else 0)

    def parts(self, chosen: Sequence[str]) -> tuple[int, int]:
        saved = sum(b.input_bytes if b.name in chosen else b.saved_bytes for b in self.blocks)
        return self.in_flight * saved, self.working

    def need(self, chosen: Sequence[str]) -> int:
        return self.held + sum(self.parts(chosen))


def _choose(estimate: _MeasuredPeak, blocks: Sequence[BlockCost], budget_bytes: int) -> list[str]:
    """Add the block that lowers the need most per millisecond of forward until it fits (all
    that free anything when none do), then drop the slowest ones it fits without."""

    def fits(chosen: list[str]) -> bool:
        return _with_margin(estimate.need(chosen)) <= budget_bytes

    remaining = [b for b in blocks if estimate.frees(b) > 0]
    chosen: list[str] = []
    while remaining and not fits(chosen):
        need = estimate.need(chosen)
        best = max(
            remaining,
            key=lambda b: (
                (need - estimate.need([*chosen, b.name])) / max(b.forward_ms, 1e-3),
                estimate.frees(b),
            ),
        )
        chosen.append(best.name)
        remaining.remove(best)
    if not fits(chosen):
        return chosen
    for block in sorted(blocks, key=lambda b: -b.forward_ms):
        fewer = [name for name in chosen if name != block.name]
        if block.name in chosen and fits(fewer):
            chosen = fewer
    return chosen
