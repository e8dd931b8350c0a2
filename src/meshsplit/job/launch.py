"""Run a function in N local worker processes (or join a torchrun job); a failure ends the job.

Local workers meet through a `torch.distributed.TCPStore` that this process hosts on a free
port of 127.0.0.1, so no port is guessed. Each worker writes its return value (or its
traceback) to a file in a private temporary folder; the parent watches every worker's
process sentinel, and the first failure stops all the others within seconds.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing import connection, get_all_start_methods, get_context
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.job import desync
from meshsplit.job.context import in_torchrun, job_store, jobs_joined, join_job_store, run_job
from meshsplit.job.stop import STOP_SIGNALS
from meshsplit.job.worker import (
    LauncherOutput,
    fault_log,
    forked_worker,
    started_marker,
    started_worker,
    threads_per_worker,
)

__all__ = ["WorkerError", "launch"]

DEFAULT_TIMEOUT_S = 120.0
"""Bound on every collective and on joining the job: a stuck peer fails, it never hangs."""
DEFAULT_START = "forkserver" if "forkserver" in get_all_start_methods() else "spawn"
"""How local workers start: forked from a server that imported torch once, where there is one."""
PRELOAD_VARIABLE = "MESHSPLIT_PRELOAD"
"""Modules, comma-separated, that the forkserver imports once for every launch's workers."""
_GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A worker raised or died; carries its rank, the error type and its traceback."""

    def __init__(self, rank: int, error_type: str, message: str, traceback_text: str) -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.traceback = traceback_text
        super().__init__(f"worker rank {rank} failed: {error_type}: {message}\n{traceback_text}")


def default_backend(local_workers: int) -> str:
    """NCCL when every local worker can own a GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_workers:
        return "nccl"
    return "gloo"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    start_method: str = DEFAULT_START,
) -> list[Any]:
    """Run fn(*args, **kwargs) in nprocs workers joined by torch.distributed; return values by rank.

    Inside a torchrun worker, join that job instead and return every rank's value (gathered).
    Raises WorkerError naming the first rank that raised or died.

    start_method "forkserver" (the default where the OS has it) forks each worker from a
    server process that imported torch and meshsplit once, so a launch starts in a fraction of
    a second instead of seconds; otherwise it behaves as "spawn", which starts fresh
    interpreters: fn and its arguments are pickled, each worker re-imports the caller's main
    module (hence the `if __name__ == "__main__"` guard) and sees this process's environment
    as it is at the launch; variables read only when a process starts (glibc's MALLOC_*,
    LD_PRELOAD) take effect in a forkserver's workers if set before the first launch, or
    with "spawn".
    "fork" (POSIX) makes each worker a copy of this process: fn, a lambda or a class defined
    in the script, and the data it reaches are inherited, not pickled, and nothing re-runs.
    Fork before this process initialises CUDA (keep the model on the CPU until then).
    """
    kwargs = kwargs or {}
    if in_torchrun():
        return _join_torchrun(fn, args, kwargs, timeout_s, backend)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer")
    if start_method not in ("forkserver", "spawn", "fork"):
        raise ValueError(f"start_method={start_method!r}; use 'forkserver', 'spawn' or 'fork'")
    if start_method == "fork":
        _check_fork(nprocs)
        # device_count asks NVML, which leaves CUDA uninitialised here for the workers
        backend = backend or ("nccl" if 0 < nprocs <= torch.cuda.device_count() else "gloo")
    backend = backend or default_backend(nprocs)
    worker: Callable[..., None] = forked_worker
    job: tuple[Any, ...] = (fn, args, kwargs)
    if start_method != "fork":  # unpickled in the worker once this environment is in place
        # by value: torch's shared-memory handles in a payload could be claimed by one worker
        worker, job = started_worker, (_by_value(job), dict(os.environ), LauncherOutput())
    # a forked worker copies this process's threads' locks, not the threads: the store's
    # server thread starts only after the fork, on a port reserved now (workers retry)
    store = None if start_method == "fork" else _store_server(0, nprocs, timeout_s)
    port = _free_port() if store is None else store.port
    context: Any = get_context(start_method)
    if start_method == "forkserver":
        # imported once; torch._dynamo is imported by the first parallelize (half a second)
        context.set_forkserver_preload(["meshsplit", "torch._dynamo", *_preloaded()])
    with tempfile.TemporaryDirectory(prefix="meshsplit-") as folder:
        workdir = Path(folder)
        processes = [
            context.Process(
                target=worker,
                args=(rank, nprocs, port, backend, timeout_s, workdir, *job),
                name=f"meshsplit-rank{rank}",
            )
            for rank in range(nprocs)
        ]
        try:
            for process in processes:
                process.start()
            store = store or _store_server(port, nprocs, timeout_s)
            with _forwarding_stop_signals(processes):
                _watch(processes, workdir)
            return [_load_result(workdir, rank) for rank in range(nprocs)]
        finally:
            _stop(processes)
            del store


def _preloaded() -> list[str]:
    """The modules named in MESHSPLIT_PRELOAD (comma-separated): the forkserver imports them
    with torch and meshsplit when it starts, so the workers of every launch start with them
    (a library such as transformers costs each worker seconds to import). A name that fails
    to import is skipped there, and the worker imports what it needs as without it."""
    names = os.environ.get(PRELOAD_VARIABLE, "").split(",")
    return [name.strip() for name in names if name.strip()]


def _store_server(port: int, nprocs: int, timeout_s: float) -> dist.TCPStore:
    """The job's store, served from this process on 127.0.0.1 (port 0: a free one)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(
        "127.0.0.1", port, nprocs + 1, is_master=True, timeout=timeout, wait_for_workers=False
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _forwarding_stop_signals(processes: list[Any]) -> Iterator[None]:
    """SIGTERM or SIGINT to this process (preemption, Ctrl-C) goes to every worker as SIGTERM:
    `Engine.fit` stops them at the next step boundary and saves; a second one stops the
    job at once. The workers have process groups of their own, so a terminal's Ctrl-C
    reaches them only through here, once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked: list[int] = []

    def forward(number: int, frame: FrameType | None) -> None:
        if asked:
            raise KeyboardInterrupt(f"{signal.Signals(number).name} again: stopping at once")
        asked.append(number)
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    previous = {number: signal.signal(number, forward) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _watch(processes: list[Any], workdir: Path) -> None:
    """Wait for all workers; on the first failure stop the rest and raise for the root cause."""
    alive = {process.sentinel: rank for rank, process in enumerate(processes)}
    while alive:
        for sentinel in connection.wait(list(alive)):
            rank = alive.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failures = [_failure(processes[rank], rank, workdir, time.time())]
                deadline = time.time() + 1.0
                for other, process in enumerate(processes):
                    if other in alive.values():
                        process.join(max(0.0, deadline - time.time()))
                        if process.exitcode not in (None, 0):
                            failures.append(_failure(process, other, workdir, time.time()))
                raise _root_cause(failures)


def _root_cause(failures: list[tuple[float, WorkerError]]) -> WorkerError:
    """A worker that died (killed by a signal, or gone without a report: os._exit, a
    crash) caused its peers' errors; otherwise the earliest error did.

    Peers of a dead worker fail in their next collective ("Connection closed by peer"),
    possibly before this process notices the death, so death is ranked first.
    """
    killed = [pair for pair in failures if pair[1].error_type in ("Killed", "Exit")]
    return min(killed or failures, key=lambda pair: pair[0])[1]


def _failure(process: Any, rank: int, workdir: Path, seen_at: float) -> tuple[float, WorkerError]:
    """The failure of one worker and when it happened (its own report, or when we saw it die)."""
    report = workdir / f"rank{rank}.error.json"
    if report.exists():
        info = json.loads(report.read_text())
        error = WorkerError(rank, info["type"], info["message"], info["traceback"])
        return info["time"], error
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        stacks = fault_log(workdir, rank)
        stacks_text = stacks.read_text() if stacks.exists() else ""
        return seen_at, WorkerError(rank, "Killed", f"killed by signal {name}", stacks_text)
    if not started_marker(workdir, rank).exists():
        return seen_at, WorkerError(
            rank,
            "Exit",
            f"exited with code {code} while its process started, before it ran any of the "
            "job (the error it printed is above). A worker starts by importing the script "
            "that called ms.launch; most often that script calls ms.launch (or builds the "
            'job) at import time: put the call under `if __name__ == "__main__":`',
            "",
        )
    return seen_at, WorkerError(
        rank,
        "Exit",
        f"exited with code {code} without a report (os._exit, a crash in native code, or the "
        "OOM killer; its peers' errors followed from it)",
        "",
    )


def _stop(processes: list[Any]) -> None:
    """Terminate workers still running, then kill those that ignore it; leave none behind."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.time() + _GRACE_S
    for process in processes:
        if process.pid is not None:
            process.join(max(0.0, deadline - time.time()))
            if process.is_alive():
                process.kill()
                process.join()


def _load_result(workdir: Path, rank: int) -> Any:
    return torch.load(workdir / f"rank{rank}.result.pt", weights_only=False)


def _check_fork(nprocs: int) -> None:
    if torch.cuda.is_initialized():
        raise RuntimeError(
            f"cannot fork {nprocs} workers: CUDA is initialised in this process and a forked "
            "child cannot use it; keep the model on the CPU until the workers start (they move "
            "it to their GPU), or start the script with torchrun"
        )


def _join_torchrun(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout_s: float,
    backend: str | None,
) -> list[Any]:
    """Join the torchrun job this process belongs to, run fn, and gather every rank's value."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_workers)
    torch.set_num_threads(threads_per_worker(local_workers))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    # A restarted worker must not meet the keys its previous incarnation left in the store,
    # nor this process's next job (a Trainer's next fit) the keys of the one before.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    job = f"{restart}.{jobs_joined()}"
    prefixed = dist.PrefixStore(f"meshsplit/restart{job}", store)
    join_job_store(dist.PrefixStore(f"meshsplit/job{job}", store))
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )
    desync.install(job_store(), timeout)
    result = run_job(fn, args, kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    dist.barrier()
    dist.destroy_process_group()
    return gathered


UNPICKLABLE = (pickle.PicklingError, AttributeError, TypeError)
"""What pickling a value that cannot travel raises (a lambda, a local function, a lock)."""


def picklable(*values: Any) -> bool:
    """Whether `values` can travel to a started worker by pickle."""
    try:
        pickle.dumps(values)
    except UNPICKLABLE:
        return False
    return True


def _by_value(job: tuple[Any, ...]) -> bytes:
    """The (function, args, kwargs) a started worker unpickles, or a TypeError saying what
    cannot travel and how to send it (before any worker starts)."""
    try:
        return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    except UNPICKLABLE as error:
        raise TypeError(
            f"the workers receive the function and its arguments by pickle, and one cannot be "
            f"pickled: {error}. Define functions (and the optimizer and loss factories given "
            "to ms.choose_plan or ms.launch) at module level, not as lambdas or local "
            "functions, or launch with start_method='fork'"
        ) from error
