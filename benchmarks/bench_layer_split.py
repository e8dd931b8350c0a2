"""Layer split: meshsplit's pipeline against torch.distributed.pipelining, same everything else.

Same model (an MLP with uneven layer widths), same stage boundaries (meshsplit's automatic
split, handed to PyTorch's stages), same micro-batches, same optimizer, 2 local workers with
1 thread each. The runs take turns within each round (A B B A across rounds), so a slow
moment on a shared machine hits all of them; the median round is reported. Prints samples/s
and the ratio ours/theirs per schedule; the pipeline efficiency, measured as the speed-up
over one process (1 thread, whole batch) divided by p, beside the theoretical m/(m+p-1);
and the balance (slowest/fastest stage, profiled) of the automatic split.

    PYTHONPATH=src python benchmarks/bench_layer_split.py [--batch 256 --micro-batches 8]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import meshsplit as ms

from rounds import take_turns

WIDTHS = (784, 1536, 256, 1024, 768, 512, 1024, 256, 10)
"""Uneven widths: the layers' costs differ by up to ~6x, so a split by layer count is unbalanced."""
SCHEDULES = ("gpipe", "1f1b")
STAGES = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return ms.models.mlp(WIDTHS)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _theirs(schedule: str, sizes: tuple[int, ...], micro: int) -> Callable[..., None]:
    """torch.distributed.pipelining over the same layers per stage; returns one train step."""
    rank = dist.get_rank()
    start = sum(sizes[:rank])
    layers = list(_model().children())[start : start + sizes[rank]]
    module = nn.Sequential(*layers)
    stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = kind(stage, n_microbatches=micro, loss_fn=nn.CrossEntropyLoss())
    optimizer = _optimizer(module.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad()

    return step


def _single(x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """The whole model in one process on the global batch (rank 0; other ranks idle)."""
    model = _model()
    optimizer = _optimizer(model.parameters())
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        if dist.get_rank() == 0:
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    return step


def _worker(batch: int, micro: int, steps: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = ms.data.synthetic_images(batch, seed=0)
    ours = {
        name: ms.parallelize(
            _model(),
            ms.Plan(pp=STAGES, micro_batches=micro, schedule=name),
            optimizer=_optimizer,
            loss_fn=nn.CrossEntropyLoss(),
            example_inputs=x[: batch // micro],
        )
        for name in SCHEDULES
    }
    sizes = ours["gpipe"].runner.sizes  # type: ignore[attr-defined]
    theirs = {name: _theirs(name, sizes, micro) for name in SCHEDULES}
    runs: dict[str, Callable[[], Any]] = {"one process": _single(x, y)}
    for name in SCHEDULES:
        runs[f"meshsplit {name}"] = lambda engine=ours[name]: engine.train_step(x, y)
        runs[f"torch {name}"] = lambda step=theirs[name]: step(x, y)
    times = take_turns(runs, rounds, steps)
    description = ours["gpipe"].describe()
    for engine in ours.values():
        engine.close()
    return {"times": times, "describe": description, "sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = ms.launch(
        _worker, STAGES, args=(args.batch, args.micro_batches, args.steps, args.rounds)
    )[0]
    median = {name: statistics.median(values) for name, values in result["times"].items()}
    console = Console()
    table = Table(
        title=f"layer split, pp={STAGES}, m={args.micro_batches}, batch {args.batch}, "
        f"widths {'-'.join(map(str, WIDTHS))}, stages {list(result['sizes'])}"
    )
    for column in ("schedule", "meshsplit samples/s", "torch samples/s", "ours/theirs"):
        table.add_column(column, justify="right")
    for name in SCHEDULES:
        ours, theirs = median[f"meshsplit {name}"], median[f"torch {name}"]
        table.add_row(
            name, f"{args.batch / ours:.0f}", f"{args.batch / theirs:.0f}", f"{theirs / ours:.2f}"
        )
    console.print(table)
    stages = result["describe"]["stages"]
    ideal = args.micro_batches / (args.micro_batches + STAGES - 1)
    single = median["one process"]
    console.print(f"one process, 1 thread, whole batch: {args.batch / single:.0f} samples/s")
    for name in SCHEDULES:
        for who in ("meshsplit", "torch"):
            efficiency = single / (STAGES * median[f"{who} {name}"])
            console.print(
                f"pipeline efficiency {who} {name}: measured {efficiency:.2f} "
                f"(one-process time / (p x step time)), theoretical m/(m+p-1) {ideal:.2f}"
            )
    costs = [s["forward_ms"] + s["backward_ms"] for s in stages]
    console.print(
        f"balance of the automatic split: slowest/fastest stage = {max(costs) / min(costs):.3f} "
        f"({', '.join(f'{c:.2f} ms' for c in costs)} per micro-batch, forward + backward)"
    )


if __name__ == "__main__":
    main()
