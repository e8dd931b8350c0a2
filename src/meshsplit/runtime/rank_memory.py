"""This rank's memory while it trains: the budget before the first step, the count in each.

Before the first step the rank's lasting state is known exactly (its split is built): it is
held to Plan.memory_budget there, on every rank at once so all refuse together, and under
recompute='auto' the blocks to recompute are chosen (memory/budget.py). In the steps the
live tensors are counted — the allocator's peak on GPU in every step, the dispatch-level
tracker (memory/tracker.py) on CPU in a sample (see RankMemory.track) — and the budget is
enforced: by the allocator on GPU, at the end of each phase of a counted step on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit import phases
from meshsplit.data_parallel import Sync
from meshsplit.memory import recompute
from meshsplit.memory.budget import RankBudget, fit_budget, optimizer_need
from meshsplit.memory.report import (
    MemoryReport,
    optimizer_bytes,
    optimizer_tensors,
    peak_bytes,
    tensor_bytes,
)
from meshsplit.memory.tracker import Holders, LiveTensors, MemoryBudgetError, Peak, Sample
from meshsplit.mesh import Mesh, local_tensor
from meshsplit.pipeline.runner import PipelineRunner
from meshsplit.pipeline.schedules import max_in_flight, schedule
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import AUTOCAST_DTYPES
from meshsplit.runtime.runner import Runner
from meshsplit.tensor.staged import staging

__all__: list[str] = []

_enforcing = [True]
FIRST_COUNTED = 3
"""Steps counted first, whatever the sample (step 1 makes any state the pools left lazy)."""
SAMPLE_EVERY = 100
STEADY = 2
"""Counted steps in a row, of one batch shape, that must peak alike before a budget is held
on the sampled steps only (until a sampled step of that shape peaks otherwise)."""


@contextmanager
def counting_only() -> Iterator[None]:
    """Engines made in the body count memory but never refuse or stop over the budget (the
    estimate measures a plan that may not fit)."""
    _enforcing.append(False)
    try:
        yield
    finally:
        _enforcing.pop()


class RankMemory:
    """The budget and the per-step count of one rank."""

    def __init__(self, plan: Plan, mesh: Mesh) -> None:
        self.plan, self.mesh = plan, mesh
        self.track: bool | None = None
        """Count a train_step's live tensor bytes on CPU (memory_report's tensor_peak_bytes):
        True every step, False never, None (the default) a sample: the first steps, every
        SAMPLE_EVERY-th, and each step with batch shapes not seen before. Steady steps
        allocate alike (memory/pools.py), and counting slows a small model's step by half
        (benchmarks/README.md). Under a memory budget every step is counted until STEADY
        counted steps of its batch shapes peak alike (a model whose allocations follow its
        data, as a dropless mixture of experts' do, may never), then on the sample, and on
        every step again once a sampled step peaks otherwise."""
        self._shapes_seen: set[Any] = set()
        self._peaks: dict[Any, list[int]] = {}
        """batch shapes -> the peaks of the last STEADY counted steps of those shapes."""
        self.enforce = _enforcing[-1]
        """Refuse (PlanError) or stop (MemoryBudgetError) a rank over Plan.memory_budget;
        off: only count."""
        self.peak: Peak | None = None
        """The last counted step's peak of live tensor bytes, its phase and breakdown."""
        self.timeline: list[Sample] | None = None
        """Set to a list to receive the next counted step's live bytes after every event."""
        self.budget: RankBudget | None = None
        """This rank against the budget: its lasting state and what 'auto' recomputes."""

    def fit(
        self,
        runner: Runner,
        sync: Sync,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        profile: recompute.BlockProfile | None,
    ) -> list[str]:
        """Hold this rank to the budget before its first step; every rank calls this.
        Returns the blocks that recompute='auto' chose to fit it (none without a budget)."""
        plan = self.plan
        if plan.budget_bytes is None:
            return []
        message = None
        try:
            self.budget = _fit(
                plan, self.mesh, runner, sync, make_optimizer, profile, refuse=self.enforce
            )
        except PlanError as error:
            message = str(error)
        messages: list[Any] = [None] * dist.get_world_size(self.mesh.world)
        dist.all_gather_object(messages, message, group=self.mesh.world)
        refusals = [m for m in messages if m is not None]
        if refusals:
            raise PlanError("; ".join(refusals))
        assert self.budget is not None
        if self.mesh.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.mesh.device).total_memory
            fraction = min(1.0, plan.budget_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fraction, self.mesh.device)
        return list(self.budget.recompute)

    def report(
        self, runner: Runner, sync: Sync, optimizer: torch.optim.Optimizer, baseline: int
    ) -> MemoryReport:
        """This rank's peak memory and the bytes its parameters, gradients and optimizer hold."""
        peak = self.peak
        return MemoryReport(
            rank=dist.get_rank(),
            peak_bytes=peak_bytes(self.mesh.device),
            tensor_peak_bytes=peak.bytes if peak is not None else None,
            tensor_peak_phase=peak.phase if peak is not None else None,
            tensor_breakdown=dict(peak.breakdown) if peak is not None else None,
            baseline_bytes=baseline,
            parameter_bytes=tensor_bytes(runner.parameters()),
            gradient_bytes=sync.gradient_bytes(),
            optimizer_bytes=optimizer_bytes(optimizer),
            device=str(self.mesh.device),
        )

    @property
    def held_budget(self) -> int | None:
        """Plan.memory_budget in bytes where this rank holds steps to it (None: only count)."""
        return self.plan.budget_bytes if self.enforce else None

    def counts(self, number: int, shapes: Any) -> bool:
        """Whether step `number`, on a batch of these `shapes`, is counted on CPU."""
        new = shapes not in self._shapes_seen
        self._shapes_seen.add(shapes)
        if self.track is not None:
            return self.track
        if new or number <= FIRST_COUNTED or number % SAMPLE_EVERY == 0:
            return True
        peaks = self._peaks.get(shapes, [])
        return self.held_budget is not None and (len(peaks) < STEADY or len(set(peaks)) > 1)

    @contextmanager
    def step(
        self, runner: Runner, sync: Sync, optimizer: Any, number: int, shapes: Any
    ) -> Iterator[None]:
        """Count step `number`'s live tensor bytes on a sample of the steps on CPU (see
        `track`), holding each counted step to the budget; on GPU every step is held."""
        where = f"rank {dist.get_rank()}, step {number}"
        device = self.mesh.device
        budget = self.held_budget
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            try:
                yield
            except torch.OutOfMemoryError as error:
                if budget is None:
                    raise
                raise MemoryBudgetError(
                    f"{where}: {phases.failed_in()} went past Plan.memory_budget="
                    f"{self.plan.memory_budget!r}: {error}"
                ) from error
            self.peak = Peak(bytes=int(torch.cuda.max_memory_allocated(device)))
            return
        counted = self.counts(number, shapes)
        if not (counted or self.timeline is not None):
            yield
            return
        tp_staging = staging(self.mesh.group("tp"))
        holders: Holders = {
            # the tensors themselves, not a state dict: FSDP2's state-dict hook reshards
            # every unit, which mid-step would gather them all again for backward
            "parameters": lambda: map(
                local_tensor, [*runner.parameters(), *runner.module.buffers()]
            ),
            "gradients": sync.gradient_tensors,
            "optimizer": lambda: optimizer_tensors(optimizer),
            "buffers": lambda: [*runner.communication_buffers(), *tp_staging.buffers],
        }
        tracker = LiveTensors(
            device, holders, budget=budget, where=where, timeline=self.timeline is not None
        )
        with tracker:
            yield
        self.peak = tracker.peak
        self._peaks[shapes] = [*self._peaks.get(shapes, []), tracker.peak.bytes][-STEADY:]
        if self.timeline is not None:
            self.timeline[:] = tracker.samples or []


def _fit(
    plan: Plan,
    mesh: Mesh,
    runner: Runner,
    sync: Sync,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    profile: recompute.BlockProfile | None,
    *,
    refuse: bool,
) -> RankBudget:
    local = set(runner.parameter_names().values())
    blocks = [] if profile is None else [b.name for b in profile.blocks]
    mine = [b for b in blocks if any(n.startswith(b + ".") for n in local)]
    in_flight = 1
    if isinstance(runner, PipelineRunner):
        in_flight = max_in_flight(
            schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)[
                mesh.rank("pp")
            ]
        )
    held = [local_tensor(p) for p in runner.parameters()]  # a sharded parameter: its shard
    low = AUTOCAST_DTYPES[plan.precision]
    copies = 0 if low is None else tensor_bytes(held) * low.itemsize // 4
    sharers = plan.dp // plan.ep if plan.zero == 1 else 1  # ZeRO 1 under ep: over dp/ep
    need = optimizer_need(make_optimizer, held, sharers)
    return fit_budget(
        where=f"rank {dist.get_rank()} ({plan.describe()})",
        budget_bytes=plan.budget_bytes or 0,
        static={
            "parameters": tensor_bytes(runner.local_state_dict().values()),
            "gradients": sync.gradient_bytes(),
            "optimizer": need.state_bytes,
        },
        optimizer_step_bytes=need.step_bytes,
        profile=profile,
        local_blocks=mine,
        in_flight=in_flight,
        auto=plan.recompute == "auto",
        weight_copy_bytes=copies,
        refuse=refuse,
    )
