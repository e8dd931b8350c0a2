"""A plan's step time and memory from a measured workload and a machine. Numbers in, numbers out.

Pure arithmetic on measured items, so every plan is priced without running it. Per micro-batch,
stage s costs F_s = Σ forward(r) + tp_f(r) and B_s = Σ backward(r) + tp_b(r) [+ F_s if
recomputed]; the schedule's own actions, run chunk by chunk (`schedule_cost.py`: v chunks per
rank when interleaved, backward split into B and W under zero bubble), give the pipeline's
makespan, which dp traffic (or the parameter servers' push and pull, `ps_cost.py`), the
optimizer and cores shared by the workers then lengthen. `terms` splits the step
into what the busiest rank spends. Precision is priced where it acts: compute, saved
activations and tp traffic are the workload's, measured under the plan's autocast; stage
messages travel in their own dtypes (2 bytes per floating value under compress_transfers) and
the dp gradient reduce in Plan.reduce_dtype (`dp_cost.py`). Under Plan.ep a rank holds 1/ep
of the experts and its experts layers dispatch by all-to-all (`expert_cost.py`).
Rationale: docs/internals.md#plannercostpy
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshsplit.memory.recompute import recomputes
from meshsplit.pipeline.p2p import wire_dtype
from meshsplit.pipeline.schedules import Schedule
from meshsplit.plan import Plan
from meshsplit.planner.dp_cost import dp_bytes, dp_s, reduce_share
from meshsplit.planner.expert_cost import dispatch_bytes, dispatch_s, held_expert_bytes
from meshsplit.planner.machine import Machine
from meshsplit.planner.ps_cost import exchange_s, server_bytes, server_optimizer_s
from meshsplit.planner.schedule_cost import (
    WEIGHT_SHARE,
    Interval,
    chunk_placement,
    chunks_held,
    ends,
    peak_held,
    plan_actions,
    replay,
    splits_backward,
    stage_sizes,
)
from meshsplit.planner.schedule_cost import simulate_pipeline as simulate_pipeline
from meshsplit.planner.shared_cores import (
    batch_norm_s,
    stage_message_s,
    stretch_of,
    time_shared,
    traffic_s,
)
from meshsplit.planner.step_extras import (
    accumulate_s_per_byte,
    loss_s,
    optimizer_s_per_byte,
    overhead_s,
)
from meshsplit.planner.workload import Item, Workload

__all__: list[str] = []

TERMS = (
    "compute",
    "recompute",
    "communication_tp",
    "communication_pp",
    "communication_dp",
    "communication_ep",
    "bubble",
    "optimizer",
    "sharing",
    "overhead",
)
"""The parts of a predicted step, in the order they are shown; they sum to the step time."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model says of one plan."""

    plan: Plan
    step_time_s: float
    terms: dict[str, float]
    stages: tuple[int, ...]
    """Items per stage (per chunk when interleaved: chunk c runs on pipeline rank c % pp)."""
    memory_bytes: tuple[int, ...]
    """Modelled peak live bytes per stage (every dp and tp rank of a stage alike)."""
    server_bytes: int = 0
    """Modelled bytes each parameter server holds (sync='ps'; 0 without servers)."""
    bytes_per_step: dict[str, float]
    """Payload one rank of the slowest stage sends per step, per axis (tp, pp, dp, ep; dp is
    a worker's gradient push under sync='ps')."""
    critical_stage: int
    intervals: tuple[Interval, ...] = field(default=(), repr=False)


def rows_per_micro_batch(plan: Plan, global_rows: int) -> float:
    return global_rows / (plan.dp * plan.micro_batches)


def _compute_s(machine: Machine, item: Item, rows: float, backward: bool) -> float:
    if machine.flop_per_s is not None:  # small kernels wait for the host to launch them
        flops = item.backward_flops_per_row if backward else item.forward_flops_per_row
        ops = item.backward_ops if backward else item.forward_ops
        return max(flops * rows / machine.flop_per_s, ops * machine.launch_s)
    return (item.backward if backward else item.forward).at(rows)


@dataclass
class _Stage:
    forward_s: float = 0.0
    backward_s: float = 0.0
    tp_forward_s: float = 0.0
    tp_backward_s: float = 0.0
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0
    dp_forward_s: float = 0.0
    dp_backward_s: float = 0.0
    """BatchNorm's blocking collectives over dp inside the forward and the backward."""
    recompute_s: float = 0.0
    rerun_s: float = 0.0
    """W's own rerun of a recomputed forward (split backward, a chunk that B sends back)."""
    accumulate_s: float = 0.0
    """Adding this micro-batch's weight gradients to the earlier ones' (none for the first:
    a step of m pays m - 1, spread over its m backwards)."""
    send_s: float = 0.0
    """One boundary message to the next stage (activation forward, same bytes back)."""
    reduced_bytes: float = 0.0
    """The dense trainable gradients as the dp reduce sends them (in Plan.reduce_dtype)."""
    expert_reduced_bytes: float = 0.0
    """This rank's expert gradients as the reduce over dp / ep sends them."""
    parameter_bytes: int = 0
    """What this rank holds: the dense parameters and 1/ep of the experts."""
    trainable_bytes: int = 0
    expert_trainable_bytes: int = 0
    """Of trainable_bytes, this rank's share of the experts (their gradients sum over dp / ep)."""
    saved_bytes: float = 0.0
    exit_bytes: float = 0.0
    """What zero bubble's B keeps for W beyond the saved tensors (the gradients at exits)."""
    input_bytes: float = 0.0
    """The activation from the previous stage, as it arrives (in the wire dtype)."""
    largest_output: float = 0.0
    largest_unit_bytes: int = 0
    """The parameters of the stage's largest item: what zero 3 holds gathered at a time."""
    tp_bytes: float = 0.0
    ep_bytes: float = 0.0
    send_bytes: float = 0.0
    """The activation to the next stage, as it travels (in the wire dtype)."""

    @property
    def f(self) -> float:
        return self.forward_s + self.tp_forward_s + self.ep_forward_s + self.dp_forward_s

    @property
    def b(self) -> float:
        backward = self.backward_s + self.tp_backward_s + self.ep_backward_s + self.dp_backward_s
        return backward + self.recompute_s + self.rerun_s + self.accumulate_s

    def weight_s(self, split: bool) -> float:
        """W of one micro-batch: the weight-gradient share of the backward's compute, and
        their accumulation, when the schedule runs it apart (then B is the rest), else
        nothing."""
        return WEIGHT_SHARE * self.backward_s + self.accumulate_s + self.rerun_s if split else 0.0

    def gradients(self) -> dict[str, float]:
        """What the dp gradient sync moves of this stage, as `dp_cost.py` takes it."""
        return {
            "reduced": self.reduced_bytes,
            "expert_reduced": self.expert_reduced_bytes,
            "trainable": self.trainable_bytes,
            "parameters": self.parameter_bytes,
        }


def _merged(chunks: list[_Stage]) -> _Stage:
    """One rank's chunks as one stage: times, bytes and messages added, the largest kept."""
    rank = _Stage()
    for chunk in chunks:
        for name, value in vars(chunk).items():
            old = getattr(rank, name)
            setattr(rank, name, max(old, value) if name.startswith("largest") else old + value)
    return rank


def _stages(
    workload: Workload, machine: Machine, plan: Plan, rows: float, sizes: tuple[int, ...]
) -> list[_Stage]:
    """Each chunk's (each stage's, one chunk per rank) costs per micro-batch and bytes."""
    items = workload.items[plan.tp]
    stretch = stretch_of(machine, plan)
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    last = len(sizes) - 1
    placement, split = chunk_placement(plan), splits_backward(plan_actions(plan))
    stages = []
    for s in range(len(sizes)):
        run, stage = items[starts[s] : starts[s + 1]], _Stage()
        for item in run:
            stage.forward_s += _compute_s(machine, item, rows, backward=False)
            stage.backward_s += _compute_s(machine, item, rows, backward=True)
            stage.tp_forward_s += traffic_s(machine, item.forward_traffic, rows, plan.tp, stretch)
            stage.tp_backward_s += traffic_s(machine, item.backward_traffic, rows, plan.tp, stretch)
            stage.tp_bytes += rows * sum(
                t.bytes_per_row for t in (*item.forward_traffic, *item.backward_traffic)
            )
            stage.ep_forward_s += dispatch_s(machine, item, rows, plan, stretch, backward=False)
            stage.ep_backward_s += dispatch_s(machine, item, rows, plan, stretch, backward=True)
            stage.ep_bytes += dispatch_bytes(item, rows, plan)
            norms = item.batch_norm_channels
            stage.dp_forward_s += batch_norm_s(machine, norms, plan.dp, stretch, backward=False)
            stage.dp_backward_s += batch_norm_s(machine, norms, plan.dp, stretch, backward=True)
            experts = held_expert_bytes(item, plan)
            held = item.parameter_bytes - item.expert_bytes + experts
            stage.parameter_bytes += held
            stage.trainable_bytes += held if item.trainable else 0
            stage.expert_trainable_bytes += experts if item.trainable else 0
            stage.largest_unit_bytes = max(stage.largest_unit_bytes, held)
            stage.saved_bytes += item.saved_bytes_per_row * rows
            stage.exit_bytes += item.exit_bytes_per_row * rows
            stage.largest_output = max(stage.largest_output, item.output_bytes_per_row * rows)
        if s == last:
            stage.forward_s += loss_s(workload, machine, run[-1], rows, backward=False)
            stage.backward_s += loss_s(workload, machine, run[-1], rows, backward=True)
        if recomputes(plan.recompute, placement[s], plan.pp):
            stage.recompute_s = stage.f  # BatchNorm gathers its statistics again
            stage.rerun_s = stage.f if s > 0 and split else 0.0
        if s > 0:
            stage.input_bytes = _message_bytes(items[starts[s] - 1], plan) * rows
        if s < last:
            stage.send_bytes = _message_bytes(run[-1], plan) * rows
            # the turn of a 'zbv' V hands a chunk's output to the same rank
            local = placement[s] == placement[s + 1]
            stage.send_s = 0.0 if local else stage_message_s(machine, plan, stage.send_bytes)
        later = (plan.micro_batches - 1) / plan.micro_batches
        stage.accumulate_s = (
            later * stage.trainable_bytes * accumulate_s_per_byte(workload, machine)
        )
        dense = stage.trainable_bytes - stage.expert_trainable_bytes
        stage.reduced_bytes = dense * reduce_share(plan)
        stage.expert_reduced_bytes = stage.expert_trainable_bytes * reduce_share(plan)
        stages.append(stage)
    return stages


def _message_bytes(item: Item, plan: Plan) -> float:
    """Bytes per row of the message a stage boundary after `item` sends: its outputs, with
    floating tensors at 2 bytes under Plan.compress_transfers="bf16" (see p2p.wire_dtype)."""
    if wire_dtype(plan) is None:
        return item.output_bytes_per_row
    if item.compact_output_bytes_per_row is None:
        return item.output_bytes_per_row / 2
    return item.compact_output_bytes_per_row


def predict(workload: Workload, machine: Machine, plan: Plan) -> Prediction:
    """Step time, its terms and per-stage memory of `plan` (tp must be a measured width,
    and the workload measured under the plan's precision)."""
    if plan.precision != workload.precision:
        raise ValueError(
            f"{plan.describe()} is {plan.precision} and the workload was measured under "
            f"{workload.precision}; measure it under the plan's precision"
        )
    machine = machine.unshared()
    rows = rows_per_micro_batch(plan, workload.global_rows)
    sizes = stage_sizes(workload.items[plan.tp], plan, rows, workload.segments(plan.tp))
    chunks = _stages(workload, machine, plan, rows, sizes)
    stages = [_merged([chunks[c] for c in chunks_held(plan, r)]) for r in range(plan.pp)]
    m = plan.micro_batches
    actions = plan_actions(plan)
    split = splits_backward(actions)
    times = (
        [c.f for c in chunks],
        [c.b - c.weight_s(split) for c in chunks],
        [c.send_s for c in chunks],
        [c.weight_s(split) for c in chunks],
    )
    intervals = replay(plan, *times)
    quiet = replay(plan, times[0], times[1], [0.0] * len(chunks), times[3])
    finish, finish_quiet = ends(intervals, plan.pp), ends(quiet, plan.pp)
    # a collective on a host whose cores are all computing waits for one: no overlap there
    overlap = 0.0 if machine.cores is not None and plan.mesh_size >= machine.cores else 1.0
    ps = plan.sync == "ps"
    totals = []
    for s, st in enumerate(stages):
        dp_exposed, optimizer = _sync_s(workload, machine, plan, st, overlap * st.b)
        totals.append((finish[s] + dp_exposed + optimizer, dp_exposed, optimizer))
    stretch = stretch_of(machine, plan)
    overhead = overhead_s(workload, machine, plan, stretch)
    path = max(total for total, _, _ in totals) + overhead
    step = path * stretch  # every core busy: waits and work all stretch
    if stretch > 1.0 and plan.pp > 1:  # ...but a pipeline's idle ranks lend their cores
        intervals = time_shared(machine, plan, times, stretch)
        shared = ends(intervals, plan.pp)
        ends_s = [end + (dp_s + step_s) * stretch for end, (_, dp_s, step_s) in zip(
            shared, totals, strict=True)]  # fmt: skip
        step = max(ends_s) + overhead * stretch
    # every worker's work, and the servers' optimizer steps (a worker steps none under ps)
    work = sum(
        m * (st.f + st.b) + t[1] + t[2] * (not ps) for st, t in zip(stages, totals, strict=True)
    )
    busy = work * plan.dp * plan.tp + plan.server_count * totals[0][2]
    if machine.cores is not None:
        slowdown = machine.slowdown(plan.mesh_size)
        step = max(step, busy * slowdown / plan.mesh_size + overhead)
    critical = max(range(plan.pp), key=lambda s: stages[s].f + stages[s].b)
    st = stages[critical]
    _, dp_exposed, optimizer = totals[critical]
    pp_wait = max(0.0, finish[critical] - finish_quiet[critical])
    own = m * (st.f + st.b) + pp_wait + dp_exposed + optimizer
    terms = {
        "compute": m * (st.forward_s + st.backward_s + st.accumulate_s),
        "recompute": m * (st.recompute_s + st.rerun_s),
        "communication_tp": m * (st.tp_forward_s + st.tp_backward_s),
        "communication_pp": pp_wait,
        "communication_dp": dp_exposed + m * (st.dp_forward_s + st.dp_backward_s),
        "communication_ep": m * (st.ep_forward_s + st.ep_backward_s),
        "bubble": max(0.0, path - overhead - own),
        "optimizer": optimizer,
        "sharing": step - path,
        "overhead": overhead,
    }
    return Prediction(
        plan=plan,
        step_time_s=step,
        terms=terms,
        stages=sizes,
        memory_bytes=tuple(
            _memory(workload, plan, chunks, stages, actions, r) for r in range(plan.pp)
        ),
        server_bytes=(
            server_bytes(plan, st.trainable_bytes, workload.optimizer_state_per_byte) if ps else 0
        ),
        bytes_per_step={
            "tp": m * st.tp_bytes,
            "pp": 2 * m * (st.send_bytes + st.input_bytes),
            "dp": st.reduced_bytes if ps else dp_bytes(plan, **st.gradients()),
            "ep": m * st.ep_bytes,
        },
        critical_stage=critical,
        intervals=tuple(intervals),
    )


def _sync_s(
    workload: Workload, machine: Machine, plan: Plan, st: _Stage, overlap_s: float
) -> tuple[float, float]:
    """(exposed sync, optimizer) seconds of a stage's replicas after backward: the dp reduce
    and its own optimizer step (1/dp of it under zero), or under sync='ps' the push and pull
    to the servers and the servers' optimizer step (`ps_cost.py`)."""
    if plan.sync == "ps":
        loaded = machine.message_s.get(plan.world_size, 0.0) / stretch_of(machine, plan)
        pushed, trainable = st.reduced_bytes, float(st.trainable_bytes)
        return (
            exchange_s(machine, plan, pushed=pushed, trainable=trainable, message_s=loaded),
            server_optimizer_s(plan, trainable, optimizer_s_per_byte(workload, machine)),
        )
    shard = plan.dp if plan.zero else 1
    exposed = dp_s(machine, plan, overlap_s=overlap_s, **st.gradients())
    return exposed, optimizer_s_per_byte(workload, machine) * st.trainable_bytes / shard


def _memory(
    workload: Workload,
    plan: Plan,
    chunks: list[_Stage],
    stages: list[_Stage],
    actions: Schedule,
    r: int,
) -> int:
    """Parameters, gradients, optimizer state (none on a worker under sync='ps': the servers
    hold it), activations in flight, receive buffers and the largest temporary of pipeline
    rank `r`, whose in-flight micro-batches the schedule counts chunk by chunk (the estimate
    of `simulate.py` measures it exactly)."""
    st = stages[r]
    shard = plan.dp if plan.zero else 1
    recomputed = recomputes(plan.recompute, r, plan.pp)
    held = [
        (c.input_bytes + c.largest_output if recomputed else c.saved_bytes)
        + 2 * (c.input_bytes + c.send_bytes)
        for c in chunks
    ]
    # a first chunk receives nothing: its B has no input gradient to give and keeps nothing
    kept = [0.0 if i == 0 else c.exit_bytes for i, c in enumerate(chunks)]
    activations = peak_held(actions[r], r, held, kept)
    if recomputed:  # one chunk's forward is redone at a time, its activations whole
        activations += max(chunks[c].saved_bytes for c in chunks_held(plan, r))
    optimizer = 0.0 if plan.sync == "ps" else workload.optimizer_state_per_byte / shard
    state = _state_bytes(plan, st) + optimizer * st.trainable_bytes
    return int(state + activations + 2 * st.largest_output)


def _state_bytes(plan: Plan, st: _Stage) -> float:
    """Parameters and gradients at the step's peak: whole under zero 0-1; zero 2 keeps its
    1/dp shards beside the gathered parameters and 1/dp of the gradients (one item's whole
    while it is reduced); zero 3 holds only shards and one item gathered (two: the next is
    prefetched) beside one item's whole gradients."""
    whole, trainable = float(st.parameter_bytes), float(st.trainable_bytes)
    if plan.zero <= 1 or plan.dp <= 1:
        return whole + trainable
    shards = (whole + trainable) / plan.dp
    if plan.zero == 2:
        return whole + shards + st.largest_unit_bytes
    return shards + 3 * st.largest_unit_bytes
