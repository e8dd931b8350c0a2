"""What every part of a running job shares, apart from how the job was launched: the job's
key-value store, the hooks a worker runs before it leaves, and whether torchrun started it.

The launcher (launch.py) fills this in as a worker joins and runs the hooks as it ends; the
parts that need it (a watchdog, parameter servers, the engine) read it here, without
importing the launcher.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__: list[str] = []


class LeaveJob(BaseException):  # noqa: N818 - not an error: a role that ended early
    """Raised in a worker whose part is over before the job's function returns (a parameter
    server once every worker is done): the launcher takes `result` as its return value."""

    def __init__(self, result: Any) -> None:
        super().__init__("this rank's part of the job is over")
        self.result = result


_before_exit: list[Callable[[], None]] = []
"""What a worker must do after the job's function and before the job's last barrier."""


def before_exit(callback: Callable[[], None]) -> None:
    """Run `callback` in this worker once the job's function is over, before its last
    barrier (a parameter-server worker tells its servers it is done)."""
    _before_exit.append(callback)


def run_job(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """fn's value in this worker (or the result of a role that left the job early), once
    the exit hooks have run."""
    try:
        result = fn(*args, **kwargs)
    except LeaveJob as leave:
        result = leave.result
    while _before_exit:
        _before_exit.pop()()
    return result


_job_stores: list[dist.Store] = []
"""The key-value stores of the jobs this worker joined, the current one last (a watchdog
posts where each rank is)."""


def join_job_store(store: dist.Store) -> None:
    """Make `store` the job's store for this worker from now on."""
    _job_stores.append(store)


def jobs_joined() -> int:
    """How many jobs this process has joined (a Trainer's fits run one after another)."""
    return len(_job_stores)


def job_store() -> dist.Store | None:
    """The job's store, in a worker that ms.launch started or joined; else None."""
    return _job_stores[-1] if _job_stores else None


def in_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
