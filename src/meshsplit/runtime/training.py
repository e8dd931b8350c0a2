"""The training loop behind `Engine.fit`: shuffled global batches, a progress bar, epoch metrics."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshsplit.batch import rows, take_rows
from meshsplit.job.stop import StopRequest, TrainingStopped
from meshsplit.mesh import Mesh
from meshsplit.plan import Plan
from meshsplit.runtime.checkpoint import LATEST

__all__: list[str] = []


class Engine(Protocol):
    """What the loop drives: the engine, seen from here."""

    plan: Plan
    mesh: Mesh
    data_position: dict[str, int]

    @property
    def peers(self) -> dist.ProcessGroup | None: ...

    def train_step(self, inputs: Any, targets: Any) -> float: ...

    def evaluate(self, inputs: Any, targets: Any, batch_size: int = 512) -> dict[str, float]: ...

    def save(self, directory: str | os.PathLike[str]) -> Path: ...


def fit(
    engine: Engine,
    dataset: tuple[Any, Any],
    *,
    epochs: int,
    batch_size: int,
    eval_data: tuple[Any, Any] | None,
    seed: int,
    show: bool,
    checkpoint_dir: str | os.PathLike[str] | None,
    shuffle: bool = True,
) -> list[dict[str, float]]:
    """Train up to epoch `epochs`, from `engine.data_position`; rows for the epochs run here.

    Every rank draws the same shuffle from (seed, epoch) (see `epoch_order`), so all take
    part in the same global batch and a resumed run sees the batches an uninterrupted one
    would. The last partial batch of an epoch is dropped: it may not split over the plan.
    """
    inputs, targets = dataset
    engine.plan.check_batch(batch_size)
    samples = rows(inputs)
    batches = samples // batch_size
    if batches == 0:
        raise ValueError(f"batch_size={batch_size} exceeds the {samples} samples")
    done_epochs, done_batches = engine.data_position["epoch"], engine.data_position["batch"]
    show = show and engine.mesh.is_first_rank
    console = Console()
    history: list[dict[str, float]] = []
    with (
        Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not show,
            transient=True,
        ) as progress,
        StopRequest() as stop,
    ):
        total = max(0, (epochs - done_epochs) * batches - done_batches)
        task = progress.add_task("train", total=total, status="")
        for epoch in range(done_epochs + 1, epochs + 1):
            order = epoch_order(samples, seed, epoch, shuffle)
            first = done_batches if epoch == done_epochs + 1 else 0
            started, losses = time.perf_counter(), []
            for index in range(first, batches):
                picked = order[index * batch_size : (index + 1) * batch_size]
                losses.append(
                    engine.train_step(take_rows(inputs, picked), take_rows(targets, picked))
                )
                engine.data_position = {"epoch": epoch - 1, "batch": index + 1}
                progress.update(task, advance=1, status=f"epoch {epoch} loss {losses[-1]:.4f}")
                asked = stop.agreed(engine.mesh.device, engine.peers)
                if asked is not None:
                    _stop(engine, asked, checkpoint_dir)
            engine.data_position = {"epoch": epoch, "batch": 0}
            elapsed = time.perf_counter() - started
            row = {
                "epoch": float(epoch),
                "loss": sum(losses) / max(1, len(losses)),
                "samples_per_second": len(losses) * batch_size / elapsed,
            }
            if eval_data is not None:
                scores = engine.evaluate(*eval_data)
                row["test_loss"] = scores["loss"]
                if "accuracy" in scores:
                    row["test_accuracy"] = scores["accuracy"]
            history.append(row)
            if checkpoint_dir is not None:
                engine.save(checkpoint_dir)
            if show:
                progress.console.print(_epoch_line(row, epochs))
    if show and history:
        console.print(epoch_table(history))
    return history


def epoch_order(samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order `fit` takes the samples in during `epoch` (counted from 1)."""
    if not shuffle:
        return torch.arange(samples)
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def restarted(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """Whether this process is a generation torchrun restarted and a checkpoint is there."""
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return generation > 0 and (Path(checkpoint_dir) / LATEST).exists()


def _stop(
    engine: Engine, asked: signal.Signals, checkpoint_dir: str | os.PathLike[str] | None
) -> NoReturn:
    """Save where the loop stands (mid-epoch: a resumed run continues with the next batch)."""
    position = engine.data_position
    where = f"{asked.name} after epoch {position['epoch']} + {position['batch']} batches"
    if checkpoint_dir is None:
        raise TrainingStopped(
            f"training stopped by {where}; nothing was saved: pass checkpoint_dir to fit "
            "(--checkpoint-dir) to keep the work done"
        )
    path = engine.save(checkpoint_dir)
    raise TrainingStopped(
        f"training stopped by {where}; saved {path}; run again with engine.load("
        f"{str(checkpoint_dir)!r}) before fit (meshsplit train --resume) to continue"
    )


def _epoch_line(row: dict[str, float], epochs: int) -> str:
    text = f"epoch {int(row['epoch'])}/{epochs}  loss {row['loss']:.4f}"
    if "test_accuracy" in row:
        text += f"  test accuracy {row['test_accuracy']:.4f}"
    return text + f"  {row['samples_per_second']:.0f} samples/s"


def epoch_table(history: list[dict[str, float]]) -> Table:
    """One row per epoch: loss, test loss and accuracy, throughput."""
    table = Table(title="training")
    columns = [
        ("epoch", "{:.0f}"),
        ("loss", "{:.4f}"),
        ("test_loss", "{:.4f}"),
        ("test_accuracy", "{:.4f}"),
        ("samples_per_second", "{:.0f}"),
    ]
    present = [(name, fmt) for name, fmt in columns if name in history[0]]
    for name, _ in present:
        table.add_column(name.replace("_", " "), justify="right")
    for row in history:
        table.add_row(*(fmt.format(row[name]) for name, fmt in present))
    return table
