"""What the dp gradient sync adds to a step: the dense gradients reduced over dp and, under
Plan.ep, the experts' over the dp / ep ranks holding the same experts. Numbers in, numbers out.

Rationale: docs/internals.md#plannercostpy
"""

from __future__ import annotations

import math

from meshsplit.plan import Plan
from meshsplit.planner.machine import Machine
from meshsplit.precision import REDUCE_DTYPES

__all__: list[str] = []


def reduce_share(plan: Plan) -> float:
    """Bytes the dp gradient reduce moves per byte of (fp32) gradient: Plan.reduce_dtype's."""
    dtype = REDUCE_DTYPES[plan.reduce_dtype]
    return 1.0 if dtype is None else dtype.itemsize / 4


def dp_exposed_s(
    machine: Machine, plan: Plan, nbytes: float, overlap_s: float, expert_bytes: float = 0.0
) -> float:
    """What the all-reduce of `nbytes` of gradients over dp (and of `expert_bytes` of expert
    gradients over dp / ep) adds after backward.

    Buckets of plan.bucket_mb start as the last backward fills them, so all but what the
    backward of `overlap_s` hides is exposed, and at least the last bucket always is.
    """
    bucket = plan.bucket_mb * 2**20
    total = last = 0.0
    for group, size in ((plan.dp, nbytes), (plan.dp // plan.ep, expert_bytes)):
        if group <= 1 or size <= 0:
            continue
        link = machine.link("all_reduce", group)
        total += math.ceil(size / bucket) * link.alpha_s + size / link.bytes_per_s
        last = max(last, link.alpha_s + min(size, bucket) / link.bytes_per_s)
    return max(total - overlap_s, last) if total else 0.0


def dp_s(
    machine: Machine,
    plan: Plan,
    *,
    reduced: float,
    expert_reduced: float,
    trainable: float,
    parameters: float,
    overlap_s: float,
) -> float:
    """Seconds a stage's dp traffic adds under `plan.zero`, given its dense and expert
    gradients as reduced, its trainable and all parameter bytes, and the backward that
    hides the reduce (docs/internals.md#plannercostpy)."""
    if plan.dp <= 1:
        return 0.0
    if plan.zero <= 1:
        exposed = dp_exposed_s(machine, plan, reduced, overlap_s, expert_reduced)
        if plan.zero:
            exposed += machine.seconds("all_gather", plan.dp, trainable / plan.dp)
        return exposed
    m = plan.micro_batches
    gathers = m * (2 if plan.zero == 3 else 1)
    gather_s = machine.seconds("all_gather", plan.dp, parameters / plan.dp)
    scatter_s = machine.seconds("reduce_scatter", plan.dp, reduced)
    hidden = overlap_s * (m - 1) / m  # the last micro-batch's scatter is exposed
    return gathers * gather_s + max(m * scatter_s - hidden, scatter_s)


def dp_bytes(
    plan: Plan, *, reduced: float, expert_reduced: float, trainable: float, parameters: float
) -> float:
    """Bytes one rank sends over dp in a step: an all-reduce moves 2(n-1)/n of the
    gradients over its n ranks (in Plan.reduce_dtype; the experts' over n = dp / ep), zero 1
    then all-gathers the updated parameters; zero 2-3 one reduce-scatter (dp-1)/dp per
    micro-batch and as many all-gathers of the parameters as it gathers (parameters travel
    in their own dtype: fp32 master weights)."""
    if plan.dp <= 1:
        return 0.0
    share = (plan.dp - 1) / plan.dp
    if plan.zero <= 1:
        holders = plan.dp // plan.ep
        experts = 2 * expert_reduced * (holders - 1) / holders
        return (2 * reduced + (trainable if plan.zero else 0)) * share + experts
    gathers = plan.micro_batches * (2 if plan.zero == 3 else 1)
    return plan.micro_batches * reduced * share + gathers * parameters * share
