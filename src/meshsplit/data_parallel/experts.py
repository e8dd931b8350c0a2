"""The gradient sync of a model whose experts are split over ep (Plan.ep).

An ep rank holds 1/ep of each experts module, and the dp ranks that hold the same experts
(dp / ep of them) each saw their own tokens for them: expert gradients are summed over that
smaller group, every other gradient over dp as without experts (in buckets, or sharded by
ZeRO 2/3 with the experts left out of its units). Two syncs, one interface.
"""

from __future__ import annotations

import torch

from meshsplit.data_parallel.allreduce import GradientSync, LocalGradients
from meshsplit.data_parallel.zero import ShardedGradients

Part = GradientSync | LocalGradients | ShardedGradients
"""A sync of some of the parameters."""

__all__: list[str] = []


class WithExperts:
    """The dense parameters' sync and the experts' sync, stepped together."""

    def __init__(self, dense: Part | WithExperts, experts: Part) -> None:
        self.dense = dense
        self.experts = experts

    def begin_step(self, backward_passes: int) -> None:
        self.dense.begin_step(backward_passes)
        self.experts.begin_step(backward_passes)

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [*self.dense.gradient_tensors(), *self.experts.gradient_tensors()]

    def gradient_sums(self) -> list[torch.Tensor]:
        return [*self.dense.gradient_sums(), *self.experts.gradient_sums()]

    def gradient_bytes(self) -> int:
        return self.dense.gradient_bytes() + self.experts.gradient_bytes()

    def newest_parameters(self) -> None:
        """Nothing to do: each group's replicas applied the same summed gradients."""

    def close(self) -> None:
        self.dense.close()
        self.experts.close()
