"""One engine's guard over its steps: a watchdog for its waits, and the errors a step raises
turned into ones that say where and why (the pieces are in watchdog.py and input_errors.py;
the step's agreement on its loss and non-finite values is nonfinite.agree)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from meshsplit.job.context import job_store
from meshsplit.job.input_errors import explain_input_error
from meshsplit.job.watchdog import Watchdog, explain_collective_error, stall_warning_s
from meshsplit.mesh import Mesh

__all__: list[str] = []


class StepGuard:
    """Names this rank's stalls, bad batches and non-finite values; `position` says where
    the engine is (step and phase) for the watchdog's posts."""

    def __init__(self, mesh: Mesh, position: Callable[[], dict[str, Any]]) -> None:
        self.where = (
            f"rank {dist.get_rank()} (dp {mesh.rank('dp')}, pp stage {mesh.rank('pp')}, "
            f"tp {mesh.rank('tp')})"
        )
        """This rank and its place on the mesh, for messages."""
        store = job_store()
        several = dist.is_initialized() and dist.get_world_size() > 1
        self.watchdog = (  # in a job of several ranks that ms.launch runs
            Watchdog(store, self.where, position, warn_s=stall_warning_s())
            if store is not None and several
            else None
        )

    @contextlib.contextmanager
    def naming_timeouts(self) -> Iterator[None]:
        """A wait the process group's timeout ended becomes a CollectiveTimeout that says
        what this rank waited for and where the others were (see watchdog.Watchdog)."""
        try:
            yield
        except RuntimeError as error:
            explained = explain_collective_error(error, self.watchdog)
            if explained is None:
                raise
            raise explained from error

    @contextlib.contextmanager
    def naming_bad_input(self, module: nn.Module, inputs: Any, loss_fn: Any) -> Iterator[None]:
        """An error a layer (or the loss) raises on this batch becomes an InputError naming
        it."""
        try:
            yield
        except Exception as error:
            explained = explain_input_error(error, module, inputs, self.where, {"loss_fn": loss_fn})
            if explained is None:
                raise
            raise explained from error

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
