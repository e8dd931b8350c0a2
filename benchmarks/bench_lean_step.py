"""What meshsplit's defaults cost: the same step with them on, with them off, and in PyTorch.

Time: data parallel on 2 workers (1 thread each), MLP 784-2048-2048-10 at global batch 256
and the reference transformer at batch 32, SGD: meshsplit Plan(dp=2) with its defaults
(non-finite check, sampled live-tensor count), the same with both off, and DDP, taking turns
(A B C, C B A) after a warm-up; the figure is each one's median over rounds. Each setting
runs on two engines, built on, off, off, on, so that neither setting is always built first.
Then single steps in pairs (defaults on beside off, and beside DDP), each pair back to back
between barriers: the median ratio and its quartiles, free of the host's drift over a round.
Memory: peak live tensor bytes over three AdamW steps of a small LM (vocab 4096, batch 16 x 64),
counted from before the model is built by a dispatch-mode counter written here, outside
meshsplit: Plan() against plain PyTorch in one process, Plan(dp=2) against DDP per rank.
Run: python benchmarks/bench_lean_step.py [--rounds R] [--steps S] [--pairs P]
     [--part time|memory|all]
"""

from __future__ import annotations

import argparse
import statistics
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import meshsplit as ms

from rounds import paired_ratios, take_turns

MLP_WIDTHS = (784, 2048, 2048, 10)
LM = {"vocab_size": 4096, "d_model": 128, "n_heads": 4, "n_layers": 2, "seq_len": 64}


class PeakCounter(TorchDispatchMode):
    """Bytes of the live storages that ops created since it was entered, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                key = id(storage)
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _lm_batch(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, LM["vocab_size"], (rows, LM["seq_len"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _plain_peak(steps: int = 3) -> int:
    x, y = _lm_batch()
    with PeakCounter() as counter:
        torch.manual_seed(0)
        model = ms.models.transformer(**LM)
        optimizer, loss_fn = _adamw(model.parameters()), ms.models.TokenCrossEntropy()
        for _ in range(steps):
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return counter.peak


def _meshsplit_peak(plan: ms.Plan, steps: int = 3) -> int:
    x, y = _lm_batch()
    with PeakCounter() as counter:
        torch.manual_seed(0)
        model = ms.models.transformer(**LM)
        engine = ms.parallelize(
            model, plan, optimizer=_adamw, loss_fn=ms.models.TokenCrossEntropy()
        )
        for _ in range(steps):
            engine.train_step(x, y)
    engine.close()
    return counter.peak


def _ddp_peak(steps: int = 3) -> int:
    x, y = _lm_batch()
    rank, world = dist.get_rank(), dist.get_world_size()
    with PeakCounter() as counter:
        torch.manual_seed(0)
        model = DistributedDataParallel(ms.models.transformer(**LM))
        optimizer, loss_fn = _adamw(model.parameters()), ms.models.TokenCrossEntropy()
        for _ in range(steps):
            optimizer.zero_grad()
            loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            optimizer.step()
    return counter.peak


def _memory_worker() -> dict[str, int]:
    return {"meshsplit dp=2": _meshsplit_peak(ms.Plan(dp=2)), "DDP": _ddp_peak()}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _case(name: str) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor, torch.Tensor], Any]:
    if name == "mlp":
        x, y = ms.data.synthetic_images(256, seed=1)
        return lambda: ms.models.mlp(MLP_WIDTHS), (x.flatten(1), y), nn.CrossEntropyLoss()
    reference = ms.models.reference("transformer")
    return reference.model, reference.synthetic(32, seed=1), reference.loss()


def _time_worker(
    name: str, rounds: int, steps: int, pairs: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    build, (x, y), loss_fn = _case(name)
    engines = {}
    for name in ("on 1", "off 1", "off 2", "on 2"):  # built A B B A: neither comes first
        torch.manual_seed(0)
        plan = ms.Plan(dp=2) if name.startswith("on") else ms.Plan(dp=2, nonfinite="off")
        engines[name] = ms.parallelize(build(), plan, optimizer=_sgd, loss_fn=loss_fn)
        if name.startswith("off"):
            engines[name].memory.track = False
    torch.manual_seed(0)
    ddp = DistributedDataParallel(build())
    ddp_optimizer = _sgd(ddp.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    x_mine, y_mine = x.chunk(world)[rank], y.chunk(world)[rank]

    def ddp_step() -> None:
        ddp_optimizer.zero_grad()
        loss_fn(ddp(x_mine), y_mine).backward()
        ddp_optimizer.step()
        dist.all_reduce(torch.zeros(1))  # the mean loss every rank gets, as train_step returns

    def ddp_local_loss() -> float:
        ddp_optimizer.zero_grad()
        loss = loss_fn(ddp(x_mine), y_mine)
        loss.backward()
        ddp_optimizer.step()
        return loss.item()  # this rank's loss only, as a plain DDP loop logs it

    def stepping(engine: ms.Engine) -> Callable[[], Any]:
        return lambda: engine.train_step(x, y)

    runs: dict[str, Callable[[], Any]] = {f"defaults {n}": stepping(e) for n, e in engines.items()}
    runs |= {"DDP": ddp_step, "DDP, local loss": ddp_local_loss}
    for run in runs.values():  # past the first (counted) steps, into the steady state
        for _ in range(4):
            run()
    times = take_turns(runs, rounds, steps)
    both = {  # each setting's rounds on both of its engines
        f"defaults {name}": times[f"defaults {name} 1"] + times[f"defaults {name} 2"]
        for name in ("on", "off")
    }
    paired = {  # on over off, and on over DDP, step by step
        "on / off": paired_ratios(runs["defaults off 1"], runs["defaults on 1"], pairs),
        "on / DDP": paired_ratios(runs["DDP"], runs["defaults on 2"], pairs),
    }
    return both | {"DDP": times["DDP"], "DDP, local loss": times["DDP, local loss"]}, paired


def _time_table(name: str, rounds: int, steps: int, pairs: int) -> tuple[Table, Table]:
    times, paired = ms.launch(_time_worker, 2, args=(name, rounds, steps, pairs))[0]
    median = {run: statistics.median(seconds) for run, seconds in times.items()}
    table = Table(title=f"dp=2 step time, {name}, SGD (median of {rounds} rounds of {steps})")
    for column in ("run", "ms/step", "speed vs DDP", "speed vs defaults off"):
        table.add_column(column, justify="right")
    for run, seconds in median.items():
        table.add_row(
            run,
            f"{seconds * 1e3:.1f}",
            f"{median['DDP'] / seconds:.3f}",
            f"{median['defaults off'] / seconds:.3f}",
        )
    return table, _pairs_table(name, paired)


def _pairs_table(name: str, paired: dict[str, list[float]]) -> Table:
    """Step time with the defaults on over the other run's, one pair of single steps at a
    time (rounds.paired_ratios): the median and the middle half of the pairs."""
    table = Table(title=f"dp=2, {name}: single steps in pairs, defaults on over the other")
    for column in ("pair", "pairs", "median", "quartiles"):
        table.add_column(column, justify="right")
    for label, ratios in paired.items():
        low, _, high = statistics.quantiles(ratios, n=4)
        table.add_row(label, str(len(ratios)), f"{statistics.median(ratios):.3f}",
                      f"{low:.3f} - {high:.3f}")  # fmt: skip
    return table


def _memory_table() -> Table:
    single = {"meshsplit Plan()": _meshsplit_peak(ms.Plan()), "plain PyTorch": _plain_peak()}
    per_rank = ms.launch(_memory_worker, 2)
    table = Table(title="peak live tensor bytes, 3 AdamW steps, LM vocab 4096, batch 16 x 64")
    for column in ("run", "MiB", "ratio"):
        table.add_column(column, justify="right")
    ours, plain = single["meshsplit Plan()"], single["plain PyTorch"]
    table.add_row("meshsplit Plan(), 1 process", f"{ours / 2**20:.2f}", f"{ours / plain:.3f}")
    table.add_row("plain PyTorch, 1 process", f"{plain / 2**20:.2f}", "1.000")
    for rank, figures in enumerate(per_rank):
        ours, ddp = figures["meshsplit dp=2"], figures["DDP"]
        table.add_row(
            f"meshsplit Plan(dp=2), rank {rank}", f"{ours / 2**20:.2f}", f"{ours / ddp:.3f}"
        )
        table.add_row(f"DDP, rank {rank}", f"{ddp / 2**20:.2f}", "1.000")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=150, help="pairs of single steps")
    parser.add_argument("--part", choices=("time", "memory", "all"), default="all")
    args = parser.parse_args()
    console = Console()
    if args.part in ("memory", "all"):
        console.print(_memory_table())
    if args.part in ("time", "all"):
        for name in ("mlp", "transformer"):
            for table in _time_table(name, args.rounds, args.steps, args.pairs):
                console.print(table)


if __name__ == "__main__":
    main()
