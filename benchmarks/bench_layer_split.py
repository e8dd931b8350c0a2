"""Layer split: meshsplit's pipeline against torch.distributed.pipelining, same everything else.

Same model (an MLP with uneven layer widths), same chunks (meshsplit's automatic split, handed
to PyTorch's stages), same micro-batches, same optimizer, 2 local workers with 1 thread each.
Five schedules, each against the torch schedule that runs the same kind of work:

    meshsplit                   torch                           stages per rank
    gpipe                       ScheduleGPipe                   1
    1f1b                        Schedule1F1B                    1
    interleaved, v=2            ScheduleInterleaved1F1B         2 (chunks r and r+p)
    zero-bubble (ZB-H1)         ScheduleInterleavedZeroBubble   1 (its ZB1P at one stage
                                                                   per rank is ZB-H1)
    zbv (ZB-V)                  ScheduleZBVZeroBubble           2 (chunks r and 2p-1-r;
                                                                   each library its own order)

gpipe, 1f1b and zero-bubble share one split (1f1b's, pinned with Plan.stages); interleaved
and zbv have their own of 2p chunks. The runs take turns within each round (A B B A across
rounds), so a slow moment on a shared machine hits all of them; the median round is
reported.

Prints samples/s, ours/theirs per schedule, ours against torch's same step ending as
meshsplit's does (an all-reduce that gives every rank the step's loss and whether any rank's
gradients held a NaN or infinity, before the optimizer step: "agreeing"), and each schedule
against 1F1B of the same library; the bubble, measured on meshsplit's recorded timeline
(idle time / compute time, beside the papers' (p-1)/m, (p-1)/(v*m), about (p-1)/(3m)) and
as an idle share (beside the schedule's at the papers' costs); the pipeline efficiency, the
speed-up over one process (1 thread, whole batch) divided by p; and the balance
(slowest/fastest rank, profiled).

    PYTHONPATH=src python benchmarks/bench_layer_split.py [--quick] [--batch 256 --micro-batches 8]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import meshsplit as ms
from meshsplit.cli.timeline import Event
from meshsplit.pipeline.schedules import chunk_ranks
from meshsplit.pipeline.schedules import schedule as our_order

from rounds import take_turns

WIDTHS = (784, 1536, 256, 1024, 768, 512, 1024, 256, 10)
"""Uneven widths: the layers' costs differ by up to ~6x, so a split by layer count is unbalanced."""
STAGES = 2
VIRTUAL = 2
"""Chunks per rank under the interleaved schedule."""
COMPUTE = ("forward", "backward", "weight gradients")
"""The phases (phases.py names) that are a stage's work; all else on the timeline is idle."""
SCHEDULES: dict[str, tuple[type, bool]] = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved": (ScheduleInterleaved1F1B, True),
    "zero-bubble": (ScheduleInterleavedZeroBubble, True),
    "zbv": (ScheduleZBVZeroBubble, True),
}
"""meshsplit schedule -> (the torch schedule class that runs the same order, whether it takes
a list of stages: the multi-stage classes)."""


def _theirs(
    schedule: str,
    layers: list[nn.Module],
    sizes: tuple[int, ...],
    micro: int,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    agree: bool = False,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], bool | None]:
    """torch's `schedule` over this rank's chunks (r, r+p, ...; r and 2p-1-r under zbv) of
    `layers` cut by `sizes` (layers per chunk, as meshsplit cut them, so a difference in time
    is the runtime's, not the split's): one train step on the global batch, and same_order's
    verdict. With `agree`, the step ends as meshsplit's does before its optimizer step: every
    rank sums its gradients (a NaN or infinity shows in a sum) and one all-reduce gives every
    rank the step's loss and whether any rank saw a non-finite gradient."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    placement = chunk_ranks(pp, len(sizes) // pp, schedule)
    chunks = [chunk for chunk, held in enumerate(placement) if held == rank]
    modules = [nn.Sequential(*layers[starts[c] : starts[c + 1]]) for c in chunks]
    stages = [
        PipelineStage(module, chunk, len(sizes), torch.device("cpu"))
        for module, chunk in zip(modules, chunks, strict=True)
    ]
    kind, multi = SCHEDULES[schedule]
    runner = kind(
        stages if multi else stages[0], n_microbatches=micro, loss_fn=nn.CrossEntropyLoss()
    )
    params = [p for m in modules for p in m.parameters()]
    step_optimizer = optimizer(params)
    first, last = 0 in chunks, len(sizes) - 1 in chunks

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        """One step: the batch goes in on the first chunk's rank, targets on the last's."""
        losses: list[torch.Tensor] = []
        runner.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        if not agree or _agreed_finite(params, losses):
            step_optimizer.step()
        step_optimizer.zero_grad()

    return step, same_order(runner, schedule, micro)


def _agreed_finite(params: list[nn.Parameter], losses: list[torch.Tensor]) -> bool:
    """The closing exchange meshsplit's step makes, written with torch: the step's loss to
    every rank (read on the host, as train_step returns a float) and whether every rank's
    gradients are finite."""
    sums = [p.grad.sum(dtype=torch.float32) for p in params if p.grad is not None]
    bad = (~torch.stack(sums).isfinite().all()).to(torch.float32)
    loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    agreed = torch.stack([loss.to(torch.float32), bad])
    dist.all_reduce(agreed)
    _, nonfinite = agreed.tolist()
    return nonfinite == 0


def same_order(runner: Any, name: str, micro: int) -> bool | None:
    """Whether torch's schedule runs every rank's work in meshsplit's order (its I, the input
    gradient, is our B; its stage is our chunk). None for the single-stage classes: their
    step does not run their pipeline_order, a description (1F1B's numbers the last rank's
    forwards from 1), so it proves nothing."""
    if not SCHEDULES[name][1]:
        return None
    order = runner.pipeline_order
    ours = our_order(name, STAGES, micro, _virtual(name))
    kinds = {"F": "F", "I": "B", "B": "B", "W": "W"}
    for rank, actions in order.items():
        theirs = [
            (kinds[a.computation_type.value], a.microbatch_index, a.stage_index)
            for a in actions
            if a is not None and a.computation_type.value in kinds  # not REDUCE_GRAD
        ]
        if theirs != [(a.kind, a.micro, rank if a.chunk is None else a.chunk) for a in ours[rank]]:
            return False
    return True


def _model() -> nn.Sequential:
    """The benchmark's model, the same weights every time it is built."""
    torch.manual_seed(0)
    return ms.models.mlp(WIDTHS)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    """Plain SGD: its step is cheap, so the schedules' differences show."""
    return torch.optim.SGD(params, lr=0.01)


def _virtual(name: str) -> int:
    """Chunks per rank of schedule `name`."""
    return {"interleaved": VIRTUAL, "zbv": 2}.get(name, 1)


def _plan(name: str, micro: int, sizes: tuple[int, ...] | None) -> ms.Plan:
    """meshsplit's plan for schedule `name`; `sizes` pins the split (None: profile-balanced),
    so schedules compared with each other run on the same stages."""
    virtual = _virtual(name)
    return ms.Plan(
        pp=STAGES, micro_batches=micro, schedule=name, virtual_stages=virtual, stages=sizes
    )


def _single(x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """The whole model in one process on the global batch (rank 0; other ranks idle)."""
    model = _model()
    optimizer = _optimizer(model.parameters())
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        """One step of the baseline the pipeline efficiency divides by."""
        if dist.get_rank() == 0:
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    return step


def idle_of(events: Sequence[Event], ranks: int) -> tuple[float, float]:
    """(idle / compute, idle / (ranks x span)) of one recorded step's pipeline, where compute
    is the forward, backward and weight-gradient phases less the waits inside them, and span
    runs from the first of them to the last (gradient sync and the optimizer excluded)."""
    work = [e for e in events if e.depth == 0 and e.name.startswith(COMPUTE)]
    waits = [
        w
        for w in events
        if w.kind == "wait"
        and any(e.rank == w.rank and e.start_s <= w.start_s <= w.end_s <= e.end_s for e in work)
    ]
    busy = sum(e.duration_s for e in work) - sum(w.duration_s for w in waits)
    room = ranks * (max(e.end_s for e in work) - min(e.start_s for e in work))
    return (room - busy) / busy, (room - busy) / room


def _bubbles(engine: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, float]:
    """Median over `steps` recorded steps of idle_of: the bubble as the timeline shows it,
    recorded after the timed rounds so the recording's cost stays out of the times."""
    measured = [idle_of(ms.timeline.record_step(engine, x, y), STAGES) for _ in range(steps)]
    return (
        statistics.median(m[0] for m in measured),
        statistics.median(m[1] for m in measured),
    )


def _worker(batch: int, micro: int, steps: int, rounds: int, recorded: int) -> dict[str, Any]:
    """Every rank: build both libraries' runs of each schedule, time them in turns, then
    record meshsplit's steps for the bubble; rank 0's result is printed."""
    torch.set_num_threads(1)
    x, y = ms.data.synthetic_images(batch, seed=0)

    def build(name: str, sizes: tuple[int, ...] | None) -> Any:
        """meshsplit's engine of schedule `name`."""
        return ms.parallelize(
            _model(),
            _plan(name, micro, sizes),
            optimizer=_optimizer,
            loss_fn=nn.CrossEntropyLoss(),
            example_inputs=x[: batch // micro],
        )

    ours = {"1f1b": build("1f1b", None)}
    split = ours["1f1b"].runner.sizes
    ours |= {name: build(name, split) for name in ("gpipe", "zero-bubble")}
    ours |= {name: build(name, None) for name in ("interleaved", "zbv")}
    sizes = {name: tuple(ours[name].runner.sizes) for name in SCHEDULES}
    theirs = {
        name: _theirs(name, list(_model().children()), sizes[name], micro, _optimizer)
        for name in SCHEDULES
    }
    agreeing = {
        name: _theirs(name, list(_model().children()), sizes[name], micro, _optimizer, True)
        for name in SCHEDULES
    }
    runs: dict[str, Callable[[], Any]] = {"one process": _single(x, y)}
    for name in SCHEDULES:
        runs[f"meshsplit {name}"] = lambda engine=ours[name]: engine.train_step(x, y)
        runs[f"torch {name}"] = lambda step=theirs[name][0]: step(x, y)
        runs[f"torch {name}, agreeing"] = lambda step=agreeing[name][0]: step(x, y)
    times = take_turns(runs, rounds, steps)
    bubbles = {name: _bubbles(ours[name], x, y, recorded) for name in SCHEDULES}
    described = {name: ours[name].describe() for name in SCHEDULES}
    for engine in ours.values():
        engine.close()
    orders = {name: theirs[name][1] for name in SCHEDULES}
    return {
        "times": times,
        "describe": described,
        "sizes": sizes,
        "bubbles": bubbles,
        "same_order": orders,
    }


def formula(name: str, stages: int, micro: int) -> float:
    """The papers' bubble / compute: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved,
    about (p-1)/(3m) for ZB-H1 (its W fills two thirds of 1F1B's bubble at F = B = W), none
    for ZB-V (its paper's schedule at F = B = W)."""
    if name == "zbv":
        return 0.0
    per = {"interleaved": VIRTUAL * micro, "zero-bubble": 3 * micro}.get(name, micro)
    return (stages - 1) / per


def _speed_table(result: dict[str, Any], median: dict[str, float], args: Any) -> Table:
    """One row per schedule: both libraries' samples/s, ours/theirs (torch's step as it is,
    and ending with meshsplit's closing exchange), and each against its own 1F1B, so a
    schedule's gain is read within one library, apart from the runtime's."""
    table = Table(
        title=f"layer split, pp={STAGES}, m={args.micro_batches}, batch {args.batch}, "
        f"widths {'-'.join(map(str, WIDTHS))}"
    )
    columns = ("schedule", "torch schedule", "same order", "chunks (layers)", "meshsplit samples/s",
               "torch samples/s", "ours/theirs", "ours/theirs, agreeing", "ours vs 1f1b",
               "torch vs 1f1b")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for name in SCHEDULES:
        ours, theirs = median[f"meshsplit {name}"], median[f"torch {name}"]
        table.add_row(
            name,
            SCHEDULES[name][0].__name__,
            {True: "yes", False: "no", None: "-"}[result["same_order"][name]],
            str(list(result["sizes"][name])),
            f"{args.batch / ours:.0f}",
            f"{args.batch / theirs:.0f}",
            f"{theirs / ours:.2f}",
            f"{median[f'torch {name}, agreeing'] / ours:.2f}",
            f"{median['meshsplit 1f1b'] / ours:.2f}",
            f"{median['torch 1f1b'] / theirs:.2f}",
        )
    return table


def _bubble_table(result: dict[str, Any], median: dict[str, float], args: Any) -> Table:
    """One row per schedule: the bubble in theory and on meshsplit's timeline, and the
    pipeline efficiency (one-process time / (p x step time)) of both libraries."""
    table = Table(
        title="bubble: idle / compute (formula, measured on meshsplit's timeline), idle share "
        "(schedule at the papers' costs, measured), pipeline efficiency"
    )
    columns = ("schedule", "formula", "measured", "idle share, schedule", "idle share, measured",
               "efficiency meshsplit", "efficiency torch")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    single = median["one process"]
    for name in SCHEDULES:
        ratio, share = result["bubbles"][name]
        table.add_row(
            name,
            f"{formula(name, STAGES, args.micro_batches):.3f}",
            f"{ratio:.3f}",
            f"{result['describe'][name]['bubble_fraction']:.3f}",
            f"{share:.3f}",
            f"{single / (STAGES * median[f'meshsplit {name}']):.2f}",
            f"{single / (STAGES * median[f'torch {name}']):.2f}",
        )
    return table


def _balance(description: dict[str, Any]) -> str:
    """Slowest/fastest rank of a split, by profiled forward + backward per micro-batch: an
    unbalanced split adds idle time no schedule removes."""
    costs = [0.0] * STAGES
    for chunk in description["stages"]:
        costs[chunk["stage"]] += chunk["forward_ms"] + chunk["backward_ms"]
    return f"{max(costs) / min(costs):.3f} ({', '.join(f'{c:.2f} ms' for c in costs)})"


def main() -> None:
    """Parse the settings, run the workers, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--recorded", type=int, default=5, help="steps recorded for the bubble")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps, 1 recorded")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.recorded = 2, 2, 1
    result = ms.launch(
        _worker,
        STAGES,
        args=(args.batch, args.micro_batches, args.steps, args.rounds, args.recorded),
    )[0]
    median = {name: statistics.median(values) for name, values in result["times"].items()}
    console = Console(width=170)
    console.print(_speed_table(result, median, args))
    console.print(_bubble_table(result, median, args))
    single = median["one process"]
    console.print(f"one process, 1 thread, whole batch: {args.batch / single:.0f} samples/s")
    console.print(
        "balance of the automatic splits, slowest/fastest rank (forward + backward per "
        f"micro-batch): 1f1b {_balance(result['describe']['1f1b'])}, "
        f"interleaved {_balance(result['describe']['interleaved'])}"
    )


if __name__ == "__main__":
    main()
