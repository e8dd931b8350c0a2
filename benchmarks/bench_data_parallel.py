"""Data parallel: meshsplit's bucketed all-reduce vs PyTorch DDP on the same two processes.

MLP 784-2048-2048-10, global batch 256, 2 workers with 1 thread each. The two engines take
turns (A B B A order, after a warm-up) so machine noise hits both alike; the figure is the
median samples/s of each and their ratio. One process with 2 threads is the single-device
reference. `--model bn-cnn`: a CNN of four Conv-BatchNorm-ReLU layers instead, global batch
64, where meshsplit normalises over the global batch (statistics gathered over dp) and DDP
over each replica's rows (PyTorch's SyncBatchNorm runs on GPUs only): what the global
statistics cost. Run: python benchmarks/bench_data_parallel.py [--model mlp|bn-cnn]
[--rounds R] [--steps S]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshsplit as ms

WIDTHS = (784, 2048, 2048, 10)
BATCHES = {"mlp": 256, "bn-cnn": 64}


def _bn_cnn() -> nn.Module:
    layers: list[nn.Module] = []
    for cin, cout in ((1, 32), (32, 32), (32, 64), (64, 64)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ms.models.mlp(WIDTHS) if name == "mlp" else _bn_cnn()


def _data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ms.data.synthetic_images(BATCHES[name], seed=1)
    return (x.flatten(1), y) if name == "mlp" else (x, y)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _time_steps(step, steps: int, batch: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - started)


def _worker(name: str, rounds: int, steps: int) -> dict[str, list[float]]:
    x, y = _data(name)
    loss_fn = nn.CrossEntropyLoss()
    engine = ms.parallelize(_model(name), ms.Plan(dp=2), optimizer=_sgd, loss_fn=loss_fn)

    ddp = DistributedDataParallel(_model(name))
    ddp_opt = _sgd(ddp.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    x_local, y_local = x.chunk(world)[rank], y.chunk(world)[rank]

    def ddp_step() -> None:
        ddp_opt.zero_grad()
        loss_fn(ddp(x_local), y_local).backward()
        ddp_opt.step()

    def ours_step() -> None:
        engine.train_step(x, y)

    runs: dict[str, list[float]] = {"meshsplit": [], "DDP": []}
    for step in (ours_step, ddp_step):  # warm-up
        for _ in range(3):
            step()
    contenders = [("meshsplit", ours_step), ("DDP", ddp_step)]
    for round_index in range(rounds):  # A B, then B A: neither always goes first
        for label, step in contenders[:: 1 if round_index % 2 == 0 else -1]:
            runs[label].append(_time_steps(step, steps, len(x)))
    engine.close()
    return runs


def _single_process(name: str, steps: int, rounds: int) -> float:
    torch.set_num_threads(2)
    model, (x, y) = _model(name), _data(name)
    opt, loss_fn = _sgd(model.parameters()), nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    return statistics.median(_time_steps(step, steps, len(x)) for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=tuple(BATCHES), default="mlp")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    runs = ms.launch(_worker, 2, args=(args.model, args.rounds, args.steps))[0]
    ours, ddp = statistics.median(runs["meshsplit"]), statistics.median(runs["DDP"])
    single = _single_process(args.model, args.steps, args.rounds)
    what = f"MLP {'-'.join(map(str, WIDTHS))}" if args.model == "mlp" else "BatchNorm CNN"
    table = Table(title=f"data parallel, {what}, global batch {BATCHES[args.model]}")
    for column in ("setup", "samples/s (median)", "ratio"):
        table.add_column(column, justify="right")
    table.add_row("meshsplit dp=2 (2 procs x 1 thread)", f"{ours:.0f}", f"{ours / ddp:.3f} of DDP")
    table.add_row("DDP (2 procs x 1 thread)", f"{ddp:.0f}", "1.000")
    table.add_row("1 process x 2 threads", f"{single:.0f}", f"{single / ddp:.3f} of DDP")
    Console().print(table)


if __name__ == "__main__":
    main()
