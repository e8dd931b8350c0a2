"""Gradients each tp rank holds only its share of, summed over tp once backward is done.

A layer kept whole that runs inside a split pair (Qwen3's per-head q_norm between q_proj and
o_proj, inside.py) computes on each rank's slice of the activations with the whole weights:
each rank's gradient of those weights is its slice's share, and their sum over tp is what one
process computes (Hugging Face's plans call this style replicated_with_grad_allreduce). One
flat all-reduce a step, after the dp sync, since the sums over dp and tp commute, and a
deferred weight-gradient pass (zero bubble) has run by then. Under ZeRO 2/3 each rank sums
its shard: the tp ranks of one dp rank hold the same shard of these weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from meshsplit.mesh import local_tensor
from meshsplit.tensor.units import Decision

__all__: list[str] = []


class TpGradientSum:
    """Sums over the tp `group` the gradients of this rank's parameters named in `names`."""

    def __init__(
        self, names: Iterable[str], held: Mapping[torch.Tensor, str], group: dist.ProcessGroup
    ) -> None:
        wanted = set(names)
        self.parameters = [p for p, name in held.items() if name in wanted]
        """This rank's (this stage's) parameters whose gradients are summed."""
        self.group = group

    @classmethod
    def of(
        cls,
        decisions: Iterable[Decision],
        held: Mapping[torch.Tensor, str],
        group: dist.ProcessGroup,
    ) -> TpGradientSum | None:
        """The sum the operator split's `decisions` ask for, over the parameters this rank
        `held` (tensor -> name in the model); None when it holds none."""
        summed = TpGradientSum((n for d in decisions for n in d.summed), held, group)
        return summed if summed.parameters else None

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Every tp rank sums the same parameters; one that got no gradient adds zeros."""
        grads = [None if p.grad is None else local_tensor(p.grad) for p in self.parameters]
        pieces = [
            torch.zeros_like(local_tensor(p)).reshape(-1) if g is None else g.reshape(-1)
            for p, g in zip(self.parameters, grads, strict=True)
        ]
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=self.group)
        for grad, summed in zip(grads, flat.split([p.numel() for p in pieces]), strict=True):
            if grad is not None:
                grad.copy_(summed.view_as(grad))
