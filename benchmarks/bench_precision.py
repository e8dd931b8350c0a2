"""Mixed precision: step time against PyTorch autocast, bf16 against fp32 per plan, accuracy.

Time (the reference transformer, d_model 256, 4 blocks, global batch 32 x 32 tokens, AdamW,
1 thread per worker): in the same workers, from the same weights and batch, meshsplit
Plan(precision="bf16-mixed"), the same plan in fp32, and, where PyTorch has the same piece,
PyTorch with torch.autocast("cpu", torch.bfloat16) around forward and loss: a plain loop in
one process, DistributedDataParallel on dp=2; the first step's losses (same weights, same
batch) are compared too. The runs take turns (A B C, C B A) after a warm-up; each figure is
the run's median round. Plans: 1 process, dp=2, pp=2 (4 micro-batches, 1F1B), tp=2. Beside
each plan's speed-up, the peak of activations saved for backward during one step (the most
the step's live-tensor timeline held at once) and the step's peak of live tensor bytes, in
fp32 and in bf16, on every rank. Under autocast the bf16 weight copies backward needs are
saved as well, and LayerNorm and the loss keep fp32 inputs: activations shrink by less than 2x.
Accuracy: the reference MLP trains `--epochs` on digits (batch 64, Adam lr 1e-3), in fp32,
bf16-mixed and fp16-mixed; each test accuracy is the mean of `--seeds` seeds (weights and
shuffle), shown against fp32 in points, with the steps fp16's loss scale skipped. (Not the
CNN: PyTorch's fp16 convolution backward on CPU takes seconds a step, in a plain loop too.)

    python benchmarks/bench_precision.py [--quick] [--out FILE.json] [--rounds R] [--steps S]
                                         [--epochs E] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshsplit as ms
from meshsplit.memory.tracker import CATEGORIES

from rounds import take_turns

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
PLANS = {
    "1 process": {},
    "dp=2": {"dp": 2},
    "pp=2, m=4": {"pp": 2, "micro_batches": 4},
    "tp=2": {"tp": 2},
}
"""The layouts timed, by label: Plan fields besides precision."""
TORCH_NAMES = {"1 process": "PyTorch + autocast", "dp=2": "DDP + autocast"}
"""The PyTorch run each data-parallel layout is set against."""
DIGITS_BATCH = 64
ACCURACY_MODEL = "mlp"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How large and how long each part runs."""

    lm: dict[str, int]
    """The transformer's sizes (ms.models.transformer keywords)."""
    batch: int
    """Global batch of the timed steps, in sequences."""
    rounds: int
    """Timing rounds; the runs take turns in each."""
    steps: int
    """Timed steps per run and round."""
    epochs: int
    """Epochs of each accuracy training."""
    seeds: int
    """Trainings per accuracy figure (seeds 0, 1, ...)."""


FULL = Settings(
    lm={"d_model": 256, "n_heads": 4, "n_layers": 4},
    batch=32,
    rounds=6,
    steps=5,
    epochs=5,
    seeds=3,
)
QUICK = Settings(
    lm={"d_model": 128, "n_heads": 4, "n_layers": 2},
    batch=16,
    rounds=2,
    steps=2,
    epochs=1,
    seeds=1,
)


def _adamw(params: Any) -> torch.optim.Optimizer:
    """The timed steps' optimizer, the same for meshsplit and PyTorch."""
    return torch.optim.AdamW(params, lr=1e-3)


def _adam(params: Any) -> torch.optim.Optimizer:
    """The accuracy trainings' optimizer (Adam lr 1e-3, as `meshsplit train`)."""
    return torch.optim.Adam(params, lr=1e-3)


def _transformer(settings: Settings) -> nn.Module:
    """The reference transformer at the benchmark's sizes, from seed 0."""
    torch.manual_seed(0)
    return ms.models.reference("transformer").model(**settings.lm)


def _engine(settings: Settings, fields: dict[str, Any], precision: str) -> ms.Engine:
    """meshsplit on the transformer under `fields` and `precision`."""
    return ms.parallelize(
        _transformer(settings),
        ms.Plan(**fields, precision=precision),
        optimizer=_adamw,
        loss_fn=ms.models.TokenCrossEntropy(),
    )


def _torch_step(
    settings: Settings, batch: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], float]:
    """A PyTorch step under bf16 autocast, plain or DDP by the world size, returning the
    global mean loss as train_step does (one all-reduce of it under DDP)."""
    model = _transformer(settings)
    world = dist.get_world_size()
    if world > 1:
        model = DistributedDataParallel(model)
    optimizer, loss_fn = _adamw(model.parameters()), ms.models.TokenCrossEntropy()
    x, y = (part.chunk(world)[dist.get_rank()] for part in batch)

    def step() -> float:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total = loss.detach().float()
        if world > 1:
            dist.all_reduce(total)
        return total.item() / world

    return step


def _activation_peak(engine: ms.Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
    """One step recorded on the live-tensor timeline: the most activation bytes held at once,
    and the step's peak of live tensor bytes."""
    engine.memory.timeline = []
    engine.train_step(*batch)
    at = CATEGORIES.index("activations")
    samples = engine.memory.timeline
    engine.memory.timeline = None
    return {
        "activations": max(sample.bytes_by_category[at] for sample in samples),
        "tensor_peak": engine.memory_report().tensor_peak_bytes,
    }


def _layout_worker(settings: Settings, label: str) -> dict[str, Any]:
    """Runs in every worker: median seconds per step of each run, first-step losses (all
    from the same weights), and the bf16 and fp32 engines' activation peaks."""
    torch.set_num_threads(1)
    batch = ms.models.reference("transformer").synthetic(settings.batch, seed=1)
    engines = {p: _engine(settings, PLANS[label], p) for p in ("bf16-mixed", "fp32")}
    runs = {f"meshsplit {p}": (lambda e=e: e.train_step(*batch)) for p, e in engines.items()}
    if label in TORCH_NAMES:
        runs[TORCH_NAMES[label]] = _torch_step(settings, batch)
    first_loss = {name: run() for name, run in runs.items()}
    for run in runs.values():  # past the first (counted) steps, into the steady state
        for _ in range(3):
            run()
    times = take_turns(runs, settings.rounds, settings.steps)
    memory = {p: _activation_peak(e, batch) for p, e in engines.items()}
    for engine in engines.values():
        engine.close()
    return {
        "seconds": {name: statistics.median(values) for name, values in times.items()},
        "first_loss": first_loss,
        "memory": memory,
    }


def _train_digits(settings: Settings, precision: str, seed: int) -> tuple[float, int]:
    """Test accuracy after `epochs` on digits from `seed`, and the steps skipped."""
    reference = ms.models.reference(ACCURACY_MODEL)
    torch.manual_seed(seed)
    engine = ms.parallelize(
        reference.model(), ms.Plan(precision=precision), optimizer=_adam, loss_fn=reference.loss()
    )
    engine.memory.track = False
    history = engine.fit(
        reference.data("train"),
        epochs=settings.epochs,
        batch_size=DIGITS_BATCH,
        eval_data=reference.data("test"),
        show=False,
        seed=seed,
    )
    engine.close()
    return history[-1]["test_accuracy"], engine.skipped_steps


def _accuracy_worker(settings: Settings) -> dict[str, dict[str, float]]:
    """Per precision: mean, lowest and highest test accuracy over the seeds, and the mean
    count of skipped steps."""
    torch.set_num_threads(1)
    figures: dict[str, dict[str, float]] = {}
    for precision in PRECISIONS:
        runs = [_train_digits(settings, precision, seed) for seed in range(settings.seeds)]
        accuracies, skipped = [run[0] for run in runs], [run[1] for run in runs]
        figures[precision] = {
            "accuracy": statistics.mean(accuracies),
            "lowest": min(accuracies),
            "highest": max(accuracies),
            "skipped_steps": statistics.mean(skipped),
        }
    return figures


def _workers(label: str) -> int:
    """Processes the layout `label` takes."""
    fields = PLANS[label]
    return fields.get("dp", 1) * fields.get("pp", 1) * fields.get("tp", 1)


def _mib(n: int) -> str:
    """Bytes as MiB with two decimals."""
    return f"{n / 2**20:.2f}"


def _torch_table(layouts: dict[str, list[dict[str, Any]]], title: str) -> Table:
    """meshsplit bf16-mixed against PyTorch autocast (plain or DDP): step times and ratio."""
    table = Table(title=title)
    for column in ("layout", "meshsplit ms/step", "PyTorch ms/step", "speed vs PyTorch",
                   "first loss, ours - PyTorch"):  # fmt: skip
        table.add_column(column, justify="right")
    for label, torch_name in TORCH_NAMES.items():
        figures = layouts[label][0]
        ours, theirs = figures["seconds"]["meshsplit bf16-mixed"], figures["seconds"][torch_name]
        gap = figures["first_loss"]["meshsplit bf16-mixed"] - figures["first_loss"][torch_name]
        table.add_row(
            f"{label} vs {torch_name}",
            f"{ours * 1e3:.1f}",
            f"{theirs * 1e3:.1f}",
            f"{theirs / ours:.3f}",
            f"{gap:+.2e}",
        )
    return table


def _layout_table(layouts: dict[str, list[dict[str, Any]]], title: str) -> Table:
    """bf16-mixed against fp32 per layout: speed-up, then activation and tensor peaks per rank."""
    table = Table(title=title)
    for column in ("layout", "rank", "fp32 ms/step", "bf16 ms/step", "speed-up",
                   "activations MiB fp32", "bf16", "fp32/bf16",
                   "peak MiB fp32", "bf16"):  # fmt: skip
        table.add_column(column, justify="right")
    for label, per_rank in layouts.items():
        seconds = per_rank[0]["seconds"]
        fp32, bf16 = seconds["meshsplit fp32"], seconds["meshsplit bf16-mixed"]
        for rank, figures in enumerate(per_rank):
            full, low = figures["memory"]["fp32"], figures["memory"]["bf16-mixed"]
            timing = (f"{fp32 * 1e3:.1f}", f"{bf16 * 1e3:.1f}", f"{fp32 / bf16:.3f}")
            table.add_row(
                label if rank == 0 else "",
                str(rank),
                *(timing if rank == 0 else ("", "", "")),
                _mib(full["activations"]),
                _mib(low["activations"]),
                f"{full['activations'] / low['activations']:.2f}",
                _mib(full["tensor_peak"]),
                _mib(low["tensor_peak"]),
            )
    return table


def _accuracy_table(figures: dict[str, dict[str, float]], title: str) -> Table:
    """Test accuracy per precision, against fp32 in points."""
    table = Table(title=title)
    for column in ("precision", "test accuracy", "lowest-highest", "vs fp32", "skipped steps"):
        table.add_column(column, justify="right")
    base = figures["fp32"]["accuracy"]
    for precision, row in figures.items():
        table.add_row(
            precision,
            f"{row['accuracy']:.4f}",
            f"{row['lowest']:.4f}-{row['highest']:.4f}",
            "" if precision == "fp32" else f"{100 * (row['accuracy'] - base):+.2f} points",
            f"{row['skipped_steps']:g}",
        )
    return table


def _summary(
    layouts: dict[str, list[dict[str, Any]]], accuracy: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """The ratios the tables show: speed against PyTorch, bf16 speed-up, points against fp32."""
    seconds = {label: per_rank[0]["seconds"] for label, per_rank in layouts.items()}
    return {
        "bf16_speed_vs_pytorch": {
            label: seconds[label][name] / seconds[label]["meshsplit bf16-mixed"]
            for label, name in TORCH_NAMES.items()
        },
        "bf16_speedup_vs_fp32": {
            label: times["meshsplit fp32"] / times["meshsplit bf16-mixed"]
            for label, times in seconds.items()
        },
        "accuracy_points_vs_fp32": {
            precision: 100 * (row["accuracy"] - accuracy["fp32"]["accuracy"])
            for precision, row in accuracy.items()
        },
    }


def _settings(args: argparse.Namespace) -> Settings:
    """FULL or QUICK, with the counts given on the command line."""
    settings = QUICK if args.quick else FULL
    given = {
        name: getattr(args, name)
        for name in ("rounds", "steps", "epochs", "seeds")
        if getattr(args, name) is not None
    }
    return replace(settings, **given)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: under 2 minutes")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--rounds", type=int, help="timing rounds")
    parser.add_argument("--steps", type=int, help="timed steps per run and round")
    parser.add_argument("--epochs", type=int, help="epochs per accuracy training")
    parser.add_argument("--seeds", type=int, help="trainings per accuracy figure")
    args = parser.parse_args()
    settings = _settings(args)
    console = Console(width=132)
    lm = ", ".join(f"{key} {value}" for key, value in settings.lm.items())
    about = f"transformer ({lm}), batch {settings.batch}, AdamW, median of {settings.rounds}"
    layouts = {
        label: ms.launch(_layout_worker, _workers(label), args=(settings, label)) for label in PLANS
    }
    console.print(_torch_table(layouts, f"bf16-mixed against PyTorch autocast, {about}"))
    console.print(_layout_table(layouts, f"bf16-mixed against fp32, {about}"))
    (accuracy,) = ms.launch(_accuracy_worker, 1, args=(settings,))
    console.print(
        _accuracy_table(
            accuracy,
            f"{ACCURACY_MODEL} on digits, {settings.epochs} epochs, batch {DIGITS_BATCH}, Adam, "
            f"mean of {settings.seeds} seeds",
        )
    )
    if args.out is not None:
        figures = {
            "machine": {"platform": platform.platform(), "torch": torch.__version__},
            "settings": asdict(settings),
            "layouts": layouts,
            "accuracy": accuracy,
            "summary": _summary(layouts, accuracy),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
