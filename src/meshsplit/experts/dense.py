"""Experts that every token runs (Llama 4): the router scales each token's input once per
expert, zero for the experts it did not choose, and the experts module takes all of those
rows, expert-major (`experts(routed)`, routed of shape (experts x tokens, hidden)).

Under ep only the rows that are not zero travel, each to the rank holding its expert, as one
top-1 row each (dispatch.py). Leaving the zero rows out changes no number: these experts have
no biases and a gated activation that is zero at zero, so a zero row's answer is zero and so
is its input gradient; the work and the traffic shrink from experts x tokens rows to the
tokens' top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshsplit.experts.dispatch import dispatch, places

__all__: list[str] = []

DENSE_EXPERTS = ("Llama4TextExperts",)
"""Experts classes called as experts(routed) on every token's scaled rows, by class name
(the call alone does not say that rows are expert-major and zero where unchosen)."""


def is_dense(cls: type) -> bool:
    """Whether experts of class `cls` (or of a class it derives from) run every token (see
    DENSE_EXPERTS)."""
    return any(base.__name__ in DENSE_EXPERTS for base in cls.__mro__)


def live_rows(routed: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every row of `routed` that is not zero, sorted by expert."""
    with torch.no_grad():
        live = routed.reshape(experts, -1, routed.shape[-1]).ne(0).any(-1)
        expert_of, token_of = live.nonzero(as_tuple=True)
    return expert_of, token_of


def dense_dispatch(
    routed: torch.Tensor,
    experts: int,
    group: dist.ProcessGroup,
    local_forward: Callable[[torch.Tensor], torch.Tensor],
    capacity_factor: float | None,
) -> tuple[torch.Tensor, int]:
    """What `experts(routed)` returns on one process, the experts spread over `group`
    (`local_forward` runs this rank's on expert-major rows); and the rows dropped."""
    hidden = routed.shape[-1]
    grid = routed.reshape(experts, -1, hidden)
    expert_of, token_of = live_rows(routed, experts)
    rows = grid[expert_of, token_of]
    index = expert_of.unsqueeze(-1)
    ones = torch.ones(index.shape, dtype=routed.dtype, device=routed.device)

    def run_local(arrived: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return _expert_major(arrived, local, experts // dist.get_world_size(group), local_forward)

    answers, dropped = dispatch(rows, index, ones, experts, group, run_local, capacity_factor)
    output = torch.zeros_like(grid, dtype=answers.dtype).index_put((expert_of, token_of), answers)
    return output.view(-1, hidden), dropped


def _expert_major(
    rows: torch.Tensor,
    local: torch.Tensor,
    per_rank: int,
    local_forward: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`local_forward` on `rows` laid out as the module takes them: per local expert, its
    rows in arrival order, padded with zero rows to the busiest expert's count (at least
    one: the module cannot lay out zero rows, and backward needs its graph all the same)."""
    counts = torch.bincount(local, minlength=per_rank)
    width = max(1, int(counts.max()) if len(local) else 0)
    order = torch.argsort(local, stable=True)
    position = torch.empty_like(local)
    position[order] = places(local, order, counts)
    grid = rows.new_zeros((per_rank, width, rows.shape[-1]))
    grid = grid.index_put((local, position), rows)
    answers = local_forward(grid.view(-1, rows.shape[-1])).view(per_rank, width, -1)
    return answers[local, position]
