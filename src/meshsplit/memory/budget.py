"""Plan.memory_budget on one rank, before its first step: refuse what cannot fit, and pick
what 'auto' recomputes so the rest does.

What a rank holds for good is known exactly once the model is split; the activations per
micro-batch in flight are measured on the example. The figures are a floor: the run enforces
the budget (tracker.py) and `ms.estimate_memory` simulates the whole step.
Rationale: docs/internals.md#memorybudgetpy
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from meshsplit.memory.recompute import BlockProfile, choose_blocks
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
    refuse: bool = True,
) -> RankBudget:
    """Refuse a rank whose lasting state alone passes its budget; under 'auto' choose the
    blocks whose recompute brings the activations under it, or refuse if none can
    (`refuse=False`: say what is needed instead, recomputing all that helps).

    Backward's working set is taken as one block's saved tensors (rematerialised when it
    recomputes) plus twice the model's output (the loss's input and its gradient).
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
    saved = in_flight * sum(b.saved_bytes for b in blocks)
    working = max((b.saved_bytes for b in blocks), default=0)
    working += 2 * (profile.output_bytes if profile else 0)
    chosen = choose_blocks(blocks, in_flight, held + saved + working - budget_bytes) if auto else []
    picked = [b for b in blocks if b.name in chosen]
    activations = saved - in_flight * sum(b.saving_bytes for b in picked)
    result = RankBudget(
        budget_bytes=budget_bytes,
        static=static,
        in_flight=in_flight,
        activation_bytes=activations,
        working_bytes=working,
        recompute=chosen,
        added_forward_ms=sum(b.forward_ms for b in picked),
    )
    if refuse and auto and result.need_bytes > budget_bytes:
        raise PlanError(
            f"{where} needs {format_bytes(result.need_bytes)} even with recompute='auto' "
            f"recomputing all {len(chosen)} blocks that save anything "
            f"({describe_breakdown(static)}, activations {format_bytes(activations)} for "
            f"{in_flight} micro-batches in flight, backward working set "
            f"{format_bytes(working)}), over Plan.memory_budget {format_bytes(budget_bytes)}; "
            "use more micro-batches, a larger pp or tp, or raise the budget"
        )
    return result
