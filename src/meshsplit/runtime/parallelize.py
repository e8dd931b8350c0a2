"""`parallelize(model, plan)`: the entry every user calls in every worker process.

It settles what must be the same on every rank before any split (one mesh, one initial
model, one random stream), sends a parameter server off to serve, and hands the rest to the
Engine, which applies the plan (runtime/apply_plan.py) once it has a micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshsplit import data_parallel
from meshsplit.batch import LossFn
from meshsplit.memory import lazy_model, pools
from meshsplit.memory.report import baseline_bytes, reset_peak
from meshsplit.mesh import Mesh
from meshsplit.plan import Plan
from meshsplit.runtime.apply_plan import OptimizerFactory
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.start import broadcast_from_first_rank, share_random_stream

__all__ = ["OptimizerFactory", "default_optimizer", "parallelize"]


def default_optimizer(params: Iterable[nn.Parameter], lr: float = 1e-3) -> torch.optim.Optimizer:
    """The optimizer when none is given: Adam, lr 1e-3 (Keras's and PyTorch's default)."""
    return torch.optim.Adam(params, lr=lr)


def parallelize(
    model: lazy_model.ModelSource,
    plan: Plan,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    example_inputs: Any = None,
) -> Engine:
    """Split `model` over the running processes as `plan` says and return its Engine.

    Every rank must call this with the same model built the same way; rank 0's initial
    parameters are broadcast so all replicas and shards start from one model. `model` may
    also be a zero-argument factory (or a model on the meta device): then each rank builds
    only its own part, from rank 0's random stream, with the values `factory()` gives in one
    process (see lazy_model.py). The operator split follows the model's data flow and the
    layer split profiles it, both on one micro-batch: `example_inputs` (a tensor or a
    dict/tuple of them), or else the first batch the engine sees.
    """
    lazy = lazy_model.is_lazy(model)
    data_parallel.check_servers(plan, builds_lazily=lazy)
    mesh = Mesh.build(plan)
    make_optimizer = optimizer or default_optimizer
    if lazy:
        share_random_stream(mesh, everywhere=True)  # every rank records the same model
        model = lazy_model.build(model)
        baseline = baseline_bytes(None, mesh.device)
    else:
        assert isinstance(model, nn.Module)
        baseline = baseline_bytes(model, mesh.device)
        model = model.to(mesh.device)
        broadcast_from_first_rank(model)
    if mesh.is_server:
        data_parallel.serve(model, plan, make_optimizer, pools.preallocate_optimizer_state)
    reset_peak(mesh.device)
    share_random_stream(mesh)
    engine = Engine(
        plan=plan,
        mesh=mesh,
        model=model,
        loss_fn=loss_fn if loss_fn is not None else nn.CrossEntropyLoss(),
        make_optimizer=make_optimizer,
        baseline_bytes=baseline,
        lazy=lazy,
    )
    if example_inputs is not None or not engine.needs_example:
        engine.build(example_inputs)
    return engine
