"""Parameters that several stages use (tied input and output embeddings), kept in step.

Each stage that uses such a parameter keeps its own copy. After backward, the copies'
gradients are summed over exactly those stages (one all-reduce per parameter, within each
dp replica and tp rank), which is the gradient one process computes for the shared tensor;
every copy then takes the same optimizer step, so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.mesh import Mesh

__all__: list[str] = []


class TiedGradients:
    """Sums the gradients of this stage's shared parameters over the stages that hold them."""

    def __init__(
        self, shared: Sequence[tuple[str, tuple[int, ...], nn.Parameter]], mesh: Mesh
    ) -> None:
        self.names = [name for name, _, _ in shared]
        self._mine: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        grid = mesh.device_mesh.mesh
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for _, stages, param in shared:
            if stages not in groups:
                groups[stages] = None
                # every rank creates every group, in the same order (new_group is collective)
                for dp in range(mesh.size("dp")):
                    for tp in range(mesh.size("tp")):
                        ranks = [int(grid[dp, stage, tp]) for stage in stages]
                        group = mesh.new_group(ranks)
                        if dist.get_rank() in ranks:
                            groups[stages] = group
            mine = groups[stages]
            if mine is not None:
                self._mine.append((param, mine))

    @property
    def parameters(self) -> list[nn.Parameter]:
        """This stage's copies of shared parameters (kept whole: their gradients meet)."""
        return [param for param, _ in self._mine]

    def all_reduce(self) -> None:
        """Every stage that holds a shared parameter joins its sum, also one whose copy got
        no gradient this step (its part is zero), so no stage waits for one that skipped."""
        for param, group in self._mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
