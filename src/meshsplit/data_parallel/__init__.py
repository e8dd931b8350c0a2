"""The data-parallel axis: gradient buckets (allreduce.py), sharded state (zero.py) and
parameter servers (ps.py), one Sync interface over them (sync.py)."""

from __future__ import annotations

from meshsplit.data_parallel.allreduce import gather_rows
from meshsplit.data_parallel.sync import (
    ExpertParameters,
    ShardUnits,
    Sync,
    TrainingState,
    check_servers,
    serve,
    training_state,
)
from meshsplit.data_parallel.zero import gather_shards

__all__ = [
    "ExpertParameters",
    "ShardUnits",
    "Sync",
    "TrainingState",
    "check_servers",
    "gather_rows",
    "gather_shards",
    "serve",
    "training_state",
]
