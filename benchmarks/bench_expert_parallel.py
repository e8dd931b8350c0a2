"""What the expert split buys: a Mixtral-shaped model on 4 workers under ep, dp and dp x tp.

The reference `moe` model (8 fused SwiGLU experts, top-2 router, in every block) trains with
SGD on a global batch of token sequences under dp4, dp4 ep2, dp4 ep4 and dp2 tp2, on the
same 4 workers (1 thread each). Time: every plan's engine lives in the same workers and
they take turns (A B C D, D C B A) after a warm-up; each plan's figure is its median round.
The all-to-all share: a few more steps of each ep plan with `all_to_all_single` timed on
every rank (its wait for the slowest peer included), over the step time of those steps.
Memory: each plan alone, per rank, after two steps: the parameters it holds and its peak of
live tensor bytes in a step (memory_report()).
Run: python benchmarks/bench_expert_parallel.py [--rounds R] [--steps S] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import meshsplit as ms

from rounds import take_turns

WORKERS = 4
PLANS = {
    "dp4": ms.Plan(dp=4),
    "dp4 ep2": ms.Plan(dp=4, ep=2),
    "dp4 ep4": ms.Plan(dp=4, ep=4),
    "dp2 tp2": ms.Plan(dp=2, tp=2),
}
SIZES = {"d_model": 128, "hidden": 256, "n_layers": 2, "n_heads": 4}
"""The moe model benchmarked: 8 experts of 128 -> 2 x 256 -> 128 in each of 2 blocks."""
QUICK_SIZES: dict[str, int] = {}
"""--quick: the reference defaults (d_model 64, hidden 128)."""
BATCH = 64
_MIB = 2**20


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _engine(plan: ms.Plan, sizes: dict[str, int]) -> ms.Engine:
    torch.manual_seed(0)
    model = ms.models.reference("moe").model(**sizes)
    return ms.parallelize(model, plan, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy())


@contextmanager
def _timed_all_to_all(spent: list[float]) -> Iterator[None]:
    """Add the seconds of every all_to_all_single this process calls to `spent[0]`."""
    original = dist.all_to_all_single

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    dist.all_to_all_single = timed
    try:
        yield
    finally:
        dist.all_to_all_single = original


def _memory(plan: ms.Plan, sizes: dict[str, int], batch: Any) -> dict[str, int]:
    """This rank's parameter bytes and live-tensor peak of one step of `plan`, alone."""
    engine = _engine(plan, sizes)
    for _ in range(2):
        engine.train_step(*batch)
    report = engine.memory_report()
    engine.close()
    return {"parameters": report.parameter_bytes, "tensor_peak": report.tensor_peak_bytes or 0}


def _all_to_all_share(step: Callable[[], Any], steps: int) -> float:
    """Of `steps` steps' seconds on this rank, the share spent in all-to-alls."""
    spent = [0.0]
    with _timed_all_to_all(spent):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - started
    return spent[0] / total


def _worker(sizes: dict[str, int], rounds: int, steps: int) -> dict[str, Any]:
    batch = ms.models.reference("moe").synthetic(BATCH, seed=1)
    memory = {name: _memory(plan, sizes, batch) for name, plan in PLANS.items()}
    engines = {name: _engine(plan, sizes) for name, plan in PLANS.items()}
    runs: dict[str, Callable[[], Any]] = {}
    for name, engine in engines.items():
        engine.memory.track = False  # the timed steps run as a user's would
        runs[name] = lambda engine=engine: engine.train_step(*batch)
        for _ in range(2):  # past the first (counted) steps, into the steady state
            runs[name]()
    times = take_turns(runs, rounds, steps)
    shares = {name: _all_to_all_share(runs[name], steps) for name in runs if "ep" in name}
    for engine in engines.values():
        engine.close()
    return {"times": times, "shares": shares, "memory": memory}


def _table(results: list[dict[str, Any]], sizes: dict[str, int], rounds: int, steps: int) -> Table:
    median = {name: statistics.median(t) for name, t in results[0]["times"].items()}
    shape = ", ".join(f"{k} {v}" for k, v in {**{"d_model": 64, "hidden": 128}, **sizes}.items())
    table = Table(
        title=f"moe ({shape}, 8 experts, top-2), global batch {BATCH} x 32 tokens, "
        f"{WORKERS} workers, SGD (median of {rounds} rounds of {steps})"
    )
    columns = ("plan", "ms/step", "samples/s", "vs dp4", "all-to-all share",
               "params MiB/rank", "tensor peak MiB (max rank)")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for name, seconds in median.items():
        share = max(r["shares"].get(name, 0.0) for r in results)
        table.add_row(
            name,
            f"{seconds * 1e3:.1f}",
            f"{BATCH / seconds:.0f}",
            f"{median['dp4'] / seconds:.2f}",
            f"{100 * share:.0f}%" if "ep" in name else "-",
            f"{max(r['memory'][name]['parameters'] for r in results) / _MIB:.2f}",
            f"{max(r['memory'][name]['tensor_peak'] for r in results) / _MIB:.2f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the small model, 2 rounds of 2")
    args = parser.parse_args()
    sizes, rounds, steps = (QUICK_SIZES, 2, 2) if args.quick else (SIZES, args.rounds, args.steps)
    results = ms.launch(_worker, WORKERS, args=(sizes, rounds, steps), timeout_s=3600)
    console = Console()
    console.print(
        f"machine: {platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}"
    )
    console.print(_table(results, sizes, rounds, steps))


if __name__ == "__main__":
    main()
