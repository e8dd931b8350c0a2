"""What the expert split (Plan.ep) changes in a plan's price: each rank holds 1/ep of the
experts, and every experts layer sends its token rows to their experts and back.

Per experts layer and micro-batch of r rows, a rank hands its experts r x tokens x top-k
rows of the hidden size (the item's `dispatch_bytes_per_row`); forward exchanges the
per-expert counts (one small all-to-all), sends the rows and takes the answers back (two
all-to-alls of that payload); backward sends both gradients the reverse way (two more).
Each is priced like a tp collective: alpha + bytes / beta over ep ranks, and at least what
a blocking collective costs when every worker of this host is busy. Compute is unchanged:
routing that is balanced on average gives each rank the rows it had without ep.
"""

from __future__ import annotations

from meshsplit.plan import Plan, divisors
from meshsplit.planner.machine import Machine
from meshsplit.planner.workload import Item, Workload

__all__: list[str] = []

FORWARD_ALL_TO_ALLS = 3
"""Per experts layer: the counts, the rows out, the answers back."""
BACKWARD_ALL_TO_ALLS = 2
"""Per experts layer: the answers' gradients out, the rows' gradients back."""
PAYLOAD_ALL_TO_ALLS = 2
"""Of those, each pass's that carry the rows (the counts are a few bytes)."""


def ep_widths(workload: Workload, dp: int) -> list[int]:
    """The ep > 1 worth pricing for `dp` replicas: divisors of dp that divide every experts
    module's experts (none for a dense model)."""
    if not workload.experts:
        return []
    return [ep for ep in divisors(dp) if ep > 1 and all(n % ep == 0 for n in workload.experts)]


def held_expert_bytes(item: Item, plan: Plan) -> int:
    """The item's expert parameter bytes one rank holds: 1/ep of them."""
    return item.expert_bytes // plan.ep


def dispatch_s(
    machine: Machine, item: Item, rows: float, plan: Plan, stretch: float, backward: bool
) -> float:
    """Seconds of the item's all-to-alls over ep in one pass of a micro-batch of `rows`
    (in unstretched time, as tp traffic)."""
    if plan.ep <= 1 or not item.experts_calls:
        return 0.0
    calls = item.experts_calls * (BACKWARD_ALL_TO_ALLS if backward else FORWARD_ALL_TO_ALLS)
    payload = PAYLOAD_ALL_TO_ALLS * item.dispatch_bytes_per_row * rows
    return machine.blocking_s("all_to_all", plan.ep, calls, payload, stretch)


def dispatch_bytes(item: Item, rows: float, plan: Plan) -> float:
    """Bytes one rank sends to the other ep ranks per micro-batch of `rows`, both passes:
    (ep - 1) / ep of each payload all-to-all leaves the rank."""
    if plan.ep <= 1:
        return 0.0
    leaving = (plan.ep - 1) / plan.ep
    return 2 * PAYLOAD_ALL_TO_ALLS * item.dispatch_bytes_per_row * rows * leaving
