"""Activation compression and bf16 pipeline transfers: accuracy, bytes saved, step time.

Part 1 (one worker): the MLP and the CNN train 5 epochs on digits (batch 64, Adam lr 1e-3,
as `meshsplit train`) uncompressed and under each Plan.compress; prints the test accuracy
beside the uncompressed one, the saved-activation bytes against uncompressed (the largest
count of 'activations' in one step, from ms.estimate_memory's timeline), and the step time
against uncompressed (rounds A B C D D C B A, median). Part 2 (two workers, pp=2): the same
with Plan.compress_transfers='bf16': accuracy, p2p bytes sent per step, step time.

Each accuracy is the mean of `--seeds` trainings (weights and shuffle seeded 0, 1, ...),
with the lowest and highest: one seed's noise on the 359 test images is about a point.

    python benchmarks/bench_compress.py [--epochs 5] [--rounds 6] [--steps 4] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms
from meshsplit.job.traffic import count_traffic
from meshsplit.memory.tracker import CATEGORIES
from meshsplit.runtime.parallelize import default_optimizer

from rounds import take_turns

MODELS = ("mlp", "cnn")
KINDS = ("none", "bf16", "int8", "fp8")
BATCH = 64


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ms.models.reference(name).model()


def _engine(name: str, plan: ms.Plan, seed: int) -> ms.Engine:
    engine = ms.parallelize(
        _model(name, seed),
        plan,
        optimizer=default_optimizer,
        loss_fn=ms.models.reference(name).loss(),
    )
    engine.memory.track = False  # the tracker's own cost would blur the step times
    return engine


def _train_and_time(
    name: str, plans: dict[str, ms.Plan], epochs: int, rounds: int, steps: int, seeds: int
) -> dict[str, dict[str, float]]:
    """Runs in every worker: test accuracy after `epochs` (the mean over `seeds` seeds of
    weights and shuffle, and the lowest and highest), median step time, p2p bytes/step."""
    reference = ms.models.reference(name)
    train, test = reference.data("train"), reference.data("test")
    figures: dict[str, dict[str, float]] = {}
    for label, plan in plans.items():
        accuracies = []
        for seed in range(seeds):
            engine = _engine(name, plan, seed)
            history = engine.fit(
                train, epochs=epochs, batch_size=BATCH, eval_data=test, show=False, seed=seed
            )
            accuracies.append(history[-1]["test_accuracy"])
            engine.close()
        figures[label] = {
            "accuracy": statistics.mean(accuracies),
            "lowest": min(accuracies),
            "highest": max(accuracies),
        }
    engines = {label: _engine(name, plan, 0) for label, plan in plans.items()}
    batch = train[0][:BATCH].clone(), train[1][:BATCH].clone()  # a batch of its own storage
    for label, engine in engines.items():
        with count_traffic() as traffic:
            engine.train_step(*batch)  # headers went with the first step: this one is steady
        figures[label]["p2p_bytes"] = traffic.bytes["isend"]
    runs = {label: (lambda e=engine: e.train_step(*batch)) for label, engine in engines.items()}
    times = take_turns(runs, rounds, steps)
    for label, values in times.items():
        figures[label]["seconds"] = statistics.median(values)
    for engine in engines.values():
        engine.close()
    dist.barrier()
    return figures


def _saved_bytes(name: str, kind: str) -> int:
    """The largest count of saved-activation bytes in one step (one rank, this process)."""
    reference = ms.models.reference(name)
    train = reference.data("train")
    estimate = ms.estimate_memory(
        _model(name),
        ms.Plan(compress=kind),
        (train[0][:BATCH].clone(), train[1][:BATCH].clone()),
        optimizer=default_optimizer,
        loss_fn=reference.loss(),
        timeline=True,
    )
    at = CATEGORIES.index("activations")
    return max(sample.bytes_by_category[at] for sample in estimate.ranks[0].timeline)


def compress_activations(epochs: int, rounds: int, steps: int, seeds: int) -> None:
    print(f"{'model':6s} {'compress':8s} {'test acc':>8s} {'lowest-highest':>14s} "
          f"{'vs none':>8s} "
          f"{'saved bytes':>12s} {'none/this':>9s} {'step/none':>9s}")  # fmt: skip
    for name in MODELS:
        plans = {kind: ms.Plan(compress=kind) for kind in KINDS}
        saved = {kind: _saved_bytes(name, kind) for kind in KINDS}
        (figures,) = ms.launch(_train_and_time, 1, args=(name, plans, epochs, rounds, steps, seeds))
        base = figures["none"]
        for kind in KINDS:
            row = figures[kind]
            print(
                f"{name:6s} {kind:8s} {row['accuracy']:8.4f} "
                f"{row['lowest']:7.4f}-{row['highest']:.4f} "
                f"{100 * (row['accuracy'] - base['accuracy']):+7.2f}p "
                f"{saved[kind]:12d} {saved['none'] / saved[kind]:9.2f} "
                f"{row['seconds'] / base['seconds']:9.2f}"
            )


def compress_transfers(epochs: int, rounds: int, steps: int, seeds: int) -> None:
    print(f"\n{'model':6s} {'pp=2 transfers':14s} {'test acc':>8s} {'lowest-highest':>14s} "
          f"{'vs none':>8s} "
          f"{'p2p bytes/step, rank 0,1':>25s} {'none/this':>9s} {'step/none':>9s}")  # fmt: skip
    for name in MODELS:
        plans = {
            kind: ms.Plan(pp=2, micro_batches=2, compress_transfers=kind)
            for kind in ("none", "bf16")
        }
        per_rank = ms.launch(_train_and_time, 2, args=(name, plans, epochs, rounds, steps, seeds))
        for kind in plans:
            row, base = per_rank[0][kind], per_rank[0]["none"]
            sent = [per_rank[r][kind]["p2p_bytes"] for r in range(2)]
            ratio = [per_rank[r]["none"]["p2p_bytes"] / sent[r] for r in range(2)]
            print(
                f"{name:6s} {kind:14s} {row['accuracy']:8.4f} "
                f"{row['lowest']:7.4f}-{row['highest']:.4f} "
                f"{100 * (row['accuracy'] - base['accuracy']):+7.2f}p "
                f"{sent[0]:>12d} {sent[1]:>12d} {ratio[0]:4.2f},{ratio[1]:4.2f} "
                f"{row['seconds'] / base['seconds']:9.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--seeds", type=int, default=3, help="trainings per accuracy figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compress_activations(args.epochs, args.rounds, args.steps, args.seeds)
    compress_transfers(args.epochs, args.rounds, args.steps, args.seeds)


if __name__ == "__main__":
    main()
