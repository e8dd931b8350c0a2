"""The `meshsplit` command: train a reference model under a plan, or compare every plan."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from meshsplit import data, models, tensor
from meshsplit.cli import compare_report, memory_view, plan_view, timeline
from meshsplit.cli.compare import CompareConfig
from meshsplit.cli.compare import compare as run_comparison
from meshsplit.job.launch import WorkerError, launch
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.choose import PlanReport, choose_plan, predict_plan
from meshsplit.planner.simulate import estimate_memory
from meshsplit.runtime.checkpoint import CheckpointError
from meshsplit.runtime.engine import Engine, parallelize

__all__ = ["main"]

MODELS = ("mlp", "cnn", "transformer")
USER_ERRORS = ("PlanError", "CheckpointError", "MemoryBudgetError")
"""Errors in what the user asked for: one line and exit code 2, no traceback."""


def build_model(name: str) -> torch.nn.Module:
    """A reference model by name, with its default sizes."""
    builders: dict[str, Callable[[], torch.nn.Module]] = {
        "mlp": models.mlp,
        "cnn": models.cnn,
        "transformer": models.transformer,
    }
    return builders[name]()


def model_data(name: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits for the image models; learnable counting sequences for the transformer."""
    if name == "transformer":
        return data.counting_tokens(
            2048 if split == "train" else 512, seed=0 if split == "train" else 1
        )
    return data.digits(split)


def loss_for(name: str) -> torch.nn.Module:
    return models.TokenCrossEntropy() if name == "transformer" else torch.nn.CrossEntropyLoss()


def _train_worker(options: dict[str, Any]) -> dict[str, Any]:
    """Runs in every worker: build, split, train, evaluate; returns this rank's results."""
    torch.manual_seed(options["seed"])
    name = options["model"]
    plan = Plan(**options["plan"])
    train_data = model_data(name, "train")
    micro_rows = options["batch_size"] // (plan.dp * plan.micro_batches)
    engine = parallelize(
        build_model(name),
        plan,
        optimizer=lambda params: torch.optim.Adam(params, lr=options["lr"]),
        loss_fn=loss_for(name),
        example_inputs=train_data[0][:micro_rows],
    )
    if engine.plan.tp > 1 and engine.mesh.is_first_rank:
        Console().print(operator_split_table(engine.describe()["operator_split"]))
    if engine.plan.pp > 1 and engine.mesh.is_first_rank:
        Console().print(stage_table(engine.describe()))
    batchnorm = engine.describe()["batchnorm"]
    if batchnorm and engine.mesh.is_first_rank:
        Console().print(f"{batchnorm['dp']}\n{batchnorm['pp']}")
    checkpoint_dir = options["checkpoint_dir"]
    if options["resume"]:
        engine.load(checkpoint_dir)
    test = model_data(name, "test")
    history = engine.fit(
        train_data,
        epochs=options["epochs"],
        batch_size=options["batch_size"],
        eval_data=test,
        seed=options["seed"],
        checkpoint_dir=checkpoint_dir,
    )
    scores = history[-1] if history else {"test_accuracy": engine.evaluate(*test)["accuracy"]}
    memory = engine.memory_report().as_dict()
    if options["timeline"] is not None:
        first = (train_data[0][: options["batch_size"]], train_data[1][: options["batch_size"]])
        _write_timeline(engine, first, options["timeline"], options["predicted"])
    engine.close()
    return {"history": history, "memory": memory, "test_accuracy": scores["test_accuracy"]}


def _write_timeline(
    engine: Engine,
    batch: tuple[Any, Any],
    directory: Path,
    predicted: list[timeline.Event] | None,
) -> None:
    """One more step, recorded on every rank; rank 0 writes timeline.json and timeline.png,
    with the planner's predicted schedule beside the measured one."""
    events = timeline.record_step(engine, *batch)
    if engine.mesh.is_first_rank:
        directory.mkdir(parents=True, exist_ok=True)
        timeline.write_chrome_trace(events, directory / "timeline.json", predicted)
        title = f"one training step, {engine.plan.describe()}: measured and predicted"
        timeline.draw_gantt(events, directory / "timeline.png", predicted, title=title)


def operator_split_table(rows: list[dict[str, str]]) -> Table:
    """One row per layer with parameters: what it is, how it splits over tp, and why."""
    table = Table(title="operator split")
    for column in ("name", "layer", "split", "reason"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["layer"], row["split"], row["reason"])
    return table


def stage_table(description: dict[str, Any]) -> Table:
    """describe() of a layer split as a table: one row per stage, the schedule below it."""
    table = Table(
        title=f"layer split ({description['layers_from']})",
        caption=f"bubble (p-1)/(m+p-1) = {description['bubble_fraction']:.1%}\n"
        + description["schedule"],
    )
    for column in ("stage", "layers", "parameters", "forward ms", "backward ms"):
        table.add_column(column, justify="left" if column == "layers" else "right")
    for stage in description["stages"]:
        table.add_row(
            str(stage["stage"]),
            " ".join(stage["layers"]),
            f"{stage['parameters']:,}",
            f"{stage['forward_ms']:.2f}",
            f"{stage['backward_ms']:.2f}",
        )
    return table


def _plan_options(command: argparse.ArgumentParser) -> None:
    """The options that make a Plan, shared by train and memory."""
    command.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    command.add_argument("--pp", type=int, default=1, help="pipeline stages (layer split)")
    command.add_argument("--tp", type=int, default=1, help="operator-split width")
    command.add_argument("--micro-batches", type=int, default=1)
    command.add_argument("--schedule", default="1f1b", help="1f1b or gpipe")
    command.add_argument(
        "--recompute",
        default="never",
        help="activation recomputation: never, except_last, always or auto (fits the budget)",
    )
    command.add_argument(
        "--memory-budget", help="live tensor bytes per rank, e.g. 2GiB; checked before launch"
    )
    command.add_argument(
        "--zero", type=int, default=0, help="sharded state over dp: 0-3 (ZeRO stage)"
    )
    command.add_argument(
        "--compress", default="none", help="saved activations: none, bf16, int8 or fp8 (lossy)"
    )
    command.add_argument(
        "--compress-transfers", default="none", help="pipeline p2p: none or bf16 (lossy)"
    )
    command.add_argument(
        "--offload", default="none", help="none, optimizer or activations (GPU only)"
    )
    command.add_argument(
        "--sync", default="allreduce", help="allreduce, or ps (parameter servers beside dp)"
    )
    command.add_argument("--servers", type=int, help="parameter-server processes (--sync ps)")
    command.add_argument(
        "--staleness", type=int, default=0, help="--sync ps: updates a worker may lag (0: exact)"
    )


def _plan_from(args: argparse.Namespace) -> Plan:
    return Plan(
        dp=args.dp,
        pp=args.pp,
        tp=args.tp,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
        checkpoint=args.recompute,
        memory_budget=args.memory_budget,
        zero=args.zero,
        compress=args.compress,
        compress_transfers=args.compress_transfers,
        offload=args.offload,
        sync=args.sync,
        servers=args.servers,
        staleness=args.staleness,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshsplit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a reference model under a plan")
    train.add_argument("--model", choices=MODELS, default="mlp")
    _plan_options(train)
    train.add_argument("--epochs", type=int, default=5)
    train.add_argument("--batch-size", type=int, default=64, help="global batch size")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--metrics-out", type=Path, help="write final metrics as JSON here")
    train.add_argument("--checkpoint-dir", type=Path, help="save a checkpoint after each epoch")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir",
    )
    train.add_argument(
        "--plan",
        choices=("given", "auto"),
        default="given",
        help="auto: the planner's choice for --devices (ignores --dp/--pp/--tp)",
    )
    train.add_argument("--devices", type=int, default=2, help="for --plan auto")
    train.add_argument(
        "--timeline",
        type=Path,
        metavar="DIR",
        help="after training, record one extra step (the first batch) on every rank: "
        "DIR/timeline.json (Chrome trace, for Perfetto) and DIR/timeline.png (Gantt)",
    )
    compare = commands.add_parser(
        "compare", help="run every plan that fits N workers, side by side"
    )
    compare.add_argument("--model", choices=MODELS, default="cnn")
    compare.add_argument("--devices", type=int, default=4, help="worker processes per plan")
    compare.add_argument("--out", type=Path, default=Path("meshsplit-compare"))
    compare.add_argument("--steps", type=int, default=6, help="steps per plan (first untimed)")
    compare.add_argument("--batch-size", type=int, default=64)
    compare.add_argument("--micro-batches", type=int, default=4, help="for plans with pp > 1")
    compare.add_argument(
        "--memory-budget", help="per rank, e.g. 64MiB: plans whose estimate passes it are refused"
    )
    compare.add_argument(
        "--include-ps",
        action="store_true",
        help="also run parameter-server plans (1-2 servers, staleness 0 and 2)",
    )
    plan = commands.add_parser(
        "plan", help="predict every plan's step time and memory, choose one, say why"
    )
    plan.add_argument("--model", choices=MODELS, default="transformer")
    plan.add_argument("--devices", type=int, default=4)
    plan.add_argument("--batch-size", type=int, default=64, help="global batch size")
    plan.add_argument("--memory-budget", help="per rank, e.g. 64MiB: plans over it are dropped")
    plan.add_argument(
        "--cluster",
        help="price a machine that is not here: a cluster JSON file or dgx-a100, dgx-h100, "
        "dgx-h200",
    )
    plan.add_argument("--json", type=Path, help="write the whole report here")
    plan.add_argument("--top", type=int, default=12, help="plans in the table")
    memory = commands.add_parser(
        "memory", help="each rank's memory estimate beside what its worker measures"
    )
    memory.add_argument("--model", choices=MODELS, default="transformer")
    _plan_options(memory)
    memory.add_argument("--batch-size", type=int, default=64, help="global batch size")
    memory.add_argument("--out", type=Path, default=Path("meshsplit-memory"))
    return parser


def _adam(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _first_batch(name: str, plan: Plan, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan.check_batch(batch_size)
    inputs, targets = model_data(name, "train")
    return inputs[:batch_size], targets[:batch_size]


def _choose(args: argparse.Namespace, cluster: str | None = None) -> PlanReport:
    inputs, targets = model_data(args.model, "train")
    batch = inputs[: args.batch_size], targets[: args.batch_size]
    return choose_plan(
        build_model(args.model),
        batch,
        args.devices,
        optimizer=_adam,
        loss_fn=loss_for(args.model),
        memory_budget=args.memory_budget,
        cluster=cluster,
    )


def plan(args: argparse.Namespace) -> None:
    report = _choose(args, args.cluster)
    console = Console() if Console().is_terminal else Console(width=160)
    console.print(plan_view.table(report, top=args.top))
    if args.json:
        console.print(f"wrote {plan_view.write(report, args.json)}")


def train(args: argparse.Namespace) -> None:
    plan, chosen = _plan_from(args), None
    if args.plan == "auto":
        report = _choose(args)
        plan, chosen = report.best, report.rows[0].prediction
        Console().print(
            f"planner: {plan.describe()}, predicted {chosen.step_time_s * 1e3:.1f} ms "
            f"per step, the fastest of {len(report.rows)} plans for {args.devices} devices"
        )
    batch = _first_batch(args.model, plan, args.batch_size)
    # refuse before launch what will not fit (the planner's choice was estimated already;
    # parameter servers hold themselves to the budget when they start)
    if plan.memory_budget is not None and chosen is None and plan.sync != "ps":
        optimizer = functools.partial(_adam, lr=args.lr)
        estimate_memory(
            build_model(args.model), plan, batch, optimizer=optimizer, loss_fn=loss_for(args.model)
        ).check()
    if args.epochs < 1:
        raise PlanError(f"--epochs={args.epochs} must be at least 1")
    if args.resume and args.checkpoint_dir is None:
        raise PlanError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if plan.sync == "ps" and (args.checkpoint_dir or args.timeline):
        raise PlanError(
            "--sync ps takes neither --checkpoint-dir nor --timeline: the optimizer state and "
            "the updates live on the servers; use --sync allreduce for those"
        )
    if plan.tp > 1:
        tensor.plan_splits(build_model(args.model), plan.tp)  # refuse a bad tp before launch
    options = {
        "model": args.model,
        "plan": plan.as_dict(),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "checkpoint_dir": args.checkpoint_dir,
        "resume": args.resume,
        "timeline": args.timeline,
        "predicted": None,
    }
    if args.timeline is not None:  # the planner's schedule of the same step, to draw beside it
        prediction = chosen or predict_plan(
            build_model(args.model),
            batch,
            plan,
            optimizer=functools.partial(_adam, lr=args.lr),
            loss_fn=loss_for(args.model),
        )
        options["predicted"] = timeline.predicted_events(prediction)
    results = launch(_train_worker, plan.world_size, args=(options,))
    results, servers = results[: plan.mesh_size], results[plan.mesh_size :]  # servers' summaries
    history = results[0]["history"]
    last = history[-1] if history else {"loss": None, "samples_per_second": None}
    metrics = {
        "model": args.model,
        "plan": plan.as_dict(),
        "test_accuracy": results[0]["test_accuracy"],
        "final_loss": last["loss"],
        "samples_per_second": last["samples_per_second"],
        "peak_memory_bytes": [result["memory"]["peak_bytes"] for result in results]
        + [server["held_bytes"] for server in servers],
        "memory": [result["memory"] for result in results],
        "servers": servers,
        "history": results[0]["history"],
    }
    Console().print(
        f"[bold]{plan.describe()}[/]  test accuracy [bold]{metrics['test_accuracy']:.4f}[/]"
    )
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics, indent=2))
    if args.timeline:
        Console().print(f"wrote {args.timeline / 'timeline.json'} and timeline.png beside it")


def compare(args: argparse.Namespace) -> None:
    config = CompareConfig(
        model=args.model,
        devices=args.devices,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        memory_budget=args.memory_budget,
        include_ps=args.include_ps,
    )
    if config.devices < 1:
        raise PlanError(f"--devices={config.devices} must be at least 1")
    rows = run_comparison(config, record=True)
    console = Console()
    if not console.is_terminal:  # piped or logged: room for every column
        console = Console(width=120)
    console.print(compare_report.table(config, rows))
    for path in compare_report.write(config, rows, args.out):
        console.print(f"wrote {path}")


def memory(args: argparse.Namespace) -> None:
    plan = _plan_from(args)
    batch = _first_batch(args.model, plan, args.batch_size)
    build = functools.partial(build_model, args.model)
    estimate, measured = memory_view.measure(build, plan, batch, _adam, loss_for(args.model))
    console = Console() if Console().is_terminal else Console(width=160)
    console.print(memory_view.table(estimate, measured))
    for path in memory_view.write(estimate, measured, args.out):
        console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        if args.command == "train":
            train(args)
        elif args.command == "compare":
            compare(args)
        elif args.command == "memory":
            memory(args)
        elif args.command == "plan":
            plan(args)
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
