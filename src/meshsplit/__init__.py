"""meshsplit: train one PyTorch model on many devices (data, layer and operator split)."""

from meshsplit import data, models, tensor, timeline
from meshsplit.checkpoint import CheckpointError, load_full_state_dict
from meshsplit.desync import DesyncError
from meshsplit.engine import Engine, parallelize
from meshsplit.faults import InputError, NonFiniteError, TrainingStopped
from meshsplit.launch import WorkerError, launch
from meshsplit.memory.estimate import MemoryEstimate, RankEstimate
from meshsplit.memory.report import MemoryReport
from meshsplit.memory.tracker import MemoryBudgetError
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.choose import PlanReport, PlanRow, choose_plan
from meshsplit.simulate import estimate_memory
from meshsplit.trainer import History, Trainer

__all__ = [
    "CheckpointError",
    "DesyncError",
    "Engine",
    "History",
    "InputError",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryReport",
    "NonFiniteError",
    "Plan",
    "PlanError",
    "PlanReport",
    "PlanRow",
    "RankEstimate",
    "Trainer",
    "TrainingStopped",
    "WorkerError",
    "choose_plan",
    "data",
    "estimate_memory",
    "launch",
    "load_full_state_dict",
    "models",
    "parallelize",
    "tensor",
    "timeline",
]
