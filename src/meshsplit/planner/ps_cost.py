"""What parameter servers add to a step (Plan.sync='ps', staleness 0). Numbers in, numbers out.

S server processes, beside the dp workers (a plan for N devices has dp = N - S), each own
1/S of the trainable parameters. At the optimizer step every worker pushes each server its
share of the gradients (in Plan.reduce_dtype) and waits; a server takes the dp pushes one
after another, steps the optimizer on its share, and answers the workers one after another
with its parameters (fp32). With P the trainable bytes, G the gradient bytes as pushed and
a message costing alpha + bytes/beta on the send/recv link:

    exchange  = max(dp * (4 alpha + (G + P) / (S beta)),   the busiest server's link
                    S * 4 alpha + (G + P) / beta)           one worker's own sends and receives
    optimizer = optimizer_s_per_byte * P / S                 the servers in parallel

Nothing overlaps backward (the push starts at the optimizer step).
Rationale: docs/planner.md#schedules-and-parameter-servers
"""

from __future__ import annotations

from meshsplit.plan import Plan
from meshsplit.planner.machine import Machine

__all__: list[str] = []

MESSAGES = 4
"""Messages per worker and server in a step: a header and the gradient out, the version and
the parameters back (`data_parallel/ps.py`)."""


def exchange_s(
    machine: Machine, plan: Plan, *, pushed: float, trainable: float, message_s: float
) -> float:
    """Seconds from the end of backward until every worker holds the new parameters, less
    the servers' optimizer: `pushed` gradient bytes out and `trainable` parameter bytes back
    per worker, a message costing at least `message_s` to start."""
    link = machine.link("send_recv", 2)
    alpha = max(link.alpha_s, message_s)
    servers = plan.server_count
    busiest = plan.dp * (MESSAGES * alpha + (pushed + trainable) / servers / link.bytes_per_s)
    worker = servers * MESSAGES * alpha + (pushed + trainable) / link.bytes_per_s
    return max(busiest, worker)


def server_optimizer_s(plan: Plan, trainable: float, optimizer_s_per_byte: float) -> float:
    """One server's optimizer step on its 1/S of the parameters (all S step at once)."""
    return optimizer_s_per_byte * trainable / plan.server_count


def server_bytes(plan: Plan, trainable: float, optimizer_state_per_byte: float) -> int:
    """What one server holds: its parameters, their gradient, an update's sum and one
    incoming push (each its 1/S share of the trainable bytes), and their optimizer state."""
    share = trainable / plan.server_count
    return int((4 + optimizer_state_per_byte) * share)
