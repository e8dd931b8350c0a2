"""Parameter servers: S processes own the parameters and run the optimizer; workers pull
parameters and push gradients (TensorFlow's ParameterServerStrategy, on torch.distributed).

Each server owns an equal range of the flattened parameters and runs the user's optimizer on
it; an update is the sum of `dp` pushes followed by one step. Staleness 0 is exactly one
process's step, every step; under staleness K a slow worker holds the others up only when it
falls K updates behind. Rationale: docs/internals.md#data_parallelpspy
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.data_parallel.allreduce import float32_sums
from meshsplit.data_parallel.ps_layout import pieces, server_ranges
from meshsplit.job.context import LeaveJob, job_store
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import REDUCE_DTYPES

__all__: list[str] = []

PUSH, FLUSH, DONE = 1, 2, 3
"""Header kinds: a gradient (and a request for the next parameters), a request for the
newest parameters once every worker asks (pending pushes applied first), a worker's end."""
HEADER, GRADIENT, VERSION, PARAMETERS = 11, 12, 13, 14
"""Message tags."""


def flat_views(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed flat buffer shaped like `tensors` together, and a view of it for each."""
    flat = torch.zeros(
        sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device
    )
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat, views


def trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.requires_grad]


def worker_ranks(plan: Plan) -> list[int]:
    return list(range(plan.mesh_size))


def server_ranks(plan: Plan) -> list[int]:
    return list(range(plan.mesh_size, plan.world_size))


def check_backend() -> None:
    if dist.get_backend() != "gloo":
        raise PlanError(
            f"sync='ps' runs on the gloo backend (a server receives from whichever worker "
            f"is first); this job uses {dist.get_backend()!r}; use sync='allreduce'"
        )


class ParameterClient:
    """A worker's side, and the engine's Sync under sync='ps': the parameters and their
    gradients each live in one flat buffer, so each server's range is pushed and received
    in place; `exchange` pushes the gradients and takes the servers' answer."""

    def __init__(self, params: Iterable[nn.Parameter], plan: Plan) -> None:
        check_backend()
        self.params = trainable(params)
        self.servers = server_ranks(plan)
        self.ranges = server_ranges(self.params, plan)
        self.values, value_views = flat_views(self.params)
        self.gradient, grad_views = flat_views(self.params)
        with torch.no_grad():
            for p, value, grad in zip(self.params, value_views, grad_views, strict=True):
                value.copy_(p)
                p.data = value  # the servers' answers land in the parameters themselves
                p.grad = grad
        self._grad_view = dict(zip(self.params, grad_views, strict=True))
        self.versions = [0] * len(self.servers)
        """The version of each server's parameters this worker holds."""
        self.updates_behind = 0
        """How many updates the servers made between this worker's last pull and push."""
        self.apart = plan.staleness > 0
        """Whether the workers run without waiting for each other (staleness > 0)."""
        self.wire = REDUCE_DTYPES[plan.reduce_dtype] or self.gradient.dtype
        """The dtype gradients are pushed in (Plan.reduce_dtype)."""
        self._closed = False

    def begin_step(self, backward_passes: int) -> None:
        """Nothing to prepare: gradients stay here until the optimizer step pushes them."""

    def finish(self) -> None:
        """Nothing to wait for: no gradient is exchanged among the workers."""

    def zero_grad(self) -> None:
        self.gradient.zero_()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [self.gradient]

    def gradient_sums(self) -> list[torch.Tensor]:
        return float32_sums(self.gradient_tensors())

    def gradient_bytes(self) -> int:
        return self.gradient.nbytes

    def exchange(self) -> None:
        """Push this step's gradients and take the parameters the servers answer with
        (staleness 0: after the update that includes them)."""
        for p, view in self._grad_view.items():
            if p.grad is not view:  # something replaced .grad: fold it back
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
        self._ask(PUSH)

    def flush(self) -> None:
        """Every worker calls: the servers apply what waits and all get the newest parameters."""
        self._ask(FLUSH)

    def newest_parameters(self) -> None:
        """Asynchronous workers may hold different versions: all take the newest (what
        waits applied), so outputs and state agree. Synchronous ones already do."""
        if self.apart:
            self.flush()

    def _ask(self, kind: int) -> None:
        versions = [torch.zeros(1, dtype=torch.int64) for _ in self.servers]
        answers: list[Any] = []
        for server, version, (low, high) in zip(self.servers, versions, self.ranges, strict=True):
            answers.append(dist.irecv(version, src=server, tag=VERSION))
            answers.append(dist.irecv(self.values[low:high], src=server, tag=PARAMETERS))
        for index, (server, (low, high)) in enumerate(zip(self.servers, self.ranges, strict=True)):
            header = torch.tensor([kind, self.versions[index]], dtype=torch.int64)
            dist.send(header, dst=server, tag=HEADER)
            if kind == PUSH:
                dist.send(self.gradient[low:high].to(self.wire), dst=server, tag=GRADIENT)
        for work in answers:
            work.wait()
        new = [int(v.item()) for v in versions]
        self.updates_behind = max(n - 1 - o for n, o in zip(new, self.versions, strict=True))
        self.versions = new

    def close(self) -> None:
        """Tell the servers this worker is done (once)."""
        if self._closed:
            return
        self._closed = True
        header = torch.tensor([DONE, 0], dtype=torch.int64)
        for server in self.servers:
            dist.send(header, dst=server, tag=HEADER)


class ServerOptimizer(torch.optim.Optimizer):
    """A worker's optimizer: its step is the exchange with the servers, where the user's
    optimizer runs."""

    def __init__(self, params: Iterable[nn.Parameter], client: ParameterClient) -> None:
        super().__init__(list(params), {})
        self.client = client

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        self.client.exchange()


def stateless_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """What a worker holds of the optimizer for the memory budget: no state (it is on the
    servers)."""
    return torch.optim.SGD(params, lr=0.0)


@dataclass
class _Update:
    """Pushes summed for one update, in arrival order."""

    gradient: torch.Tensor
    count: int = 0
    workers: list[int] = field(default_factory=list)


class ParameterServer:
    """A server's side: its tensors, the user's optimizer over them, and the update rule."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        plan: Plan,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        check_backend()
        everything = trainable(params)
        low, high = server_ranges(everything, plan)[dist.get_rank() - plan.dp]
        with torch.no_grad():
            self.flat = torch.cat([p.reshape(-1) for p in everything])[low:high].clone()
        self.gradient = torch.zeros_like(self.flat)
        self.params = []
        for offset, shape in pieces([tuple(p.shape) for p in everything], low, high):
            size = math.prod(shape)
            param = nn.Parameter(self.flat[offset : offset + size].view(shape))
            param.grad = self.gradient[offset : offset + size].view(shape)
            self.params.append(param)
        self.optimizer = make_optimizer(self.params)
        self.staleness = plan.staleness
        self.wire = REDUCE_DTYPES[plan.reduce_dtype] or self.gradient.dtype
        """The dtype gradients arrive in (Plan.reduce_dtype)."""
        self.workers = worker_ranks(plan)
        self.version = 0
        self.updates: deque[_Update] = deque()
        self.waiting: dict[int, int] = {w: 0 for w in self.workers}
        """Pushes of each worker not yet in an update."""
        self.computing: dict[int, int] = {w: 0 for w in self.workers}
        """Workers computing a gradient now, with the version they hold."""
        self.asking: set[int] = set()
        self.flushing: set[int] = set()
        self.done: set[int] = set()
        self.stats = {"updates": 0, "pushes": 0, "most_updates_behind": 0}

    def held_bytes(self) -> int:
        """What this server keeps at least: its parameters, their gradient, one update's sum
        and one incoming push (each the size of its parameters), and the optimizer state."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return 4 * self.flat.nbytes + sum(t.nbytes for t in state)

    def serve(self) -> dict[str, int]:
        """Answer the workers until every one is done; how many updates and pushes it took."""
        header = torch.zeros(2, dtype=torch.int64)
        while len(self.done) < len(self.workers):
            worker = dist.recv(header, tag=HEADER)
            kind, version = (int(v) for v in header.tolist())
            self.computing.pop(worker, None)
            if kind == PUSH:
                self._receive(worker, version)
                self.asking.add(worker)
            elif kind == FLUSH:
                self.flushing.add(worker)
            else:
                self.done.add(worker)
            self._advance()
        return dict(self.stats)

    def _receive(self, worker: int, version: int) -> None:
        need = len(self.workers) - len(self.done)
        if not self.updates or self.updates[-1].count >= need:
            self.updates.append(_Update(torch.zeros_like(self.gradient)))
        update = self.updates[-1]
        incoming = torch.empty_like(self.gradient, dtype=self.wire)
        dist.recv(incoming, src=worker, tag=GRADIENT)
        update.gradient += incoming
        update.count += 1
        update.workers.append(worker)
        self.waiting[worker] += 1
        self.stats["pushes"] += 1
        behind = self.version - version
        self.stats["most_updates_behind"] = max(self.stats["most_updates_behind"], behind)

    def _ready(self) -> bool:
        """Whether the oldest update has its pushes and leaves no computing worker more than
        `staleness` updates behind; or, when every worker waits on this server (for an answer
        or a flush) so that no push is coming, whether it has any."""
        if not self.updates:
            return False
        held_back = all(self.waiting[w] > self.staleness for w in self.asking)
        if not self.computing and held_back:  # nobody can push before this update
            return self.updates[0].count > 0
        need = len(self.workers) - len(self.done)
        if self.updates[0].count < need:
            return False
        return all(self.version + 1 - held <= self.staleness for held in self.computing.values())

    def _apply(self) -> None:
        update = self.updates.popleft()
        self.gradient.copy_(update.gradient)
        self.optimizer.step()
        self.version += 1
        self.stats["updates"] += 1
        for worker in update.workers:
            self.waiting[worker] -= 1

    def _advance(self) -> None:
        """Make the updates that are ready, then answer whoever may go on."""
        while self._ready():
            self._apply()
        active = set(self.workers) - self.done
        if self.flushing and self.flushing >= active:
            while self.updates and self.updates[0].count:  # apply what waits, even partial
                self._apply()
            for worker in sorted(self.flushing):
                self._answer(worker)
            self.flushing.clear()
        for worker in sorted(self.asking):
            if self.waiting[worker] <= self.staleness:
                self.asking.discard(worker)
                self._answer(worker)

    def _answer(self, worker: int) -> None:
        dist.send(torch.tensor([self.version], dtype=torch.int64), dst=worker, tag=VERSION)
        dist.send(self.flat, dst=worker, tag=PARAMETERS)
        self.computing[worker] = self.version


_SERVED = "ps/served"
"""The job-store key a parameter server sets: it will leave the job after this engine."""


def refuse_after_servers_left() -> None:
    """A job whose parameter servers served an engine has lost those processes: a new
    engine's collectives would wait for them forever."""
    store = job_store()
    if store is not None and store.check([_SERVED]):
        raise PlanError(
            "this job's parameter servers served an engine and left it (they leave once its "
            "workers close it): build one sync='ps' engine per ms.launch (or Trainer.fit), "
            "and no other engine after it"
        )


def serve(
    model: nn.Module,
    plan: Plan,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    make_state: Callable[[torch.optim.Optimizer], object],
) -> None:
    """A parameter server's whole part: hold its tensors to the budget, serve the workers
    until all are done, then leave the job's function with what it did. `make_state` makes
    the optimizer's state now, so its bytes count against the budget."""
    store = job_store()
    if store is not None:
        store.set(_SERVED, str(dist.get_rank()))
    server = ParameterServer(model.parameters(), plan, make_optimizer)
    make_state(server.optimizer)
    budget, held = plan.budget_bytes, server.held_bytes()
    if budget is not None and held > budget:
        raise PlanError(
            f"parameter server rank {dist.get_rank()} ({plan.describe()}) needs {held:,} bytes "
            f"for its parameters, their gradient sums and optimizer state, over "
            f"Plan.memory_budget={plan.memory_budget!r}; use more servers (servers="
            f"{plan.server_count * -(-held // budget)}) or a larger budget"
        )
    raise LeaveJob({"server": dist.get_rank() - plan.dp, "held_bytes": held, **server.serve()})
