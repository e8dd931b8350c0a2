"""Non-finite guard (`Plan.nonfinite`): a NaN or infinity in one rank's loss or gradients
becomes the same decision on every rank, before the optimizer steps.

After the gradients are synchronised, each rank checks its loss and its gradients (the
float32 sum of each gradient bucket or shard: a NaN or infinity anywhere makes it
non-finite, and no temporary as large as the gradients is made; a sum past float32's 3.4e38
counts too); one all-reduce over the world tells every rank whether any rank saw one, so
all ranks take the same branch: under 'raise' each raises the same `NonFiniteError` (the
step, the ranks, and on each the first parameter whose gradient went non-finite); under
'skip' every rank drops the update alike. The parameters are untouched either way: the
check runs before the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.job.input_errors import InputError
from meshsplit.mesh import local_tensor

__all__ = ["NonFiniteError"]


class NonFiniteError(FloatingPointError):
    """A loss or gradient went NaN or infinite; the parameters are those before the step."""


def nonfinite_parameter(named: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity."""
    for name, param in named:
        grad = param.grad
        if grad is not None and not bool(torch.isfinite(local_tensor(grad)).all()):
            return name
    return None


def check_step(
    loss: torch.Tensor,
    gradients: list[torch.Tensor],
    named: Iterable[tuple[str, nn.Parameter]],
    *,
    rows: int,
    mode: str,
    step: int,
    where: str,
    group: dist.ProcessGroup | None,
) -> bool:
    """Whether every rank's loss and gradients are finite (a collective over `group`, the
    mesh's processes; None: this rank alone, for workers that do not wait for each other).
    Under mode 'raise' a non-finite one raises NonFiniteError on every rank. The same
    all-reduce compares the global batch each rank was given: ranks fed different batches
    (a DataLoader per rank) raise InputError before the update."""
    sums = [loss.detach().sum(dtype=torch.float32)]
    sums += [local_tensor(g).sum(dtype=torch.float32) for g in gradients]
    bad = not bool(torch.stack(sums).isfinite().all())
    members = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    seen = torch.zeros(2, members, dtype=torch.int64, device=loss.device)
    seen[0, me], seen[1, me] = int(bad), rows
    if group is not None:
        dist.all_reduce(seen, group=group)
    flags, batches = seen[0], seen[1].tolist()
    if len(set(batches)) > 1:
        given = ", ".join(f"rank {r}: {n}" for r, n in enumerate(batches))
        raise InputError(
            f"step {step}: the ranks were given global batches of different sizes ({given} "
            "rows); every rank must call train_step with the same global batch (each takes "
            "its own rows of it): give every rank the same data in the same order (one seed), "
            "not a DataLoader of its own. The update was not applied"
        )
    if not bool(flags.any()):
        return True
    if mode == "skip":
        return False
    mine = ""
    if bad:
        first = nonfinite_parameter(named)
        loss_text = "finite" if bool(torch.isfinite(loss.detach()).all()) else str(loss.item())
        mine = f"{where}: loss {loss_text}" + (
            f", first non-finite gradient: {first}" if first else ", gradients finite"
        )
    reports: list[Any] = [mine]
    if group is not None:
        reports = [None] * members
        dist.all_gather_object(reports, mine, group=group)
    flagged = [r for r, flag in enumerate(flags.tolist()) if flag]
    ranks = flagged if group is not None else [dist.get_rank()]
    raise NonFiniteError(
        f"step {step}: a NaN or infinity on rank(s) {ranks} (gradients synchronised over "
        "dp carry one replica's to all): "
        + "; ".join(str(reports[r]) for r in flagged)
        + ". The parameters are those before this step. Lower the learning rate, clip "
        "gradients or check the batch; Plan(nonfinite='skip') drops such steps instead"
    )
