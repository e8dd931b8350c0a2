"""What runs around a step's items: the loss, gradient accumulation, the optimizer step and
the engine's bookkeeping.

On this host each is timed (`measure.py`); on paper (a cluster this machine is not) the loss
and the optimizer are memory-bound work priced as the bytes they stream at the device's
memory bandwidth, and the host's bookkeeping is left out. Numbers in, numbers out.
"""

from __future__ import annotations

from meshsplit.data_parallel.sync import rides_gradient_buckets
from meshsplit.job.nonfinite import RIDERS
from meshsplit.plan import Plan
from meshsplit.planner.machine import Machine
from meshsplit.planner.workload import Item, Workload

__all__: list[str] = []


LOSS_PASSES = {False: 3, True: 2}
"""Paper mode, backward? -> times the loss streams the logits' bytes: forward reads them,
writes and reads their log-probabilities; backward reads those and writes the gradient."""


def loss_s(
    workload: Workload, machine: Machine, logits: Item, rows: float, backward: bool
) -> float:
    """The loss on the last stage's output: timed on this host, or on paper the bytes it
    streams at the device's memory bandwidth (a CPU's time says nothing about a GPU's)."""
    if machine.memory_bytes_per_s is None:
        return (workload.loss_backward if backward else workload.loss_forward).at(rows)
    streamed = LOSS_PASSES[backward] * logits.output_bytes_per_row * rows
    return streamed / machine.memory_bytes_per_s


def optimizer_s_per_byte(workload: Workload, machine: Machine) -> float:
    """Optimizer seconds per parameter byte: timed on this host, or on paper what one step
    streams (each parameter read and written, its gradient read, its state read and
    written) at the device's memory bandwidth."""
    if machine.memory_bytes_per_s is None:
        return workload.optimizer_s_per_byte
    return (3 + 2 * workload.optimizer_state_per_byte) / machine.memory_bytes_per_s


ACCUMULATE_PASSES = 3
"""Paper mode: bytes an accumulation streams per gradient byte (two read, one written)."""


def accumulate_s_per_byte(workload: Workload, machine: Machine) -> float:
    """Seconds per gradient byte to add one micro-batch's gradients to the sum so far:
    timed on this host, or on paper at the device's memory bandwidth."""
    if machine.memory_bytes_per_s is None:
        return workload.accumulate_s_per_byte
    return ACCUMULATE_PASSES / machine.memory_bytes_per_s


def overhead_s(workload: Workload, machine: Machine, plan: Plan, stretch: float) -> float:
    """What a step adds beyond its items, loss and optimizer: this host's engine bookkeeping
    and the small operations between items (none on paper, where that is this CPU's time:
    a bf16 autocast on a CPU made it 100x the MoE's priced step on a DGX H100, and a GPU
    runs those operations as kernels the host queues ahead), and the exchange that ends the
    step (in unstretched time)."""
    host = 0.0 if machine.flop_per_s is not None else workload.step_overhead_s
    return host + agreement_s(machine, plan, stretch)


AGREEMENT_BYTES = 8 * (RIDERS + 1)
"""The numbers the step's closing all-reduce sums (the loss, the flags, the batch check)."""


def agreement_s(machine: Machine, plan: Plan, stretch: float) -> float:
    """The exchange that ends every step (`runtime/agreement.py`): one small blocking
    all-reduce over the mesh, at the lockstep price of a busy host (4 workers on 2 cores:
    4-7 ms here), except where it rides the first gradient bucket's all-reduce (data
    parallel alone in float32; the model's trainable parameters taken as float32) and
    costs nothing of its own."""
    if plan.mesh_size <= 1 or rides_gradient_buckets(plan):
        return 0.0
    return machine.blocking_s("all_reduce", plan.mesh_size, 1, AGREEMENT_BYTES, stretch)
