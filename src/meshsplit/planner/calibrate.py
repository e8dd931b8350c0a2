"""Measure this machine's collectives and core sharing once, and keep the result on disk.

The planner's choice between splits turns on these numbers, and a 2-core laptop and an NVLink
node differ by orders of magnitude in both. Each collective is timed per group size and fitted
to alpha + nbytes / beta; g workers computing at once run slowdown[g] = T_g / T_1 slower.
Rationale: docs/internals.md#plannercalibratepy
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.gather import all_gather_flat, reduce_scatter_flat
from meshsplit.job.launch import default_backend, launch
from meshsplit.plan import PlanError
from meshsplit.planner.fit import collective_seconds, compute_slowdown, fit_link
from meshsplit.planner.machine import OPERATIONS, Link, Machine

__all__ = ["DEFAULT_SIZES", "cache_file", "cached_machine", "machine_key", "measure_machine"]

_ALIGN = 256
"""Payloads are multiples of 256 bytes: fp32 elements that split evenly over 2, 4, ..., 64
ranks (other group sizes round each payload down to a multiple of the group)."""
DEFAULT_SIZES: tuple[int, ...] = tuple(
    _ALIGN * round(2 ** (10 + 13 * i / 5) / _ALIGN) for i in range(6)
)
"""Payload bytes per rank, geometric from 1 KiB to 8 MiB: latency- to bandwidth-bound."""
DEFAULT_REPEATS = 5
"""Timed repeats per (operation, size) after one warm-up; the median is kept."""
_COMPUTE_REPEATS = 5
_MATMULS = 48
_MATMUL_SIDE = {"cpu": 256, "cuda": 2048}
"""A 256x256 fp32 matmul takes ~0.4 ms on one CPU core: 48 of them take ~20 ms."""
_LAUNCH_TIMEOUT_S = 120.0


_METHOD = "median-1"
"""How the timings are reduced (fit.py); a cache made another way is measured again."""


def machine_key(backend: str | None = None) -> str:
    """Names what the measurements depend on: host, cores, torch, backend, device and the
    way timings are reduced."""
    backend = backend or default_backend(2)
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = _cpu_name()
    return (
        f"host={socket.gethostname()} cpus={_cores()} torch={torch.__version__} "
        f"backend={backend} device={device} timings={_METHOD}"
    )


def cache_file(cache_dir: str | os.PathLike[str] | None = None, backend: str | None = None) -> Path:
    """Where this machine's measurements live: `<cache_dir>/machine-<key hash>.json`.

    cache_dir defaults to $MESHSPLIT_CACHE_DIR, else ~/.cache/meshsplit; the hash is of
    `machine_key(backend)`, so another host, torch or backend never reads these numbers.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("MESHSPLIT_CACHE_DIR") or Path.home() / ".cache" / "meshsplit"
    digest = hashlib.sha256(machine_key(backend).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"machine-{digest}.json"


def cached_machine(
    group_sizes: Iterable[int] = (2, 4),
    *,
    refresh: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    backend: str | None = None,
) -> Machine:
    """This machine's costs for `group_sizes`, measured only for sizes the cache lacks.

    Reads `cache_file(cache_dir)`; measures the missing sizes (all of them with refresh),
    merges them into what was cached and writes the file atomically (temp file + rename),
    so a reader never sees half a file and concurrent calibrations cost only time.
    """
    sizes = _group_sizes(group_sizes)
    backend = backend or default_backend(max(sizes, default=1))
    path = cache_file(cache_dir, backend)
    cached = None if refresh else _read(path, machine_key(backend))
    missing = [size for size in sizes if size > 1 and (cached is None or not _has(cached, size))]
    if cached is not None and not missing:
        return cached
    measured = measure_machine(missing, backend=backend)
    machine = measured if cached is None else _merge(cached, measured)
    _write_atomically(path, machine.to_json())
    return machine


def measure_machine(
    group_sizes: Iterable[int] = (2, 4),
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    backend: str | None = None,
) -> Machine:
    """Time every operation and the core sharing with g workers, for each g in group_sizes.

    One launch per group size (world = g); a size of 1 is skipped, as a 1-rank collective
    costs nothing. On NCCL the payloads live on the GPU and every timing synchronises it.
    """
    groups = [size for size in _group_sizes(group_sizes) if size > 1]
    payloads = _payload_sizes(sizes)
    if not isinstance(repeats, int) or repeats < 1:
        raise PlanError(f"repeats={repeats!r} must be a positive integer; use {DEFAULT_REPEATS}")
    backend = backend or default_backend(max(groups, default=1))
    if backend == "nccl" and groups and torch.cuda.device_count() < max(groups):
        raise PlanError(
            f"group_sizes={groups} on nccl need {max(groups)} GPUs, this machine has "
            f"{torch.cuda.device_count()}; use backend='gloo' or smaller groups"
        )
    use_cuda = backend == "nccl" and torch.cuda.is_available()
    links: dict[str, dict[int, Link]] = {op: {} for op in OPERATIONS}
    slowdown: dict[int, float] = {}
    for group in groups:
        results = launch(
            _measure_rank,
            group,
            args=(payloads, repeats, use_cuda),
            timeout_s=_LAUNCH_TIMEOUT_S,
            backend=backend,
        )
        for op in OPERATIONS:
            samples = [
                (
                    results[0]["nbytes"][op][i],
                    collective_seconds([r["seconds"][op][i] for r in results]),
                )
                for i in range(len(payloads))
            ]
            links[op][group] = fit_link(samples)
        slowdown[group] = compute_slowdown(results[0]["alone"], [r["together"] for r in results])
    return Machine(
        name=machine_key(backend),
        links=links,
        cores=None if use_cuda else _cores(),
        compute_slowdown=slowdown,
    )


def _measure_rank(payloads: list[int], repeats: int, use_cuda: bool) -> dict[str, Any]:
    """In one worker: per-repeat seconds of every (operation, payload) and of the compute."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if use_cuda else _nothing
    nbytes: dict[str, list[int]] = {op: [] for op in OPERATIONS}
    seconds: dict[str, list[list[float]]] = {op: [] for op in OPERATIONS}
    for op in OPERATIONS:
        for i, payload in enumerate(payloads):
            numel = max(world, payload // 4 // world * world)
            run = _operation(op, numel, rank, world, device)
            if i == 0:  # warm-up: connections, kernels; a cold repeat later is lost in the min
                run()
                sync()
            nbytes[op].append(numel * 4)
            seconds[op].append(_timed(run, sync, repeats))
    alone, together = _compute_timings(rank, device, sync)
    return {"nbytes": nbytes, "seconds": seconds, "alone": alone, "together": together}


def _operation(
    op: str, numel: int, rank: int, world: int, device: torch.device
) -> Callable[[], None]:
    """One call of `op` with this rank contributing `numel` fp32 elements (traffic.py's bytes)."""
    payload = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(payload)
    if op == "all_gather":
        gathered = torch.empty(numel * world, device=device)
        return lambda: all_gather_flat(gathered, payload)
    if op == "reduce_scatter":
        shard = torch.empty(numel // world, device=device)
        return lambda: reduce_scatter_flat(shard, payload)
    if op == "all_to_all":
        received = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(received, payload)
    if op == "send_recv":
        return lambda: _send_recv(payload, rank)
    raise ValueError(f"no timing for operation {op!r}; operations: {OPERATIONS}")


def _send_recv(message: torch.Tensor, rank: int) -> None:
    """Rank 0 sends one message to rank 1; the other ranks stand by."""
    if rank > 1:
        return
    peer = 1 - rank
    exchange = dist.isend if rank == 0 else dist.irecv
    for request in dist.batch_isend_irecv([dist.P2POp(exchange, message, peer)]):
        request.wait()


def _timed(run: Callable[[], None], sync: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _compute_timings(
    rank: int, device: torch.device, sync: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Seconds of a fixed matmul loop on one thread: rank 0 alone, then every rank at once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        side = _MATMUL_SIDE[device.type]
        a = torch.randn(side, side, device=device)
        b = torch.randn(side, side, device=device)
        out = torch.empty(side, side, device=device)

        def loop() -> None:
            for _ in range(_MATMULS):
                torch.mm(a, b, out=out)

        alone: list[float] = []
        dist.barrier()
        if rank == 0:  # the other ranks wait, idle, in the barrier below
            loop()
            sync()
            for _ in range(_COMPUTE_REPEATS):
                start = time.perf_counter()
                loop()
                sync()
                alone.append(time.perf_counter() - start)
        dist.barrier()
        loop()  # warm-up of the other ranks
        sync()
        together = _timed(loop, sync, _COMPUTE_REPEATS)
    finally:
        torch.set_num_threads(threads)
    return alone, together


def _nothing() -> None:
    return None


def _group_sizes(group_sizes: Iterable[int]) -> list[int]:
    sizes = list(group_sizes)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise PlanError(f"group_sizes={sizes!r} must be positive integers; e.g. (2, 4)")
    return sorted(set(sizes))


def _payload_sizes(sizes: Sequence[int]) -> list[int]:
    payloads = sorted(set(sizes))
    if len(payloads) < 2 or any(not isinstance(s, int) or s < 4 for s in payloads):
        raise PlanError(
            f"sizes={list(sizes)!r} must hold at least two distinct payloads of >= 4 bytes "
            f"(integers); use the default {DEFAULT_SIZES}"
        )
    return payloads


def _cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _has(machine: Machine, group: int) -> bool:
    """Whether `machine` holds every measurement for `group` (size 1 needs none)."""
    if group <= 1:
        return True
    links = all(group in machine.links.get(op, {}) for op in OPERATIONS)
    return links and group in machine.compute_slowdown


def _merge(old: Machine, new: Machine) -> Machine:
    """`old` with `new`'s measurements added (new wins where both hold a group size).

    Fields this module does not measure stay as `old` had them.
    """
    links = {op: {**old.links.get(op, {}), **new.links.get(op, {})} for op in OPERATIONS}
    slowdown = {**old.compute_slowdown, **new.compute_slowdown}
    return replace(old, name=new.name, links=links, cores=new.cores, compute_slowdown=slowdown)


def _read(path: Path, key: str) -> Machine | None:
    """The cached Machine, or None when there is none (or it was made for another key)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        machine = Machine.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as error:
        raise PlanError(
            f"machine cache {path} is unreadable ({error}); delete it or pass refresh=True"
        ) from error
    return machine if machine.name == key else None


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
