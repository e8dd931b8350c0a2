"""The data-parallel axis: gradient buckets (allreduce.py) and sharded state (zero.py)."""

from __future__ import annotations

from meshsplit.data_parallel.allreduce import GradientSync, gather_rows
from meshsplit.data_parallel.ps import ParameterClient
from meshsplit.data_parallel.zero import (
    ShardedGradients,
    gather_shards,
    shard_optimizer,
    shard_state,
)

Sync = GradientSync | ShardedGradients | ParameterClient
"""How a replica's gradients meet the others': all-reduced buckets, FSDP2's shards, or
pushed to parameter servers."""

__all__ = [
    "GradientSync",
    "ParameterClient",
    "ShardedGradients",
    "Sync",
    "gather_rows",
    "gather_shards",
    "shard_optimizer",
    "shard_state",
]
