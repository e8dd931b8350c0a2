"""`meshsplit train`: a reference model trained under a plan, with nothing refused late.

What can be refused is refused in this process before any worker starts (a plan, a batch it
cannot split, a budget it will not fit, a tp the layers do not divide, options that do not
go together); then every worker builds, splits, trains and evaluates the model, rank 0 shows
how it split, and this process prints the accuracy and writes the metrics.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from meshsplit import models, tensor
from meshsplit.cli import plan_view, timeline
from meshsplit.cli.flags import plan_from
from meshsplit.job.launch import launch
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.choose import predict_plan
from meshsplit.planner.cost import Prediction
from meshsplit.planner.simulate import estimate_memory
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.parallelize import default_optimizer, parallelize

__all__ = ["run"]


def run(args: argparse.Namespace) -> None:
    """Train `args.model` under the plan the flags spell (or the planner's, --plan auto)."""
    plan, chosen = _plan(args)
    reference = models.reference(args.model)
    plan.check_batch(args.batch_size)
    batch = reference.example_batch(args.batch_size)
    _refuse_before_launch(args, plan, chosen, batch)
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
            reference.model(),
            batch,
            plan,
            optimizer=functools.partial(default_optimizer, lr=args.lr),
            loss_fn=reference.loss(),
        )
        options["predicted"] = timeline.predicted_events(prediction)
    results = launch(_train_worker, plan.world_size, args=(options,))
    metrics = _metrics(args.model, plan, results)
    Console().print(
        f"[bold]{plan.describe()}[/]  test accuracy [bold]{metrics['test_accuracy']:.4f}[/]"
    )
    if args.metrics_out:
        args.metrics_out.write_text(json.dumps(metrics, indent=2))
    if args.timeline:
        Console().print(f"wrote {args.timeline / 'timeline.json'} and timeline.png beside it")


def _plan(args: argparse.Namespace) -> tuple[Plan, Prediction | None]:
    """The plan from the flags, or the planner's choice and its prediction (--plan auto)."""
    if args.plan != "auto":
        return plan_from(args), None
    report = plan_view.choose(
        args.model,
        args.devices,
        args.batch_size,
        args.memory_budget,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
    )
    plan, chosen = report.best, report.rows[0].prediction
    Console().print(
        f"planner: {plan.describe()}, predicted {chosen.step_time_s * 1e3:.1f} ms "
        f"per step, the fastest of {len(report.rows)} plans for {args.devices} devices"
    )
    return plan, chosen


def _refuse_before_launch(
    args: argparse.Namespace,
    plan: Plan,
    chosen: Prediction | None,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """A PlanError now for what would fail in the workers."""
    reference = models.reference(args.model)
    # the planner's choice was estimated already; parameter servers hold themselves to the
    # budget when they start
    if plan.memory_budget is not None and chosen is None and plan.sync != "ps":
        estimate_memory(
            reference.model(),
            plan,
            batch,
            optimizer=functools.partial(default_optimizer, lr=args.lr),
            loss_fn=reference.loss(),
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
        tensor.plan_splits(reference.model(), plan.tp)  # a tp the layers do not divide


def _metrics(model: str, plan: Plan, results: list[dict[str, Any]]) -> dict[str, Any]:
    """What --metrics-out writes: rank 0's scores, every rank's (and server's) memory."""
    results, servers = results[: plan.mesh_size], results[plan.mesh_size :]  # servers' summaries
    history = results[0]["history"]
    last = history[-1] if history else {"loss": None, "samples_per_second": None}
    return {
        "model": model,
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


def _train_worker(options: dict[str, Any]) -> dict[str, Any]:
    """Runs in every worker: build, split, train, evaluate; returns this rank's results."""
    torch.manual_seed(options["seed"])
    reference = models.reference(options["model"])
    plan = Plan(**options["plan"])
    train_data = reference.data("train")
    micro_rows = options["batch_size"] // (plan.dp * plan.micro_batches)
    engine = parallelize(
        reference.model(),
        plan,
        optimizer=functools.partial(default_optimizer, lr=options["lr"]),
        loss_fn=reference.loss(),
        example_inputs=train_data[0][:micro_rows],
    )
    if engine.mesh.is_first_rank:
        _show_split(engine)
    checkpoint_dir = options["checkpoint_dir"]
    if options["resume"]:
        engine.load(checkpoint_dir)
    test = reference.data("test")
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


def _show_split(engine: Engine) -> None:
    """Rank 0 prints how the model split: operators over tp, stages over pp, BatchNorm."""
    description = engine.describe()
    if engine.plan.tp > 1:
        Console().print(operator_split_table(description["operator_split"]))
    if engine.plan.pp > 1:
        Console().print(stage_table(description))
    batchnorm = description["batchnorm"]
    if batchnorm:
        Console().print(f"{batchnorm['dp']}\n{batchnorm['pp']}")


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
        caption=f"idle share of the schedule (bubble) = {description['bubble_fraction']:.1%}\n"
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
