"""The exchange that ends every step: the global mean loss, whether every rank's loss and
gradients are finite, and whether every rank had the same batch (job/nonfinite.py says what
the numbers mean).

Under data parallel alone the numbers ride the first gradient bucket's all-reduce, which
runs anyway: a small all-reduce of its own cost about a millisecond on gloo, a tenth of a
small model's step. Every other plan sends them in one all-reduce over the mesh after the
gradient sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshsplit.data_parallel import Sync
from meshsplit.data_parallel.allreduce import GradientSync
from meshsplit.job.nonfinite import Agreed, agree, agree_carried, riders
from meshsplit.mesh import Mesh
from meshsplit.pipeline.schedules import chunk_ranks
from meshsplit.plan import Plan
from meshsplit.runtime.runner import LocalRunner, Runner

__all__: list[str] = []


def loss_share(plan: Plan, mesh: Mesh, global_rows: int, replica_rows: int) -> float:
    """What this rank's loss counts in the sum over the mesh: each replica's loss is held
    alike by its tp ranks (of the stage running the last chunk, under pp: pp-1, or 0 under
    'zbv'); workers apart report their own replica's mean."""
    if plan.asynchronous:
        return global_rows / replica_rows
    if mesh.rank("pp") != chunk_ranks(plan.pp, plan.virtual_stages, plan.schedule)[-1]:
        return 0.0
    return 1.0 / plan.tp


def _riding(sync: Sync) -> GradientSync | None:
    """The gradient sync whose first bucket carries the numbers, if this plan's does."""
    return sync if isinstance(sync, GradientSync) and sync.riders else None


def begin(
    sync: Sync, runner: Runner, *, share: float, rows: int, plan: Plan, overflow_skips: bool
) -> None:
    """Before forward: tell a carrying gradient sync what its riders are (read when its
    first bucket's all-reduce starts, after every micro-batch's loss is known)."""
    carrying = _riding(sync)
    if carrying is None:
        return
    assert isinstance(runner, LocalRunner), "riders go with data parallel alone"

    def numbers() -> torch.Tensor:
        return riders(
            runner.loss_so_far,
            loss_scale=share,
            rows=rows,
            mode=plan.nonfinite,
            overflow_skips=overflow_skips,
        )

    carrying.carry = numbers


def finish(
    sync: Sync,
    runner: Runner,
    loss: torch.Tensor,
    *,
    share: float,
    rows: int,
    plan: Plan,
    step: int,
    where: str,
    group: dist.ProcessGroup | None,
    overflow_skips: bool,
    on_host: bool = True,
) -> Agreed:
    """After the gradient sync: what every rank agrees on (or the error every rank raises);
    the loss left a tensor where `on_host` is off and nothing is to be decided."""
    named = runner.module.named_parameters()
    carrying = _riding(sync)
    if carrying is not None:
        return agree_carried(
            carrying.carried(), loss, sync.gradient_sums, named, rows=rows,
            mode=plan.nonfinite, step=step, where=where, group=carrying.group,
            overflow_skips=overflow_skips, on_host=on_host,
        )  # fmt: skip
    return agree(
        loss, sync.gradient_sums, named, loss_scale=share, rows=rows, mode=plan.nonfinite,
        step=step, where=where, group=group, overflow_skips=overflow_skips, on_host=on_host,
    )  # fmt: skip
