"""Parameter servers against all-reduce, with and without a straggler.

The MLP 784-1024-512-256-10 on digits, 4 workers, global batch 64, Adam (lr 1e-3), for the
same number of updates U (the same samples: U x 64). dp all-reduce (4 processes), then
parameter servers (4 workers + 1 server) synchronous and with staleness 1, 2 and 4. Every
worker's step also waits `--device-ms` (default 30 ms), standing for accelerator time that
the host's cores do not spend: without it, 5 processes on a 2-core host are bound by the
cores, not by who waits for whom (`--device-ms 0` measures that case). With a straggler,
worker 3 then sleeps as long again as its whole step took: half speed. Under
staleness K > 0 every worker trains until the servers have made U updates, so the fast
workers give the pushes the straggler does not. Prints samples/s (samples in those updates
over the wall time of the slowest worker), the ratio to all-reduce under the same
condition, the most updates a push was behind, and test accuracy after the U updates.
Run: python benchmarks/bench_parameter_server.py [--updates U] [--device-ms D]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import meshsplit as ms
from meshsplit.runtime.parallelize import default_optimizer

BATCH = 64
WORKERS = 4
STRAGGLER = WORKERS - 1


def _train(plan: ms.Plan, updates: int, straggle: bool, device_s: float) -> dict[str, float]:
    """Runs in every process: train until the model has had `updates` updates."""
    torch.manual_seed(0)
    mlp = ms.models.reference("mlp")
    engine = ms.parallelize(mlp.model(), plan, optimizer=default_optimizer)
    x, y = mlp.data("train")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    per_epoch = len(x) // BATCH
    steps, started = 0, time.perf_counter()
    while _updates_made(engine, steps) < updates:
        picked = order[(steps % per_epoch) * BATCH : (steps % per_epoch + 1) * BATCH]
        began = time.perf_counter()
        engine.train_step(x[picked], y[picked])
        time.sleep(device_s)
        if straggle and dist.get_rank() == STRAGGLER:
            time.sleep(time.perf_counter() - began)  # as long again: half speed
        steps += 1
    seconds = time.perf_counter() - started
    scores = engine.evaluate(*mlp.data("test"))  # takes the newest parameters first
    engine.close()
    return {"seconds": seconds, "steps": steps, "accuracy": scores["accuracy"]}


def _updates_made(engine: ms.Engine, steps: int) -> int:
    """All-reduce: one update a step; parameter servers: the version this worker holds."""
    if engine.plan.sync == "ps":
        return min(engine.sync.versions)  # type: ignore[union-attr]
    return steps


def _run(plan: ms.Plan, updates: int, straggle: bool, device_s: float) -> dict[str, float]:
    args = (plan, updates, straggle, device_s)
    results = ms.launch(_train, plan.world_size, args=args, timeout_s=600)
    workers, servers = results[: plan.mesh_size], results[plan.mesh_size :]
    seconds = max(w["seconds"] for w in workers)
    pushes = servers[0]["pushes"] if servers else updates * plan.dp
    return {
        "samples_per_second": pushes * BATCH / plan.dp / seconds,
        "seconds": seconds,
        "accuracy": workers[0]["accuracy"],
        "most_updates_behind": servers[0]["most_updates_behind"] if servers else 0,
        "straggler_steps": workers[STRAGGLER]["steps"],
        "fast_steps": workers[0]["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=110, help="5 epochs of digits at 64")
    parser.add_argument("--device-ms", type=float, default=30.0, help="device time per step")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ps.json"))
    args = parser.parse_args()
    plans = {"all-reduce": ms.Plan(dp=WORKERS)}
    for staleness in (0, 1, 2, 4):
        plans[f"ps staleness {staleness}"] = ms.Plan(dp=WORKERS, sync="ps", staleness=staleness)
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for straggle in (False, True):
        condition = "straggler" if straggle else "even"
        figures[condition] = {
            name: _run(plan, args.updates, straggle, args.device_ms / 1e3)
            for name, plan in plans.items()
        }
    table = Table(
        title=f"MLP on digits, {WORKERS} workers, batch {BATCH}, {args.updates} updates, "
        f"{args.device_ms:g} ms device time a step"
    )
    for column in ("workers", "plan", "samples/s", "vs all-reduce", "steps fast/slow",
                   "most behind", "test accuracy"):  # fmt: skip
        table.add_column(column, justify="right")
    for condition, rows in figures.items():
        base = rows["all-reduce"]["samples_per_second"]
        for name, row in rows.items():
            table.add_row(
                condition,
                name,
                f"{row['samples_per_second']:.0f}",
                f"{row['samples_per_second'] / base:.2f}x",
                f"{row['fast_steps']:.0f}/{row['straggler_steps']:.0f}",
                f"{row['most_updates_behind']:.0f}",
                f"{row['accuracy']:.4f}",
            )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
