"""meshsplit: train one PyTorch model on many devices (data, layer and operator split)."""

from meshsplit import data, models, tensor
from meshsplit.cli import timeline
from meshsplit.job.desync import DesyncError
from meshsplit.job.input_errors import InputError
from meshsplit.job.launch import WorkerError, launch
from meshsplit.job.nonfinite import NonFiniteError
from meshsplit.job.stop import TrainingStopped
from meshsplit.memory.estimate import MemoryEstimate, RankEstimate
from meshsplit.memory.report import MemoryReport
from meshsplit.memory.tracker import MemoryBudgetError
from meshsplit.plan import Plan, PlanError
from meshsplit.planner.choose import PlanReport, PlanRow, choose_plan
from meshsplit.planner.simulate import estimate_memory
from meshsplit.runtime.checkpoint import CheckpointError, load_full_state_dict
from meshsplit.runtime.engine import Engine
from meshsplit.runtime.parallelize import parallelize
from meshsplit.runtime.trainer import History, Trainer

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
