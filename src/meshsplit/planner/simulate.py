"""`estimate_memory`: every rank's memory under a plan, in one process, before any launch.

Each distinct rank runs two real train_steps of its own part of the model, joined to a fake
process group whose collectives return at once, while the live-tensor tracker counts; the
steady second step is the estimate. It runs exactly a worker's code, so what is measured is
what a worker will hold. Rationale: docs/internals.md#plannersimulatepy
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.batch import LossFn, rows
from meshsplit.memory.estimate import MemoryEstimate, RankEstimate, find_fix
from meshsplit.memory.lazy_model import ModelSource
from meshsplit.pipeline.p2p import TensorMeta
from meshsplit.pipeline.runner import PipelineRunner
from meshsplit.plan import Plan, PlanError
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.parallelize import OptimizerFactory, parallelize
from meshsplit.runtime.rank_memory import counting_only

__all__ = ["estimate_memory"]

Headers = dict[int, dict[tuple[int, int, Any], list[TensorMeta]]]
"""receiving rank -> {(sending rank, tag, key): what that rank sends under that tag and key}."""


def estimate_memory(
    model: ModelSource,
    plan: Plan,
    batch: tuple[Any, Any],
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    timeline: bool = False,
) -> MemoryEstimate:
    """Predict each rank's peak live tensor bytes for one train_step of `plan` on `batch`
    (the global (inputs, targets)), in this process; `model` is left as it was. A factory
    (see `parallelize`) lets each simulated rank build only its part, so a model too big for
    this process can be estimated too.

    With Plan.memory_budget set and a rank over it, the estimate also names the cheapest
    nearby plan that fits (`fix`); `estimate.check()` raises the PlanError.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "estimate_memory simulates every rank in one process, before workers start: "
            "call it outside ms.launch (or before init_process_group)"
        )
    if plan.sync == "ps":
        raise PlanError(
            f"the memory estimate covers sync='allreduce' plans; {plan.describe()} keeps the "
            "whole model and its gradients on every worker, and its servers hold about 1/S of "
            "the parameters with their optimizer state each (they check Plan.memory_budget "
            "themselves when they start)"
        )
    inputs, targets = batch
    plan.check_batch(rows(inputs))
    estimate = _estimate(model, plan, inputs, targets, optimizer, loss_fn, timeline)
    if estimate.fits:
        return estimate
    fix = find_fix(
        plan,
        rows(inputs),
        lambda candidate: _estimate(model, candidate, inputs, targets, optimizer, loss_fn, False),
    )
    return replace(estimate, fix=fix)


def _estimate(
    model: ModelSource,
    plan: Plan,
    inputs: Any,
    targets: Any,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    timeline: bool,
) -> MemoryEstimate:
    """Every rank's estimate under `plan`, the distinct ones simulated (random stream kept)."""
    rng = torch.get_rng_state()
    measured: dict[tuple[int, int, int], RankEstimate] = {}
    try:
        for dp in _distinct_replicas(plan):
            for tp in range(plan.tp):
                plan, line = _pipeline(
                    model, plan, dp, tp, inputs, targets, optimizer, loss_fn, timeline
                )
                measured |= {(dp, pp, tp): estimate for pp, estimate in line.items()}
    finally:
        torch.set_rng_state(rng)
    ranks = [
        replace(
            measured.get((dp, pp, tp), measured[(0, pp, tp)]),
            rank=rank,
            coordinates={"dp": dp, "pp": pp, "tp": tp},
        )
        for rank, (dp, pp, tp) in enumerate(rank_coordinates(plan))
    ]
    return MemoryEstimate(plan=plan, ranks=ranks)


def _pipeline(
    model: ModelSource,
    plan: Plan,
    dp: int,
    tp: int,
    inputs: Any,
    targets: Any,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    timeline: bool,
) -> tuple[Plan, dict[int, RankEstimate]]:
    """The estimate of each pipeline rank of replica `dp` at operator-split index `tp`, and
    the plan with its stages pinned to the first rank's profile.

    Ranks run first to last, each hearing what earlier ones send. Under interleaving rank 0
    also hears from the last rank (chunk pp-1 feeds chunk pp), so a rank that stops at a
    header no rank has told yet runs again after the others: v rounds for v chunks per rank.
    """
    headers: Headers = {}
    done: dict[int, RankEstimate] = {}
    waiting = list(range(plan.pp))
    while waiting:
        told = sum(map(len, headers.values()))
        for pp in waiting:
            rank = (dp * plan.pp + pp) * plan.tp + tp
            engine, whole = _simulate(
                model, plan, rank, inputs, targets, optimizer, loss_fn, headers, timeline
            )
            if isinstance(engine.runner, PipelineRunner) and plan.stages is None:
                plan = replace(plan, stages=engine.runner.sizes, split_points=None)
            if whole:
                done[pp] = _rank_estimate(engine, rank, pp, tp)
        waiting = [pp for pp in waiting if pp not in done]
        if waiting and sum(map(len, headers.values())) == told:
            raise RuntimeError(
                f"simulating {plan.describe()}: pipeline ranks {waiting} wait for headers "
                "no rank sends (the schedule cannot run)"
            )
    return plan, done


def _distinct_replicas(plan: Plan) -> range:
    """The dp replicas whose memory can differ: under zero=1 each holds the optimizer state
    of the whole tensors ZeroRedundancyOptimizer dealt it; otherwise replica 0 stands for all
    (FSDP2 shards every tensor evenly)."""
    return range(plan.dp if plan.zero == 1 else 1)


def rank_coordinates(plan: Plan) -> Iterable[tuple[int, int, int]]:
    """(dp, pp, tp) of every global rank, in rank order (the mesh is dp-major)."""
    for dp in range(plan.dp):
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                yield dp, pp, tp


def _simulate(
    model: ModelSource,
    plan: Plan,
    rank: int,
    inputs: Any,
    targets: Any,
    optimizer: OptimizerFactory | None,
    loss_fn: LossFn | None,
    headers: Headers,
    timeline: bool,
    steps: int = 2,
) -> tuple[Engine, bool]:
    """Run global rank `rank` of `plan` for `steps` train_steps in a fake process group, and
    whether it ran them all: False when it stopped at a header no rank has told it yet (a
    chunk fed by a later rank, under interleaving), having told `headers` what it sends."""
    rng = torch.get_rng_state()
    try:
        with fake_group(rank, plan.world_size):
            # a factory builds each simulated rank's part afresh; a model is copied whole
            source = copy.deepcopy(model) if isinstance(model, nn.Module) else model
            # no peer sends: received values are zeros and mean nothing (nonfinite off)
            counted = replace(plan, nonfinite="off")
            with counting_only():
                engine = parallelize(source, counted, optimizer=optimizer, loss_fn=loss_fn)
            engine.prepare(inputs)
            runner = engine.runner
            if isinstance(runner, PipelineRunner):
                exchange = runner.stage.exchange
                exchange.unheard = _stop
                exchange.pool.zeroed = True  # a received index (position ids) stays valid
                for (sender, tag, key), metas in headers.get(rank, {}).items():
                    exchange.learn(sender, tag, key, metas)
            engine.memory.track = True
            whole = True
            try:
                for step in range(steps):
                    if timeline and step == steps - 1:
                        engine.memory.timeline = []
                    engine.train_step(inputs, targets)
            except _Unheard:
                whole = False
            if isinstance(runner, PipelineRunner):
                for (peer, tag, key), metas in runner.stage.exchange.told.items():
                    headers.setdefault(peer, {})[(rank, tag, key)] = metas
            engine.close()
            return engine, whole
    finally:
        torch.set_rng_state(rng)


class _Unheard(Exception):
    """A simulated rank is about to receive a header that no rank simulated so far told."""


def _stop(unheard: list[tuple[int, int, Hashable]]) -> None:
    """Stop a simulated rank at a header it cannot hear yet (its sender runs again later)."""
    raise _Unheard(unheard)


@contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """Be rank `rank` of `world` ranks whose collectives return at once (PyTorch's fake
    process group): one process runs a rank's real code without its peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rank<r>]: " and nothing unwraps
    # it: the caller's own tracebacks would carry one prefix per simulated rank
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _rank_estimate(engine: Engine, rank: int, pp: int, tp: int) -> RankEstimate:
    peak = engine.memory.peak
    assert peak is not None, "a tracked step always records its peak"
    return RankEstimate(
        rank=rank,
        coordinates={"dp": 0, "pp": pp, "tp": tp},
        peak_bytes=peak.bytes,
        breakdown=dict(peak.breakdown),
        phase=peak.phase,
        timeline=list(engine.memory.timeline or []),
    )
