"""Faults on purpose: for each, the seconds until the job ends with a named error, what the
error names, and whether any work was lost.

Two workers (dp=2, or pp=2 where the fault sits in the last stage) of the reference MLP:
a rank alive but stuck past the process group's timeout, a rank killed mid-step, a batch
the model cannot take (targets out of the class range, seen by the last stage only), a NaN
in the batch, a rank that calls a collective its peer does not (under MESHSPLIT_DEBUG=1), and
no fault at all (the seconds a launch takes anyway); SIGTERM to
`meshsplit train` (preemption); a 10,000-step soak of a small model with resident memory
every 1,000 steps.

    python benchmarks/bench_reliability.py [--timeout 5] [--soak-steps 10000] [--faults KIND ...]

`--faults desync --soak-steps 0` runs one fault and no soak.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import meshsplit as ms
from meshsplit.memory.report import resident_bytes


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fault_at_step_2(kind: str) -> None:
    """Runs in each worker: two good steps, with `kind` going wrong in the second."""
    torch.manual_seed(0)
    x, y = ms.data.synthetic_images(8)
    plan = ms.Plan(pp=2, micro_batches=2) if kind == "bad targets" else ms.Plan(dp=2)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if engine.steps == 1 and dist.get_rank() == 1:
            if kind == "stuck rank":
                time.sleep(60)
            if kind == "killed rank":
                os._exit(1)
            if kind == "desync":  # a collective rank 0 does not call: desync.py names it
                dist.all_reduce(torch.zeros(3))
        return torch.nn.functional.cross_entropy(output, target)

    engine = ms.parallelize(ms.models.mlp(), plan, optimizer=_sgd, loss_fn=loss_fn)
    engine.train_step(x, y)
    if kind == "bad targets":
        y = torch.full_like(y, 12)
    if kind == "nan in batch":
        x = x.clone()
        x[0] = float("nan")
    engine.train_step(x, y)


def _time_to_error(kind: str, timeout_s: float) -> tuple[float, str]:
    if kind == "desync":  # the workers inherit it
        os.environ["MESHSPLIT_DEBUG"] = "1"
    started = time.monotonic()
    try:
        ms.launch(_fault_at_step_2, 2, args=(kind,), timeout_s=timeout_s)
    except ms.WorkerError as error:
        return time.monotonic() - started, f"rank {error.rank} {error.error_type}: {error.message}"
    finally:
        os.environ.pop("MESHSPLIT_DEBUG", None)
    return time.monotonic() - started, "no error"


def _preemption() -> tuple[float, str]:
    """SIGTERM to `meshsplit train --dp 2` after its first epoch: seconds to exit, and where
    the checkpoint it left stands."""
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = Path(folder) / "ckpt"
        job = subprocess.Popen(
            [sys.executable, "-m", "meshsplit", "train", "--model", "mlp", "--dp", "2"]
            + ["--epochs", "3", "--checkpoint-dir", str(checkpoints)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not (checkpoints / "latest").exists() and job.poll() is None:
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        _, stderr = job.communicate(timeout=120)
        seconds = time.monotonic() - asked
        saved = (checkpoints / "latest").read_text()
    said = " ".join(line for line in stderr.splitlines() if "stopped" in line)
    return seconds, f"exit {job.returncode}, saved {saved}, no step lost: {said}"


def _soak(steps: int) -> dict[int, int]:
    """Runs in each worker: resident bytes every 1,000 steps of a small model."""
    torch.manual_seed(0)
    engine = ms.parallelize(ms.models.mlp((64, 32, 10)), ms.Plan(dp=2), optimizer=_sgd)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    marks = {}
    for step in range(1, steps + 1):
        engine.train_step(x, y)
        if step % 1000 == 0:
            marks[step] = resident_bytes()
    engine.close()
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="process group timeout, s")
    parser.add_argument("--soak-steps", type=int, default=10_000)
    kinds = (
        "none",
        "stuck rank",
        "killed rank",
        "bad targets",
        "nan in batch",
        "desync",
        "SIGTERM",
    )
    parser.add_argument("--faults", nargs="+", choices=kinds, default=kinds, help="faults to run")
    args = parser.parse_args()
    os.environ["MESHSPLIT_STALL_WARN_S"] = str(args.timeout / 2)
    faults: dict[str, Callable[[], tuple[float, str]]] = {
        kind: (lambda kind=kind: _time_to_error(kind, args.timeout))
        for kind in args.faults
        if kind != "SIGTERM"
    }
    if "SIGTERM" in args.faults:
        faults["SIGTERM"] = _preemption
    print(f"process group timeout {args.timeout:.0f} s\n")
    print(f"{'fault':14s} {'seconds':>7s}  what ended the job")
    for kind, run in faults.items():
        seconds, said = run()
        print(f"{kind:14s} {seconds:7.1f}  {said[:300]}")
    if args.soak_steps < 1000:
        return
    marks = ms.launch(_soak, 2, args=(args.soak_steps,), timeout_s=600)[0]
    first = marks[min(marks)]
    growth = max(marks.values()) / first - 1
    print(f"\nsoak, {args.soak_steps} steps: resident MiB every 1,000 steps (rank 0): "
          + ", ".join(f"{v / 2**20:.1f}" for v in marks.values())
          + f"; largest growth after the first 1,000: {growth:+.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
