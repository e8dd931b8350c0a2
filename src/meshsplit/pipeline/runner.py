"""PipelineRunner: the Runner for pp > 1 — this rank's stage of a profile-balanced layer split
(its chunks r, r+pp, ... under the interleaved schedule).

Every rank measures the pieces on one micro-batch and the costs are agreed by an
all-reduce(min), so all ranks compute the same split; each micro-batch's loss is weighted by
its share of the global batch, so the accumulated gradients equal one step on the whole batch.
Rationale: docs/internals.md#pipelinerunnerpy
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.batch import LossFn, cat_rows, loss_weight, rows, split_rows, to_device
from meshsplit.mesh import Mesh
from meshsplit.pipeline.cuts import Cuts, find_cuts
from meshsplit.pipeline.p2p import Exchange, broadcast_tensor, wire_dtype
from meshsplit.pipeline.profile import LayerCost
from meshsplit.pipeline.schedules import diagram, forward_only, idle_fraction, schedule
from meshsplit.pipeline.stage import Stage, run
from meshsplit.pipeline.tied import TiedGradients
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import Precision

__all__ = ["PipelineRunner"]

Stagewise = Callable[[int, Callable[..., Any]], Callable[..., Any]]
"""(stage, its computation) -> the computation as that stage runs it."""


class PipelineRunner:
    """One stage of the pipeline on this rank; every method is called on every rank."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        plan: Plan,
        loss_fn: LossFn,
        example: Any,
        precision: Precision,
    ) -> None:
        if example is None:
            raise PlanError(
                f"Plan.pp={plan.pp} needs one micro-batch to profile the layers before the "
                "split; pass example_inputs= to parallelize, or call train_step/predict first"
            )
        example = to_device(example, mesh.device)
        cuts = find_cuts(model, example, plan, lambda costs: _agreed(costs, mesh.device))
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.model = model
        self.sizes = cuts.sizes
        self.index = mesh.rank("pp")
        module = cuts.stage_module(self.index)
        exchange = Exchange(mesh.device, wire_dtype(plan), rank=dist.get_rank())
        self.chunks = {
            chunk: Stage(
                index=chunk,
                stages=len(cuts.sizes),
                module=module,
                program=cuts.program(chunk),
                output=cuts.output,
                routes=cuts.routes[chunk],
                peers=[mesh.global_rank(pp=rank) for rank in cuts.placement],
                exchange=exchange,
                precision=precision,
            )
            for chunk in cuts.chunks_of(self.index)
        }
        """This rank's chunks (one stage unless interleaved), by chunk index."""
        self.stage = self.chunks[self.index]
        """The first of them (its exchange is every chunk's)."""
        self.module: nn.Module = module
        self.tied = TiedGradients(cuts.shared_parameters(), mesh)
        self._cuts = cuts
        self._state = cuts.local_state(self.index)
        self._description = _describe(cuts, plan)
        self._last_stage = cuts.placement[-1]
        """The rank of the last chunk (pp-1, or 0 under 'zbv'): it computes the loss."""
        self._last_rank = mesh.global_rank(pp=self._last_stage)
        cuts.release_other_stages(self.index)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def items(self) -> list[str]:
        """The names, in `module`, of the items this stage runs (each called as a module)."""
        return [name for name in self.module._modules if name != "<common>"]

    def recompute_stage(
        self, wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Run this stage's part as `wrap(stage, computation)` says (the memory policy's
        choice, made above this axis: recomputed in backward, or as it is), every chunk alike."""
        for stage in self.chunks.values():
            stage.compute = wrap(self.index, stage.program)

    def reread_state(self) -> None:
        """Name this stage's tensors anew after their modules got new ones (sharding)."""
        self._state = self._cuts.local_state(self.index)

    def train(self, mode: bool) -> None:
        """Training or eval mode for the whole model (code between pieces runs here too),
        switched when it differs: a walk over every module, each step otherwise (as the
        one-stage runner)."""
        for module in (self.model, self.module):
            if module.training != mode:
                module.train(mode)

    def backward_passes(self) -> int:
        """Each local parameter gets one backward pass per micro-batch (its W under
        zero-bubble: B accumulates into no parameter)."""
        return self.plan.micro_batches

    def finish_gradients(self) -> None:
        """Sum the gradients of parameters that several stages hold (tied embeddings)."""
        self.tied.all_reduce()

    def train_batch(self, inputs: Any, targets: Any, global_rows: int) -> torch.Tensor:
        m = self.plan.micro_batches
        if rows(inputs) % m:
            raise PlanError(
                f"this replica's {rows(inputs)} rows do not split into Plan.micro_batches={m}; "
                f"use a global batch that is a multiple of dp*micro_batches"
            )
        xs, ys = split_rows(inputs, m), split_rows(targets, m)

        def loss_of(output: Any, y: Any) -> torch.Tensor:
            return self.loss_fn(output, y) * loss_weight(self.loss_fn, rows(y), global_rows)

        plan = self.plan
        actions = schedule(plan.schedule, plan.pp, m, plan.virtual_stages)[self.index]
        step = run(self.chunks, actions, xs, ys, loss_of)
        if step.loss is None:  # only the last stage computes it; the engine's sum adds it
            return torch.zeros((), device=self.mesh.device)
        return step.loss.detach()

    def forward(self, inputs: Any) -> Any:
        chunks = split_rows(inputs, max(1, min(self.plan.micro_batches, rows(inputs))))
        plan = self.plan
        actions = forward_only(plan.pp, len(chunks), plan.virtual_stages, plan.schedule)
        step = run(self.chunks, actions[self.index], chunks, None, None)
        output = cat_rows(step.outputs) if self.index == self._last_stage else None
        group = self.mesh.group("pp")
        kind = [isinstance(output, torch.Tensor)]  # the last stage tells what it made
        dist.broadcast_object_list(kind, src=self._last_rank, group=group)
        if kind[0]:
            return broadcast_tensor(output, self._last_rank, group, self.mesh.device)
        box = [to_device(output, torch.device("cpu"))]  # a pytree (dict, ModelOutput): by value
        dist.broadcast_object_list(box, src=self._last_rank, group=group)
        return to_device(box[0], self.mesh.device)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self._state.items()}

    def parameter_names(self) -> dict[torch.Tensor, str]:
        """This stage's parameters under the original model's names: a tied one under its
        first (as `named_parameters()` names it without a layer split), so its optimizer
        state has one name under every plan."""
        names: dict[torch.Tensor, str] = {}
        for name, tensor in self._state.items():
            if isinstance(tensor, nn.Parameter):
                names.setdefault(tensor, name)
        return names

    def describe(self) -> dict[str, Any]:
        return self._description

    def communication_buffers(self) -> list[torch.Tensor]:
        """The receive buffers of this stage's pool."""
        return self.stage.exchange.pool.buffers

    @property
    def buffer_allocations(self) -> int:
        """Receive buffers this stage ever allocated (flat once the pool is warm)."""
        return self.stage.exchange.pool.allocations


def _agreed(costs: list[LayerCost], device: torch.device) -> list[LayerCost]:
    """Every rank's costs replaced by the minimum over all ranks, so all compute one split.

    min is exact (the same bits on every rank) and, since load from other processes only
    ever adds time, the least noisy of the ranks' measurements of the same layers.
    """
    times = torch.tensor(
        [[c.forward_ms, c.backward_ms] for c in costs], dtype=torch.float64, device=device
    )
    dist.all_reduce(times, op=dist.ReduceOp.MIN)
    return [
        LayerCost(
            forward_ms=float(f),
            backward_ms=float(b),
            parameter_bytes=c.parameter_bytes,
            activation_bytes=c.activation_bytes,
        )
        for c, (f, b) in zip(costs, times.tolist(), strict=True)
    ]


def _describe(cuts: Cuts, plan: Plan) -> dict[str, Any]:
    """Per chunk (a stage unless interleaved): the rank it runs on, its layers and costs;
    the chunks of each rank; the schedule's idle share at the papers' costs and its diagram."""
    stages = []
    starts = cuts.starts
    for chunk in range(len(cuts.sizes)):
        span = range(starts[chunk], starts[chunk + 1])
        params = {id(p): p for i in span for p in cuts.modules[i].parameters()}
        stages.append(
            {
                "stage": cuts.placement[chunk],
                "chunk": chunk,
                "layers": [cuts.names[i] for i in span],
                "parameters": sum(p.numel() for p in params.values()),
                "forward_ms": sum(cuts.costs[i].forward_ms for i in span),
                "backward_ms": sum(cuts.costs[i].backward_ms for i in span),
                "activation_bytes": cuts.costs[span[-1]].activation_bytes,
            }
        )
    actions = schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
    return {
        "stages": stages,
        "chunks": {rank: list(cuts.chunks_of(rank)) for rank in range(plan.pp)},
        "bubble_fraction": idle_fraction(actions),
        "schedule": diagram(actions),
        "layers_from": cuts.source,
        "shared_parameters": [name for name, _, _ in cuts.shared_parameters()],
    }
