"""meshsplit: train one PyTorch model on many devices (data, layer and operator split)."""

from meshsplit import data, models, tensor
from meshsplit.engine import Engine, parallelize
from meshsplit.launch import WorkerError, launch
from meshsplit.memory.report import MemoryReport
from meshsplit.plan import Plan, PlanError

__all__ = [
    "Engine",
    "MemoryReport",
    "Plan",
    "PlanError",
    "WorkerError",
    "data",
    "launch",
    "models",
    "parallelize",
    "tensor",
]
