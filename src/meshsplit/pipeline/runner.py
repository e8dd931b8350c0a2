"""PipelineRunner: the Runner for pp > 1 — this rank's stage of a profile-balanced layer split.

Building it: model -> layers (frontend) -> per-layer costs measured on every rank on one
micro-batch and agreed by an all-reduce(min), so every rank computes the same split ->
balanced (or given) stage sizes -> this rank keeps its stage's layers. A step runs the
plan's schedule over the micro-batches; each micro-batch's loss is weighted by its share
of the global batch, so the accumulated gradients equal one step on the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.memory import recompute
from meshsplit.mesh import Mesh
from meshsplit.pipeline.frontend import LayerGraph, layer_graph
from meshsplit.pipeline.p2p import Exchange, broadcast_tensor
from meshsplit.pipeline.partition import balance, check_split
from meshsplit.pipeline.profile import LayerCost, profile_layers
from meshsplit.pipeline.schedules import bubble_fraction, diagram, forward_only, schedule
from meshsplit.pipeline.stage import Stage, plan_routes
from meshsplit.plan import Plan, PlanError
from meshsplit.runner import LossFn, loss_weight

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """One stage of the pipeline on this rank; every method is called on every rank."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        plan: Plan,
        loss_fn: LossFn,
        example: torch.Tensor | None,
    ) -> None:
        if example is None:
            raise PlanError(
                f"Plan.pp={plan.pp} needs one micro-batch to profile the layers before the "
                "split; pass example_inputs= to parallelize, or call train_step/predict first"
            )
        example = example.to(mesh.device)
        graph = layer_graph(model, example)
        check_split(len(graph.layers), plan.pp, plan.stages)
        costs = _agreed(profile_layers(graph, example), mesh.device)
        trainable = [any(p.requires_grad for p in x.module.parameters()) for x in graph.layers]
        sizes = plan.stages or balance([c.total_ms for c in costs], plan.pp, trainable)
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.sizes = tuple(sizes)
        self.index = mesh.rank("pp")
        starts = [sum(sizes[:k]) for k in range(plan.pp + 1)]
        mine = graph.layers[starts[self.index] : starts[self.index + 1]]
        refuse_shared_parameters(graph, starts)
        refuse_stages_without_parameters(graph, starts)
        self.stage = Stage(
            index=self.index,
            stages=plan.pp,
            layers=mine,
            graph=graph,
            routes=plan_routes(graph, sizes)[self.index],
            peers=[mesh.global_rank(pp=k) for k in range(plan.pp)],
            exchange=Exchange(mesh.device),
            recompute=recompute.recomputes(plan.checkpoint, self.index, plan.pp),
        )
        self.module: nn.Module = self.stage.module
        self._state = _local_state(model, graph, starts, self.index)
        self._description = _describe(graph, costs, starts, plan)
        self._last_rank = mesh.global_rank(pp=plan.pp - 1)
        _release_other_stages(model, self.module)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def backward_passes(self) -> int:
        """Each local parameter gets one backward pass per micro-batch."""
        return self.plan.micro_batches

    def train_batch(
        self, inputs: torch.Tensor, targets: torch.Tensor, global_rows: int
    ) -> torch.Tensor:
        m = self.plan.micro_batches
        if len(inputs) % m:
            raise PlanError(
                f"this replica's {len(inputs)} rows do not split into Plan.micro_batches={m}; "
                f"use a global batch that is a multiple of dp*micro_batches"
            )
        xs, ys = inputs.tensor_split(m), targets.tensor_split(m)

        def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(output, y) * loss_weight(self.loss_fn, len(y), global_rows)

        actions = schedule(self.plan.schedule, self.plan.pp, m)[self.index]
        step = self.stage.run(actions, xs, ys, loss_of)
        loss = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if step.loss is not None:
            loss.copy_(step.loss)
        dist.broadcast(loss, src=self._last_rank, group=self.mesh.group("pp"))
        return loss

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.tensor_split(max(1, min(self.plan.micro_batches, len(inputs))))
        actions = forward_only(self.plan.pp, len(chunks))[self.index]
        step = self.stage.run(actions, chunks, None, None)
        output = torch.cat(step.outputs) if self.stage.last else None
        return broadcast_tensor(output, self._last_rank, self.mesh.group("pp"), self.mesh.device)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self._state.items()}

    def describe(self) -> dict[str, Any]:
        return self._description

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


def refuse_shared_parameters(graph: LayerGraph, starts: list[int]) -> None:
    """Tied weights must live on one stage: each stage updates its own copy otherwise."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in range(len(starts) - 1):
        for layer in graph.layers[starts[stage] : starts[stage + 1]]:
            for param in layer.module.parameters():
                first = owner.setdefault(id(param), (stage, layer.name))
                if first[0] != stage:
                    raise PlanError(
                        f"layers {first[1]!r} (stage {first[0]}) and {layer.name!r} (stage "
                        f"{stage}) share a parameter; tied weights cannot span stages; "
                        "choose Plan.stages that keep both layers in one stage"
                    )


def refuse_stages_without_parameters(graph: LayerGraph, starts: list[int]) -> None:
    """A stage with nothing to train cannot build its optimizer; say which and what to do."""
    for stage in range(len(starts) - 1):
        layers = graph.layers[starts[stage] : starts[stage + 1]]
        if not any(p.requires_grad for layer in layers for p in layer.module.parameters()):
            sizes = [b - a for a, b in zip(starts, starts[1:], strict=False)]
            raise PlanError(
                f"stage {stage} of Plan.stages={sizes} holds only layers without trainable "
                f"parameters ({', '.join(layer.name for layer in layers)}); give it a layer with "
                "parameters via Plan.stages, or use fewer stages"
            )


def _release_other_stages(model: nn.Module, stage: nn.Module) -> None:
    """Free the weights this rank does not run, so each rank holds only its stage's share."""
    kept = {id(t) for t in (*stage.parameters(), *stage.buffers())}
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) not in kept:
                tensor.data = tensor.data.new_empty(0)


def _local_state(
    model: nn.Module, graph: LayerGraph, starts: list[int], index: int
) -> dict[str, torch.Tensor]:
    """This stage's state under the original model's names.

    Entries no layer uses (an unused submodule, a stray buffer) go with stage 0, so the
    stages' state dicts together are exactly the model's.
    """
    names: dict[str, int] = {}
    for stage in range(len(starts) - 1):
        for layer in graph.layers[starts[stage] : starts[stage + 1]]:
            for key in layer.module.state_dict():
                names.setdefault(layer.prefix + key, stage)
    return {
        key: value
        for key, value in model.state_dict(keep_vars=True).items()
        if names.get(key, 0) == index
    }


def _describe(
    graph: LayerGraph, costs: list[LayerCost], starts: list[int], plan: Plan
) -> dict[str, Any]:
    stages = []
    for stage in range(plan.pp):
        span = range(starts[stage], starts[stage + 1])
        params = {id(p): p for i in span for p in graph.layers[i].module.parameters()}
        stages.append(
            {
                "stage": stage,
                "layers": [graph.layers[i].name for i in span],
                "parameters": sum(p.numel() for p in params.values()),
                "forward_ms": sum(costs[i].forward_ms for i in span),
                "backward_ms": sum(costs[i].backward_ms for i in span),
                "activation_bytes": costs[span[-1]].activation_bytes,
            }
        )
    return {
        "stages": stages,
        "bubble_fraction": bubble_fraction(plan.pp, plan.micro_batches),
        "schedule": diagram(schedule(plan.schedule, plan.pp, plan.micro_batches)),
        "layers_from": graph.source,
    }
