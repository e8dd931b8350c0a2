"""The memory estimate against what workers measure, and the tracker against PyTorch's.

Part 1: for the reference models over a grid of plans (dp, pp, tp, hybrids, both
schedules, recompute on and off), `ms.estimate_memory` (one process) beside the peak of live
tensor bytes each real worker measured; prints the error per rank. Part 2: one training step
of each model in one process, plain, under meshsplit's live-tensor tracker and under
`torch.distributed._tools.MemTracker`: the time ratio of each to plain (rounds A B C C B A,
median) and the peaks they report. Part 3: one model and plan (the transformer, d_model 256,
at dp=2) under each memory technique: the per-rank peak of live tensor bytes by category and
the step time against the plain plan, beside FSDP2's own `fully_shard` loop on the same model
(the same blocks sharded; what zero=3 runs inside the engine).

    python benchmarks/bench_memory.py [--rows 32] [--rounds 6] [--parts estimate,tracker,techniques]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import fully_shard

import meshsplit as ms
from meshsplit.memory.report import optimizer_tensors
from meshsplit.memory.tracker import LiveTensors
from meshsplit.mesh import local_tensor
from meshsplit.runtime.parallelize import default_optimizer

from rounds import take_turns

MODELS: dict[str, dict[str, int]] = {"mlp": {}, "cnn": {}, "transformer": {"n_layers": 4}}
"""The reference models, with the sizes that differ from their defaults."""

PLANS = [
    ms.Plan(dp=4),
    ms.Plan(pp=4, micro_batches=4),
    ms.Plan(pp=4, micro_batches=4, schedule="gpipe"),
    ms.Plan(pp=2, dp=2, micro_batches=4, recompute="always"),
    ms.Plan(tp=4),
    ms.Plan(pp=2, tp=2, micro_batches=4),
    ms.Plan(dp=2, tp=2, micro_batches=2),
]


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return ms.models.reference(name).model(**MODELS[name])


def _batch(name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return ms.models.reference(name).synthetic(rows, seed=1)


def _loss(name: str) -> torch.nn.Module:
    return ms.models.reference(name).loss()


def _measure(cases: list[tuple[str, ms.Plan]], rows: int) -> list[int]:
    peaks = []
    for name, plan in cases:
        engine = ms.parallelize(
            _model(name), plan, optimizer=default_optimizer, loss_fn=_loss(name)
        )
        for _ in range(2):
            engine.train_step(*_batch(name, rows))
        peaks.append(engine.memory_report().tensor_peak_bytes)
        engine.close()
    return peaks


def estimate_grid(rows: int) -> None:
    cases, estimates = [], []
    for name in MODELS:
        for plan in PLANS:
            try:
                estimate = ms.estimate_memory(
                    _model(name),
                    plan,
                    _batch(name, rows),
                    optimizer=default_optimizer,
                    loss_fn=_loss(name),
                )
            except ms.PlanError as error:  # e.g. a tp the model's widths do not divide
                print(f"{name:12s} {plan.describe():26s} refused: {str(error)[:60]}")
                continue
            cases.append((name, estimate.plan))
            estimates.append(estimate)
    measured = ms.launch(_measure, 4, args=(cases, rows), timeout_s=1200)
    print(f"\n{'model':12s} {'plan':32s} {'rank':>4s} {'est MiB':>8s} {'meas MiB':>9s} error")
    worst = 0.0
    for index, ((name, plan), estimate) in enumerate(zip(cases, estimates, strict=True)):
        label = plan.describe() + (f" {plan.recompute}" if plan.recompute != "never" else "")
        for rank, predicted in enumerate(estimate.ranks):
            real = measured[rank][index]
            error = (predicted.peak_bytes - real) / real
            worst = max(worst, abs(error))
            print(
                f"{name:12s} {label:32s} {rank:4d} {predicted.peak_bytes / 2**20:8.2f} "
                f"{real / 2**20:9.2f} {error:+.1%}"
            )
    print(f"\nlargest error over {len(cases)} cases x 4 ranks: {worst:.1%}")


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss: Any) -> None:
    optimizer.zero_grad()
    loss(model(batch[0]), batch[1]).backward()
    optimizer.step()


def tracker_overhead(rows: int, rounds: int) -> None:
    print(f"\n{'model':12s} {'ours/plain':>10s} {'MemTracker/plain':>17s} {'our peak':>9s} "
          f"{'MemTracker peak':>15s}")  # fmt: skip
    for name in MODELS:
        ratios, peaks = _overhead(name, rows, rounds)
        print(
            f"{name:12s} {ratios['ours']:10.2f} {ratios['theirs']:17.2f} "
            f"{peaks['ours'] / 2**20:9.2f} {peaks['theirs'] / 2**20:15.2f}"
        )


def _overhead(name: str, rows: int, rounds: int) -> tuple[dict[str, float], dict[str, int]]:
    """Median step time under each tracker over plain, and the peak each reports."""
    model, loss, batch = _model(name), _loss(name), _batch(name, rows)
    optimizer = default_optimizer(model.parameters())
    _step(model, optimizer, batch, loss)  # optimizer state exists from here on
    peaks: dict[str, int] = {}

    def plain() -> None:
        _step(model, optimizer, batch, loss)

    def ours() -> None:
        holders = {
            "parameters": lambda: list(model.parameters()),
            "optimizer": lambda: list(optimizer_tensors(optimizer)),
        }
        with LiveTensors(torch.device("cpu"), holders) as tracker:
            _step(model, optimizer, batch, loss)
        peaks["ours"] = tracker.peak.bytes

    def theirs() -> None:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            _step(model, optimizer, batch, loss)
        peaks["theirs"] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    runs = {"plain": plain, "ours": ours, "theirs": theirs}
    times: dict[str, list[float]] = {key: [] for key in runs}
    for index in range(rounds):
        for key in list(runs) if index % 2 == 0 else list(reversed(runs)):
            started = time.perf_counter()
            for _ in range(3):
                runs[key]()
            times[key].append((time.perf_counter() - started) / 3)
    median = {key: statistics.median(values) for key, values in times.items()}
    return {key: median[key] / median["plain"] for key in ("ours", "theirs")}, peaks


TECHNIQUES = {
    "plain": ms.Plan(dp=2),
    "zero=1": ms.Plan(dp=2, zero=1),
    "zero=2": ms.Plan(dp=2, zero=2),
    "zero=3": ms.Plan(dp=2, zero=3),
    "recompute": ms.Plan(dp=2, recompute="always"),
    "compress=bf16": ms.Plan(dp=2, compress="bf16"),
    "compress=int8": ms.Plan(dp=2, compress="int8"),
    "compress=fp8": ms.Plan(dp=2, compress="fp8"),
    "offload=optimizer": ms.Plan(dp=2, offload="optimizer"),
    "zero=3, nonfinite=off": ms.Plan(dp=2, zero=3, nonfinite="off"),
}
SHOWN = ("parameters", "gradients", "optimizer", "activations")


def _wide_transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    return ms.models.transformer(d_model=256, n_layers=4)


def _fsdp2(rows: int) -> tuple[Callable[[], None], dict[str, int]]:
    """FSDP2 by hand: each block and the root `fully_shard`ed over the world, a plain loop."""
    model = _wide_transformer()
    for name, child in model.named_children():
        if name.startswith("block"):
            fully_shard(child)
    fully_shard(model)
    optimizer, loss = default_optimizer(model.parameters()), _loss("transformer")
    x, y = _batch("transformer", rows)
    share = rows // dist.get_world_size()
    local = x[dist.get_rank() * share :][:share], y[dist.get_rank() * share :][:share]

    def step() -> None:  # the engine's step: one update, and the batch's mean loss on every rank
        optimizer.zero_grad()
        value = loss(model(local[0]), local[1])
        value.backward()
        optimizer.step()
        dist.all_reduce(value.detach().div_(dist.get_world_size()))

    step()
    holders = {
        "parameters": lambda: [local_tensor(p) for p in model.parameters()],
        "optimizer": lambda: list(optimizer_tensors(optimizer)),
    }
    with LiveTensors(torch.device("cpu"), holders) as tracker:
        step()
    return step, {"peak": tracker.peak.bytes, **tracker.peak.breakdown}


def _techniques(rows: int, rounds: int) -> dict[str, dict[str, float]]:
    """Runs in each worker: every technique's tracked peak, then step times taking turns."""
    batch = _batch("transformer", rows)
    runs: dict[str, Callable[[], Any]] = {}
    figures: dict[str, dict[str, float]] = {}
    for label, plan in TECHNIQUES.items():
        engine = ms.parallelize(
            _wide_transformer(), plan, optimizer=default_optimizer, loss_fn=_loss("transformer")
        )
        for _ in range(2):
            engine.train_step(*batch)
        report = engine.memory_report()
        figures[label] = {"peak": report.tensor_peak_bytes, **(report.tensor_breakdown or {})}
        engine.memory.track = False
        runs[label] = functools.partial(engine.train_step, *batch)
    runs["FSDP2 (torch)"], figures["FSDP2 (torch)"] = _fsdp2(rows)
    for label, values in take_turns(runs, rounds, 3).items():
        figures[label]["seconds"] = statistics.median(values)
    return figures


def techniques(rows: int, rounds: int) -> None:
    per_rank = ms.launch(_techniques, 2, args=(rows, rounds), timeout_s=1200)
    print(f"\ntransformer d_model=256 x4 blocks, dp=2, batch {rows}, Adam; rank 0 (rank 1 alike)")
    print(f"{'technique':22s} {'peak MiB':>8s} {'x plain':>7s} "
          + " ".join(f"{c[:11]:>11s}" for c in SHOWN) + f" {'step/plain':>10s}")  # fmt: skip
    figures = per_rank[0]
    plain = figures["plain"]
    for label, row in figures.items():
        parts = " ".join(f"{row.get(c, 0) / 2**20:11.2f}" for c in SHOWN)
        print(
            f"{label:22s} {row['peak'] / 2**20:8.2f} {row['peak'] / plain['peak']:7.2f} {parts} "
            f"{row['seconds'] / plain['seconds']:10.2f}"
        )
    ours, theirs = figures["zero=3"], figures["FSDP2 (torch)"]
    print(f"plain step {1e3 * plain['seconds']:.1f} ms; "
          f"zero=3 against FSDP2 by hand: step {ours['seconds'] / theirs['seconds']:.2f}x, "
          f"peak {ours['peak'] / theirs['peak']:.2f}x")  # fmt: skip


PARTS = {"estimate": estimate_grid, "tracker": tracker_overhead, "techniques": techniques}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="global batch")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--parts", default=",".join(PARTS), help="which parts, in order")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for part in args.parts.split(","):
        if part == "estimate":
            estimate_grid(args.rows)
        else:
            PARTS[part](args.rows, args.rounds)


if __name__ == "__main__":
    main()
