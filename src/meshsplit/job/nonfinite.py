"""Non-finite guard (`Plan.nonfinite`): a NaN or infinity in one rank's loss or gradients
becomes the same decision on every rank, before the optimizer steps.

After the gradients are synchronised, each rank checks its loss and its gradients (the
float32 sum of each gradient bucket or shard: a NaN or infinity anywhere makes it
non-finite, and no temporary as large as the gradients is made; when a sum is not finite
with a finite loss, each gradient is looked at element by element before the step is called
non-finite, as a sum of finite values past 3.4e38 would be too); the all-reduce that carries
the step's loss to every rank carries that flag too, before the optimizer steps, so the
check adds no collective and no host sync of its own, and all ranks take the same branch:
under 'raise' each raises the same `NonFiniteError` (the step, the ranks, and on each the
first parameter whose gradient went non-finite); under 'skip' every rank drops the update
alike. The parameters are untouched either way: the check runs before the step. Under data
parallel alone (every rank holds the same summed gradients) the loss, the loss flag and the
batch check ride the first gradient bucket's all-reduce instead (`riders`, `agree_carried`):
no collective of their own at all, and each rank looks at the whole summed gradients, which
are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Agreed:
    """What every rank of a step agreed on, in one all-reduce."""

    loss: float | torch.Tensor
    """The global batch's mean loss: a float, or a 0-dim tensor where it was not read on
    the host (`on_host=False` with nothing else to decide)."""
    finite: bool
    """Whether every rank's loss and gradients were finite (always True under 'off'
    without a loss scale)."""


RIDERS = 10
"""Numbers each rank adds to a step's exchange when they ride a gradient bucket: its share of
the loss, 1 if its loss is not finite, and its global batch's rows as four base-64 digits with
their squares (each sum exact in float32 up to 2**24 rows over 4096 ranks)."""


def riders(
    loss: torch.Tensor, *, loss_scale: float, rows: int, mode: str, overflow_skips: bool
) -> torch.Tensor:
    """This rank's RIDERS numbers, as a float32 tensor beside its loss (no host sync)."""
    mine = loss.detach().to(torch.float32) * loss_scale
    bad_loss = torch.zeros_like(mine)
    if mode != "off" or overflow_skips:
        bad_loss = (~mine.isfinite()).to(torch.float32)
    digits = [(rows >> (6 * k)) & 63 for k in range(4)]
    counts = mine.new_tensor(digits + [d * d for d in digits])
    return torch.cat([torch.stack([mine, bad_loss]), counts])


def agree_carried(
    carried: torch.Tensor,
    loss: torch.Tensor,
    gradient_sums: Callable[[], list[torch.Tensor]],
    named: Iterable[tuple[str, nn.Parameter]],
    *,
    rows: int,
    mode: str,
    step: int,
    where: str,
    group: dist.ProcessGroup,
    overflow_skips: bool = False,
    on_host: bool = True,
) -> Agreed:
    """`agree` for ranks that all hold the same summed gradients (data parallel alone), its
    numbers already summed as `carried` riders: the gradients are looked at here, whole,
    and every rank sees the same; one host sync, for the loss (none without `on_host` when
    there is nothing to decide)."""
    if _undecided(on_host, mode, overflow_skips):
        return Agreed(loss=carried[0].to(torch.float64), finite=True)
    bad_loss, bad_grads = _local_flags(loss, gradient_sums, mode, overflow_skips)
    values = torch.cat([carried.to(torch.float64), bad_grads.reshape(1)]).tolist()
    total, losses_flagged, grads_flagged = values[0], values[1], values[-1]
    members = dist.get_world_size(group)
    sums, squares = values[2:6], values[6:10]
    same_batch = all(members * q == s * s for s, q in zip(sums, squares, strict=True))
    return _decide(
        total, losses_flagged, grads_flagged, same_batch,
        loss_flag=bad_loss, grads_flag=bad_grads, rows=rows, mode=mode, step=step,
        where=where, group=group, named=named, overflow_skips=overflow_skips, loss=loss,
    )  # fmt: skip


def agree(
    loss: torch.Tensor,
    gradient_sums: Callable[[], list[torch.Tensor]],
    named: Iterable[tuple[str, nn.Parameter]],
    *,
    loss_scale: float,
    rows: int,
    mode: str,
    step: int,
    where: str,
    group: dist.ProcessGroup | None,
    overflow_skips: bool = False,
    on_host: bool = True,
) -> Agreed:
    """The step's mean loss, whether it is finite everywhere, and that every rank of `group`
    (the mesh's processes; None: this rank alone) had the same global batch: one all-reduce
    of five numbers and one host sync, the one returning the loss needs anyway.

    Each rank adds loss * loss_scale (its share of the global mean), 1 if its loss is not
    finite, 1 if a gradient is not (neither looked at under mode 'off'), its rows and their
    square: the ranks had the same batch iff members * sum(rows^2) == sum(rows)^2. With
    `overflow_skips` (fp16's loss scale) gradients are always looked at, and non-finite
    gradients of a finite loss are the scale's overflow: the step is skipped, whatever the
    mode. Otherwise, on a non-finite step, 'raise' raises NonFiniteError on every rank;
    ranks fed different batches (a DataLoader per rank) raise InputError before the update.
    'off' looks at neither (the memory estimate replays steps on collectives that do not
    sum). Without `on_host`, under 'off' and with no loss scale (nothing to decide), the
    loss is all-reduced alone and returned as a tensor: no host sync at all."""
    mine = loss.detach().to(torch.float64) * loss_scale
    if _undecided(on_host, mode, overflow_skips):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(mine, group=group)
        return Agreed(loss=mine, finite=True)
    bad_loss, bad_grads = _local_flags(loss, gradient_sums, mode, overflow_skips)
    packet = torch.stack(
        [mine, bad_loss, bad_grads, mine.new_tensor(rows), mine.new_tensor(rows * rows)]
    )
    members = 1 if group is None else dist.get_world_size(group)
    if members > 1:
        dist.all_reduce(packet, group=group)
    total, losses_flagged, grads_flagged, row_sum, square_sum = packet.tolist()
    return _decide(
        total, losses_flagged, grads_flagged, members * square_sum == row_sum * row_sum,
        loss_flag=bad_loss, grads_flag=bad_grads, rows=rows, mode=mode, step=step,
        where=where, group=group, named=named, overflow_skips=overflow_skips, loss=loss,
    )  # fmt: skip


def _undecided(on_host: bool, mode: str, overflow_skips: bool) -> bool:
    """Whether the step has nothing to decide on the host: the loss may stay a tensor."""
    return not on_host and mode == "off" and not overflow_skips


def _local_flags(
    loss: torch.Tensor,
    gradient_sums: Callable[[], list[torch.Tensor]],
    mode: str,
    overflow_skips: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1.0 (float64) where this rank's loss, or its gradients' sums, are not finite; zeros
    when neither is looked at (mode 'off' without a loss scale)."""
    bad_loss = torch.zeros((), dtype=torch.float64, device=loss.device)
    if mode == "off" and not overflow_skips:
        return bad_loss, bad_loss
    bad_loss = (~loss.detach().sum(dtype=torch.float32).isfinite()).to(torch.float64)
    sums = gradient_sums()  # none where this rank holds no gradient (an empty shard)
    if sums:
        bad_grads = (~torch.stack(sums).isfinite().all()).to(torch.float64)
    else:
        bad_grads = torch.zeros_like(bad_loss)
    return bad_loss, bad_grads


def _decide(
    total: float,
    losses_flagged: float,
    grads_flagged: float,
    same_batch: bool,
    *,
    loss_flag: torch.Tensor,
    grads_flag: torch.Tensor,
    rows: int,
    mode: str,
    step: int,
    where: str,
    group: dist.ProcessGroup | None,
    named: Iterable[tuple[str, nn.Parameter]],
    overflow_skips: bool,
    loss: torch.Tensor,
) -> Agreed:
    """What the summed numbers mean, the same on every rank: go on, skip, or raise."""
    if mode != "off" and not same_batch:
        given = ", ".join(f"rank {r}: {n}" for r, n in enumerate(_gathered(rows, group)))
        raise InputError(
            f"step {step}: the ranks were given global batches of different sizes ({given} "
            "rows); every rank must call train_step with the same global batch (each takes "
            "its own rows of it): give every rank the same data in the same order (one seed), "
            "not a DataLoader of its own. The update was not applied"
        )
    if grads_flagged and not losses_flagged:
        named = list(named)
        if not any(_gathered(nonfinite_parameter(named) is not None, group)):
            grads_flagged = 0  # finite gradients whose float32 sum went past 3.4e38
    if losses_flagged == 0 and grads_flagged == 0:
        return Agreed(loss=total, finite=True)
    if mode in ("skip", "off") or (overflow_skips and losses_flagged == 0):
        return Agreed(loss=total, finite=False)
    report = ""
    if bool(loss_flag + grads_flag):
        first = nonfinite_parameter(named)
        finite = bool(torch.isfinite(loss.detach()).all())
        loss_text = "finite" if finite else str(loss.item())
        report = f"{where}: loss {loss_text}" + (
            f", first non-finite gradient: {first}" if first else ", gradients finite"
        )
    reports = _gathered(report, group)
    ranks = [r for r, text in enumerate(reports) if text]
    if group is None:
        ranks = [dist.get_rank()]
    raise NonFiniteError(
        f"step {step}: a NaN or infinity on rank(s) {ranks} (gradients synchronised over "
        "dp carry one replica's to all): "
        + "; ".join(text for text in reports if text)
        + ". The parameters are those before this step. Lower the learning rate, clip "
        "gradients or check the batch; Plan(nonfinite='skip') drops such steps instead"
    )


def _gathered(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's `value`, in rank order of `group` (this rank's alone without one): only
    on the error paths, which every rank takes together."""
    if group is None:
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values
