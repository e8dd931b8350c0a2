"""ms.launch: results in rank order; a failing or killed worker ends the job fast, leaving none."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshsplit as ms
from meshsplit.job import launch as launch_module


def _rank_and_tensor(offset: int) -> tuple[int, torch.Tensor]:
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), torch.full((1_000_000,), float(dist.get_rank()))


def test_results_come_back_in_rank_order_by_value() -> None:
    results = ms.launch(_rank_and_tensor, 3, args=(1,))
    assert [rank for rank, _ in results] == [0, 1, 2]
    for rank, big in results:
        assert big.shape == (1_000_000,) and float(big[0]) == rank


def _threads() -> int:
    return torch.get_num_threads()


def test_workers_split_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert ms.launch(_threads, 2) == [max(1, cores // 2)] * 2


def _keeps_freed_memory() -> bool:
    from meshsplit.job import allocator

    return allocator.applied


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or bool(os.environ.get("LD_PRELOAD")),
    reason="glibc's allocator, not a preloaded one",
)
def test_workers_keep_the_memory_they_free_unless_told_not_to(monkeypatch) -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        monkeypatch.delenv(name, raising=False)
    assert ms.launch(_keeps_freed_memory, 2) == [True, True]
    monkeypatch.setenv("MESHSPLIT_KEEP_FREED_MEMORY", "0")
    assert ms.launch(_keeps_freed_memory, 1) == [False]
    monkeypatch.delenv("MESHSPLIT_KEEP_FREED_MEMORY")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the user's own choice stands
    assert ms.launch(_keeps_freed_memory, 1) == [False]


def _fail_on(rank: int, how: str, folder: str) -> None:
    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == rank:
        if how == "raise":
            raise RuntimeError(f"deliberate failure on rank {rank}")
        if how == "segfault":  # a crash in native code
            ctypes.string_at(0)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the others wait here for the failed peer
    time.sleep(60)  # never reached when the failure ends the job


@pytest.mark.parametrize(("how", "rank"), [("raise", 1), ("sigkill", 2), ("segfault", 3)])
def test_failing_worker_raises_worker_error_naming_rank(how: str, rank: int, tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as caught:
        ms.launch(_fail_on, 4, args=(rank, how, str(tmp_path)), timeout_s=60)
    assert time.monotonic() - started < 30
    assert caught.value.rank == rank
    if how == "raise":
        assert caught.value.error_type == "RuntimeError"
        assert "deliberate failure on rank 1" in caught.value.traceback
    elif how == "segfault":  # the Python stack it died in, as faulthandler wrote it
        assert "SIGSEGV" in str(caught.value)
        assert "in _fail_on" in caught.value.traceback, caught.value.traceback
    else:
        assert "SIGKILL" in str(caught.value)
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _stuck_collective() -> None:
    if dist.get_rank() == 0:
        time.sleep(30)  # alive but never joins the all-reduce
    dist.all_reduce(torch.ones(1))


def test_stuck_peer_times_out_instead_of_hanging() -> None:
    started = time.monotonic()
    with pytest.raises(ms.WorkerError) as caught:
        ms.launch(_stuck_collective, 2, timeout_s=3)
    assert time.monotonic() - started < 25
    assert caught.value.rank == 1


UNGUARDED = """
import meshsplit as ms

def job():
    return 1

ms.launch(job, 2, timeout_s=30)  # no `if __name__ == "__main__":`
"""


def test_a_script_that_launches_at_import_is_told_to_guard_the_call(tmp_path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("meshsplit.job.launch.WorkerError: worker rank"), last
    assert "while its process started" in last
    assert 'if __name__ == "__main__":' in last


def test_launch_rejects_bad_process_count() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        ms.launch(_threads, 0)


def test_a_lambda_that_cannot_reach_the_workers_is_named_before_any_starts() -> None:
    started = time.monotonic()
    with pytest.raises(TypeError, match="cannot be pickled: .*lambda.*at module level"):
        ms.launch(lambda: 0, 2)
    assert time.monotonic() - started < 5  # refused here, not after starting workers


def test_launch_joins_a_torchrun_job(tmp_path) -> None:
    out = tmp_path / "results.json"
    script = Path(__file__).with_name("torchrun_job.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert results[0]["loss"] == results[1]["loss"]


def _imported() -> dict[str, bool]:
    return {name: name in sys.modules for name in ("torch._dynamo", "transformers")}


def test_workers_start_with_the_modules_the_forkserver_preloaded(monkeypatch) -> None:
    # conftest.py names tests/preload.py in MESHSPLIT_PRELOAD; this module imports neither
    for imported in ms.launch(_imported, 2):
        assert imported["torch._dynamo"]
        assert imported["transformers"] or importlib.util.find_spec("transformers") is None
    monkeypatch.setenv("MESHSPLIT_PRELOAD", " transformers, ,x_transformers ")
    assert launch_module._preloaded() == ["transformers", "x_transformers"]
