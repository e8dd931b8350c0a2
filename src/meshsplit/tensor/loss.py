"""Cross-entropy on logits that stay split over the vocabulary, so they are never gathered.

Rank i holds the logits z_i of its vocabulary block; per position

    loss = log sum_v exp(z_v - m) - (z_t - m),   m = max_v z_v (for stability only)

m is an all-reduce (max) with no gradient and the two vocabulary sums close with
`reduce_from_tp`, so each rank's gradient is softmax(z)_i - onehot(t)_i on its own block.
Rationale: docs/internals.md#tensorlosspy
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshsplit.tensor.collectives import reduce_from_tp
from meshsplit.tensor.staged import all_reduce_fresh

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V/tp), split by vocabulary block, against ids (...);
    in float32 whatever the logits' dtype, as F.cross_entropy under autocast."""
    logits = logits.float()
    rows = logits.shape[-1]
    start = dist.get_rank(group) * rows
    peak = all_reduce_fresh(logits.detach().amax(dim=-1), group, op=dist.ReduceOp.MAX)
    shifted = logits - peak.unsqueeze(-1)
    total = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    local = targets - start
    owned = (local >= 0) & (local < rows)
    picked = shifted.gather(-1, torch.where(owned, local, 0).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp(picked * owned.to(picked.dtype), group)
    return (total.log() - target_logit).mean()
