"""The `meshsplit` command: train a reference model under a plan, or compare every plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from meshsplit import models
from meshsplit.cli import compare_report, memory_view, plan_view, train
from meshsplit.cli.compare import CompareConfig
from meshsplit.cli.compare import compare as run_comparison
from meshsplit.cli.flags import PRECISION_FIELDS, add_plan_flags, plan_from
from meshsplit.cli.show import print_table
from meshsplit.job.launch import WorkerError
from meshsplit.plan import PlanError
from meshsplit.runtime.checkpoint import CheckpointError
from meshsplit.runtime.parallelize import default_optimizer

__all__ = ["main"]

USER_ERRORS = ("PlanError", "CheckpointError", "MemoryBudgetError")
"""Errors in what the user asked for: one line and exit code 2, no traceback."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshsplit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _train_options(commands.add_parser("train", help="train a reference model under a plan"))
    _compare_options(
        commands.add_parser("compare", help="run every plan that fits N workers, side by side")
    )
    _plan_options(
        commands.add_parser(
            "plan", help="predict every plan's step time and memory, choose one, say why"
        )
    )
    memory = commands.add_parser(
        "memory", help="each rank's memory estimate beside what its worker measures"
    )
    memory.add_argument("--model", choices=models.REFERENCE_NAMES, default="transformer")
    add_plan_flags(memory)
    memory.add_argument("--batch-size", type=int, default=64, help="global batch size")
    memory.add_argument("--out", type=Path, default=Path("meshsplit-memory"))
    return parser


def _train_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", choices=models.REFERENCE_NAMES, default="mlp")
    add_plan_flags(command)
    command.add_argument("--epochs", type=int, default=5)
    command.add_argument("--batch-size", type=int, default=64, help="global batch size")
    command.add_argument("--lr", type=float, default=1e-3)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--metrics-out", type=Path, help="write final metrics as JSON here")
    command.add_argument("--checkpoint-dir", type=Path, help="save a checkpoint after each epoch")
    command.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir",
    )
    command.add_argument(
        "--plan",
        choices=("given", "auto"),
        default="given",
        help="auto: the planner's choice for --devices (ignores --dp/--pp/--tp)",
    )
    command.add_argument("--devices", type=int, default=2, help="for --plan auto")
    command.add_argument(
        "--timeline",
        type=Path,
        metavar="DIR",
        help="after training, record one extra step (the first batch) on every rank: "
        "DIR/timeline.json (Chrome trace, for Perfetto) and DIR/timeline.png (Gantt)",
    )


def _compare_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", choices=models.REFERENCE_NAMES, default="cnn")
    command.add_argument("--devices", type=int, default=4, help="worker processes per plan")
    command.add_argument("--out", type=Path, default=Path("meshsplit-compare"))
    command.add_argument(
        "--steps", type=int, default=8, help="steps per plan (the first two untimed; median)"
    )
    command.add_argument("--batch-size", type=int, default=64)
    command.add_argument("--micro-batches", type=int, default=4, help="for plans with pp > 1")
    command.add_argument(
        "--memory-budget", help="per rank, e.g. 64MiB: plans whose estimate passes it are refused"
    )
    command.add_argument(
        "--include-ps",
        action="store_true",
        help="also run parameter-server plans (1-2 servers, staleness 0 and 2)",
    )
    add_plan_flags(command, PRECISION_FIELDS)


def _plan_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", choices=models.REFERENCE_NAMES, default="transformer")
    command.add_argument("--devices", type=int, default=4)
    command.add_argument("--batch-size", type=int, default=64, help="global batch size")
    command.add_argument("--memory-budget", help="per rank, e.g. 64MiB: plans over it are dropped")
    command.add_argument(
        "--cluster",
        help="price a machine that is not here: a cluster JSON file or dgx-a100, dgx-h100, "
        "dgx-h200",
    )
    command.add_argument("--json", type=Path, help="write the whole report here")
    command.add_argument("--top", type=int, default=12, help="plans in the table")
    add_plan_flags(command, PRECISION_FIELDS)


def plan(args: argparse.Namespace) -> None:
    report = plan_view.choose(
        args.model,
        args.devices,
        args.batch_size,
        args.memory_budget,
        args.cluster,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
    )
    print_table(plan_view.table(report, top=args.top))
    if args.json:
        Console().print(f"wrote {plan_view.write(report, args.json)}")


def compare(args: argparse.Namespace) -> None:
    config = CompareConfig(
        model=args.model,
        devices=args.devices,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        memory_budget=args.memory_budget,
        include_ps=args.include_ps,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
    )
    if config.devices < 1:
        raise PlanError(f"--devices={config.devices} must be at least 1")
    rows = run_comparison(config, record=True)
    print_table(compare_report.table(config, rows))
    for path in compare_report.write(config, rows, args.out):
        Console().print(f"wrote {path}")


def memory(args: argparse.Namespace) -> None:
    plan = plan_from(args)
    reference = models.reference(args.model)
    plan.check_batch(args.batch_size)
    batch = reference.example_batch(args.batch_size)
    estimate, measured = memory_view.measure(
        reference.build, plan, batch, default_optimizer, reference.loss()
    )
    print_table(memory_view.table(estimate, measured))
    note = memory_view.against_fp32(
        estimate.plan, reference.build, batch, default_optimizer, reference.loss()
    )
    if note is not None:
        Console().print(note, highlight=False)
    for path in memory_view.write(estimate, measured, args.out):
        Console().print(f"wrote {path}")


COMMANDS = {"train": train.run, "compare": compare, "memory": memory, "plan": plan}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        COMMANDS[args.command](args)
    except (PlanError, CheckpointError) as error:
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 2
    except WorkerError as error:
        if error.error_type == "TrainingStopped":  # preempted: saved, and says how to resume
            console.print(f"[yellow]stopped:[/] {error.message}", highlight=False)
            return 143
        if error.error_type in USER_ERRORS:
            console.print(f"[red]error:[/] {error.message}", highlight=False)
            return 2
        console.print(f"[red]error:[/] {error}", highlight=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
