"""Operator split: meshsplit's parallel layers vs PyTorch's DTensor tensor parallel, same split.

MLP 784-2048-2048-10 (fc1 column, fc2 row, fc3 whole) and the reference transformer
(vocab-split token embedding, head-split attention, column/row MLP pairs, column head with
gathered logits) on 2 workers x 1 thread. Both sides run the same plain training loop (SGD);
ours is `meshsplit.tensor.parallelize`, theirs is `parallelize_module` with ColwiseParallel /
RowwiseParallel on the same layers. The CNN has no PyTorch counterpart (DTensor does not split
Conv2d), so it runs meshsplit tp=2 against meshsplit dp=2 on the same workers, through the
Engine. Contenders take turns (A B, then B A) after a warm-up; figures are medians.
Run: python benchmarks/bench_operator_split.py [--rounds R] [--steps S]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshsplit as ms

MLP_WIDTHS = (784, 2048, 2048, 10)
BATCHES = {"mlp": 256, "transformer": 32, "cnn": 64}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    sizes = {"widths": MLP_WIDTHS} if name == "mlp" else {}
    return ms.models.reference(name).model(**sizes)


def _data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = ms.models.reference(name).synthetic(BATCHES[name], seed=1)
    return (x.flatten(1) if name == "mlp" else x), y


def _loss(name: str) -> nn.Module:
    return ms.models.reference(name).loss()


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _dtensor_plan(name: str) -> dict[str, object]:
    """PyTorch's styles for the split meshsplit's rule picks on the same model."""
    if name == "mlp":
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    plan: dict[str, object] = {
        "embed.tokens": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for block in range(len([n for n in _model(name).named_children() if "block" in n[0]])):
        for projection in ("q", "k", "v"):
            plan[f"block{block}.attn.{projection}"] = ColwiseParallel()
        plan[f"block{block}.attn.out"] = RowwiseParallel()
        plan[f"block{block}.mlp.fc1"] = ColwiseParallel()
        plan[f"block{block}.mlp.fc2"] = RowwiseParallel()
    return plan


def _plain_step(model: nn.Module, name: str) -> Callable[[], None]:
    x, y = _data(name)
    optimizer, loss_fn = _sgd(model.parameters()), _loss(name)

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def _samples_per_second(step: Callable[[], None], steps: int, batch: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - started)


def _race(contenders: dict[str, Callable[[], None]], rounds: int, steps: int, batch: int) -> dict:
    for step in contenders.values():  # warm-up
        for _ in range(3):
            step()
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders.items())
    for index in range(rounds):
        for name, step in order[:: 1 if index % 2 == 0 else -1]:
            runs[name].append(_samples_per_second(step, steps, batch))
    return {name: statistics.median(values) for name, values in runs.items()}


def _worker(rounds: int, steps: int) -> dict[str, dict[str, float]]:
    group = dist.group.WORLD
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name in ("mlp", "transformer"):
        ours = _model(name)
        ms.tensor.parallelize(ours, group)
        theirs = parallelize_module(_model(name), device_mesh, _dtensor_plan(name))
        contenders = {
            "meshsplit tp=2": _plain_step(ours, name),
            "DTensor tp=2": _plain_step(theirs, name),
        }
        results[name] = _race(contenders, rounds, steps, BATCHES[name])
    x, y = _data("cnn")
    engines = {
        f"meshsplit {plan.describe()}": ms.parallelize(
            _model("cnn"), plan, optimizer=_sgd, loss_fn=_loss("cnn")
        )
        for plan in (ms.Plan(tp=2), ms.Plan(dp=2))
    }
    contenders = {label: (lambda e=engine: e.train_step(x, y)) for label, engine in engines.items()}
    results["cnn"] = _race(contenders, rounds, steps, BATCHES["cnn"])
    for engine in engines.values():
        engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results = ms.launch(_worker, 2, args=(args.rounds, args.steps))[0]
    table = Table(title="operator split, 2 workers x 1 thread, samples/s (median)")
    for column in ("model", "batch", "setup", "samples/s", "ratio"):
        table.add_column(column, justify="right")
    for name, runs in results.items():
        (ours_label, ours), (base_label, base) = runs.items()
        table.add_row(name, str(BATCHES[name]), ours_label, f"{ours:.0f}", f"{ours / base:.3f}")
        table.add_row("", "", base_label, f"{base:.0f}", "1.000")
    Console().print(table)


if __name__ == "__main__":
    main()
