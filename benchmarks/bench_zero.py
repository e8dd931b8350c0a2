"""ZeRO stages side by side: step time and bytes held between steps, zero=0/1/2/3 beside
FSDP2 applied by hand (torch only), on the reference CNN and transformer at dp=2.

Held bytes: every storage created since before the model was built that is still alive after
the last step (a DTensor counted by its local shard, each storage at its size when counted:
FSDP2 frees gathered parameters by resizing storages to zero). Step time: the median of
rounds taken in turns, the order reversed each round (rounds.py).

    python benchmarks/bench_zero.py [--rows 64] [--rounds 6] [--optimizer sgd|adam]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import meshsplit as ms

from rounds import take_turns

MODELS = ("cnn", "transformer")
STAGES = (0, 1, 2, 3)
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


class LiveStorages(TorchDispatchMode):
    """The CPU storages ops created since it was entered, weakly held."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                if id(storage) not in self.storages:
                    self.storages[id(storage)] = weakref.ref(storage)
                    weakref.finalize(storage, self.storages.pop, id(storage), None)
        return out

    def held_bytes(self) -> int:
        gc.collect()
        alive = (ref() for ref in list(self.storages.values()))
        return sum(storage.nbytes() for storage in alive if storage is not None)


def _engine(name: str, stage: int, rows: int, optimizer: str) -> tuple[Callable[[], Any], int]:
    reference = ms.models.reference(name)
    batch = reference.synthetic(rows, seed=1)
    torch.manual_seed(0)
    with LiveStorages() as counter:
        engine = ms.parallelize(
            reference.model(),
            ms.Plan(dp=dist.get_world_size(), zero=stage),
            optimizer=OPTIMIZERS[optimizer],
            loss_fn=reference.loss(),
        )
        for _ in range(2):
            engine.train_step(*batch)
        held = counter.held_bytes()
    return functools.partial(engine.train_step, *batch), held


def _by_hand(name: str, rows: int, optimizer: str) -> tuple[Callable[[], Any], int]:
    """FSDP2 by hand: each child holding parameters `fully_shard`ed, then the root; a plain
    loop that, like train_step, also all-reduces the batch's mean loss."""
    reference = ms.models.reference(name)
    inputs, targets = reference.synthetic(rows, seed=1)
    share, rank = rows // dist.get_world_size(), dist.get_rank()
    mine = inputs[rank * share :][:share], targets[rank * share :][:share]
    torch.manual_seed(0)
    with LiveStorages() as counter:
        model = reference.model()
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        step_optimizer, loss_fn = OPTIMIZERS[optimizer](model.parameters()), reference.loss()

        def step() -> None:
            step_optimizer.zero_grad()
            loss = loss_fn(model(mine[0]), mine[1])
            loss.backward()
            step_optimizer.step()
            dist.all_reduce(loss.detach().div_(dist.get_world_size()))

        for _ in range(2):
            step()
        held = counter.held_bytes()
    return step, held


def _measure(rows: int, rounds: int, optimizer: str) -> dict[str, dict[str, dict[str, float]]]:
    """Runs in each worker: every model's runs, their held bytes, then their step times."""
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for name in MODELS:
        runs: dict[str, Callable[[], Any]] = {}
        held: dict[str, int] = {}
        for stage in STAGES:
            runs[f"zero={stage}"], held[f"zero={stage}"] = _engine(name, stage, rows, optimizer)
        runs["FSDP2 by hand"], held["FSDP2 by hand"] = _by_hand(name, rows, optimizer)
        times = take_turns(runs, rounds, 3)
        figures[name] = {
            label: {"seconds": statistics.median(times[label]), "held": held[label]}
            for label in runs
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="global batch")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    args = parser.parse_args()
    per_rank = ms.launch(_measure, 2, args=(args.rows, args.rounds, args.optimizer), timeout_s=1800)
    for name in MODELS:
        rows = per_rank[0][name]
        plain = rows["zero=0"]
        print(f"\n{name}, dp=2, batch {args.rows}, {args.optimizer}; rank 0 (held: rank 0 / 1)")
        print(f"{'run':14s} {'step ms':>8s} {'x zero=0':>8s} {'held MiB':>15s} {'x zero=0':>8s}")
        for label, row in rows.items():
            held = "/".join(f"{r[name][label]['held'] / 2**20:.2f}" for r in per_rank)
            print(
                f"{label:14s} {1e3 * row['seconds']:8.1f} {row['seconds'] / plain['seconds']:8.2f} "
                f"{held:>15s} {row['held'] / plain['held']:8.2f}"
            )


if __name__ == "__main__":
    main()
