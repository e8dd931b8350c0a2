"""What runs in each local worker: the launcher's environment and output, the job's process
group, the job itself, and a report of how it ended that the launcher reads.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from meshsplit.job import desync
from meshsplit.job.allocator import keep_freed_memory
from meshsplit.job.context import job_store, join_job_store, run_job
from meshsplit.job.stacks import StackWatch

__all__: list[str] = []

_PR_SET_PDEATHSIG = 1


def threads_per_worker(local_workers: int) -> int:
    """Split this machine's cores between local workers so they do not oversubscribe them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_workers)


def _die_with_parent() -> None:
    """Ask Linux to kill this worker if the launching process dies, so none is orphaned."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def started_marker(workdir: Path, rank: int) -> Path:
    """The file a worker leaves once its process is up and running meshsplit's code: a worker
    that dies without it never got that far (its main module failed to import)."""
    return workdir / f"rank{rank}.started"


def fault_log(workdir: Path, rank: int) -> Path:
    """Where a worker's Python stacks go if native code kills it (a segmentation fault, an
    abort): the launcher shows them with the signal."""
    return workdir / f"rank{rank}.fault"


def forked_worker(*args: Any) -> None:
    """A forked worker runs on a fresh thread: GNU OpenMP keeps the parent's thread team with
    the thread that forked, and that thread's next parallel region waits forever for threads
    fork did not copy; a new thread builds its own team."""
    started_marker(args[5], args[0]).touch()
    thread = threading.Thread(target=_local_worker, args=args, name="meshsplit-worker")
    thread.start()
    thread.join()


class LauncherOutput:
    """The launcher's stdout and stderr as they are at the launch, handed to a worker when it
    is started: a forkserver's children would otherwise write where the server's went."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_write_to, (reduction.DupFd(1), reduction.DupFd(2)))


def _write_to(out: Any, err: Any) -> None:
    """In the worker, as it is unpickled: write to the launcher's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def started_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    workdir: Path,
    payload: bytes,
    environment: dict[str, str],
    output: None,
) -> None:
    """A spawned or forkserver worker: the launcher's environment and output as they were at
    the launch (a forkserver's children would otherwise have the server's), then the job."""
    started_marker(workdir, rank).touch()
    os.environ.clear()
    os.environ.update(environment)
    try:
        fn, args, kwargs = pickle.loads(payload)
    except BaseException as error:
        _report(workdir, rank, error)
    _local_worker(rank, world_size, port, backend, timeout_s, workdir, fn, args, kwargs)


def _local_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    workdir: Path,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    _die_with_parent()
    keep_freed_memory()
    faults = fault_log(workdir, rank).open("w")  # open while the process lives
    faulthandler.enable(faults, all_threads=True)
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher, which forwards it once
    torch.set_num_threads(threads_per_worker(world_size))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    watch: StackWatch | None = None
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        join_job_store(dist.PrefixStore("meshsplit/job", store))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("meshsplit", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        desync.install(job_store(), timeout)  # MESHSPLIT_DEBUG=1: collectives checked
        watch = StackWatch(store)  # a timed-out collective names the ranks not in it
        result = run_job(fn, args, kwargs)
        save_atomically(result, workdir / f"rank{rank}.result.pt")
        dist.barrier()
        watch.close()
        dist.destroy_process_group()
    except BaseException as error:  # report every failure, then leave at once
        _report(workdir, rank, error if watch is None else watch.explain(error))


def _report(workdir: Path, rank: int, error: BaseException) -> NoReturn:
    report = {
        "time": time.time(),
        "type": type(error).__name__,
        "message": str(error),
        "traceback": traceback.format_exc(),
    }
    (workdir / f"rank{rank}.error.json").write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def save_atomically(value: Any, path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(value, partial)
    os.replace(partial, path)
