"""What a host whose cores the workers share does to a priced step. Numbers in, numbers out.

A step whose workers fill the cores stretches by the measured slowdown of all of them at once
(`stretch_of`); a pipeline's ranks that wait lend their cores to the ones that compute, so a
pipeline is replayed on the shared cores (`time_shared`); a message or a blocking collective
costs at least what one measured with every worker busy (`stage_message_s`, `traffic_s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshsplit.plan import Plan
from meshsplit.planner.machine import Machine
from meshsplit.planner.schedule_cost import Interval, replay, shared_slowdowns
from meshsplit.planner.workload import Traffic

__all__: list[str] = []


def traffic_s(
    machine: Machine, traffic: Sequence[Traffic], rows: float, width: int, stretch: float
) -> float:
    """An item's blocking collectives over tp: alpha + bytes/beta each, and at least what
    one costs in lockstep on a host whose workers are all busy (in unstretched time)."""
    if width <= 1:
        return 0.0
    return sum(
        machine.blocking_s(t.operation, width, t.calls, t.bytes_per_row * rows, stretch)
        for t in traffic
    )


def batch_norm_s(
    machine: Machine, channels: Sequence[int], dp: int, stretch: float, *, backward: bool
) -> float:
    """An item's BatchNorms over dp, per micro-batch: each forward all-gathers (count, mean,
    M2) per channel and each backward all-reduces two sums per channel, blocking; each at
    least what a collective costs in lockstep on a busy host (in unstretched time)."""
    if dp <= 1 or not channels:
        return 0.0
    operation, per_channel = ("all_reduce", 2) if backward else ("all_gather", 3)
    floats = per_channel * sum(channels)
    return machine.blocking_s(operation, dp, len(channels), 4 * floats, stretch)


def stage_message_s(machine: Machine, plan: Plan, nbytes: float) -> float:
    """One activation (or its gradient) to the next stage: the link's price, or at least
    what a message to a waiting rank measured with this many workers (in unstretched time:
    the step is stretched by the cores' sharing afterwards)."""
    link = machine.seconds("send_recv", 2, nbytes)
    if plan.world_size not in machine.message_s:
        return link
    loaded = machine.message_s[plan.world_size] / stretch_of(machine, plan)
    return max(link, loaded + nbytes / machine.link("send_recv", 2).bytes_per_s)


def stretch_of(machine: Machine, plan: Plan) -> float:
    """How much the whole step stretches when the plan's workers fill the host's cores (not
    its parameter servers: they wait in a receive while the workers compute)."""
    if machine.cores is not None and plan.mesh_size >= machine.cores:
        return machine.slowdown(plan.mesh_size)
    return 1.0


def time_shared(
    machine: Machine, plan: Plan, times: tuple[list[float], ...], stretch: float
) -> tuple[Interval, ...]:
    """The pipeline replayed on the host's shared cores, in seconds of the clock (see
    `shared_slowdowns`); a message costs what it does with every core busy."""
    slowdown = shared_slowdowns(stretch, plan.mesh_size, machine.cores or 1, plan.dp * plan.tp)
    forward_s, backward_s, send_s, weight_s = times
    sends = [seconds * stretch for seconds in send_s]
    return replay(plan, forward_s, backward_s, sends, weight_s, slowdown)
