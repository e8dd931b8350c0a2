"""Token dispatch for expert parallelism: each token's rows to the ranks holding its experts
and the experts' outputs back, by two all-to-alls of variable sizes (counts exchanged first).

Every (token, slot) pair of the router's top-k is one row. Rows are sorted by expert, so
the rows for rank j's experts are one contiguous run; one all-to-all of per-expert counts
tells each rank how many rows it receives from each source for each of its experts, the
second carries the rows. The expert's answers travel back by the reverse all-to-all and are
weighted and summed per token here, where the router's weights live: dropless, so the
result is what one process computes (up to the order of a sum of k terms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []


@dataclass(frozen=True)
class Route:
    """Where this rank's rows go and what it receives, for one call."""

    order: torch.Tensor
    """The (token, slot) rows sorted by expert (indices into the flattened top-k)."""
    kept: torch.Tensor
    """Of `order`, the rows that travel (all of them unless a capacity drops some)."""
    send_counts: list[int]
    receive_counts: list[int]
    local_experts: torch.Tensor
    """The local expert of each received row (0 .. experts per rank - 1)."""
    dropped: int


def route(
    top_k_index: torch.Tensor,
    experts: int,
    group: dist.ProcessGroup,
    capacity_factor: float | None,
) -> Route:
    """Sort this rank's (token, slot) rows by expert, drop what a capacity excludes, and
    learn from the other ranks how many rows of each local expert arrive from each."""
    ranks = dist.get_world_size(group)
    per_rank = experts // ranks
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    kept = order
    dropped = 0
    if capacity_factor is not None:  # Megatron's rule: a cap per expert from each rank
        cap = math.ceil(flat.numel() / experts * capacity_factor)
        keep = places(flat, order, counts) < cap
        kept = order[keep]
        dropped = int((~keep).sum())
        counts = counts.clamp(max=cap)
    received = counts.clone()  # as if every rank routed alike: what a fake group (the
    dist.all_to_all_single(received, counts, group=group)  # estimate) leaves; [source][local]
    send_counts = counts.view(ranks, per_rank).sum(1).tolist()
    by_source = received.view(ranks, per_rank)
    receive_counts = by_source.sum(1).tolist()
    local = torch.arange(per_rank, device=flat.device).repeat(ranks)
    local_experts = torch.repeat_interleave(local, by_source.reshape(-1))
    return Route(order, kept, send_counts, receive_counts, local_experts, dropped)


def places(keys: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each row of `order` (a stable sort of `keys`), its place among the rows of its key
    (0, 1, ...); `counts` holds the rows per key."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(len(order), device=keys.device) - starts[keys[order]]


class AllToAll(torch.autograd.Function):
    """Rows to every rank of `group` in runs of `send` rows, `receive` rows back from each;
    backward sends the gradients the reverse way."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, receive: list[int], send: list[int], group: Any
    ) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        if dist.get_backend(group) == "fake":  # the estimate's group leaves `out` as it was
            out.zero_()  # allocated: garbage would reach later layers (and Llama 4's live rows)
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = AllToAll.apply(grad.contiguous(), ctx.send, ctx.receive, ctx.group)
        return back, None, None, None


def dispatch(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: int,
    group: dist.ProcessGroup,
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    capacity_factor: float | None = None,
) -> tuple[torch.Tensor, int]:
    """sum_k weight_k * expert_{index_k}(token) for every token, the experts spread over
    `group` (`run_local(rows, local_expert)` runs this rank's); and the rows dropped."""
    plan = route(top_k_index, experts, group, capacity_factor)
    k = top_k_index.shape[-1]
    token_of_row = plan.kept // k
    outgoing = hidden_states[token_of_row]
    incoming = AllToAll.apply(outgoing, plan.receive_counts, plan.send_counts, group)
    answers = run_local(incoming, plan.local_experts)
    if incoming.requires_grad and not answers.requires_grad:  # no row came: backward must
        answers = answers + incoming.sum() * 0  # still run both all-to-alls, as elsewhere
    returned = AllToAll.apply(answers, plan.send_counts, plan.receive_counts, group)
    weights = top_k_weights.reshape(-1)[plan.kept].unsqueeze(-1)
    output = torch.zeros(
        hidden_states.shape[0], returned.shape[-1], dtype=returned.dtype, device=returned.device
    )
    output = output.index_add(0, token_of_row, returned * weights.to(returned.dtype))
    return output.to(hidden_states.dtype), plan.dropped
