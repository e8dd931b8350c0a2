"""The data-parallel axis: gradient buckets (allreduce.py) and sharded state (zero.py)."""

from __future__ import annotations

from meshsplit.data_parallel.allreduce import GradientSync, gather_rows
from meshsplit.data_parallel.zero import (
    ShardedGradients,
    gather_shards,
    shard_optimizer,
    shard_state,
)

Sync = GradientSync | ShardedGradients
"""How a replica's gradients meet the others': all-reduced buckets, or FSDP2's shards."""

__all__ = [
    "GradientSync",
    "ShardedGradients",
    "Sync",
    "gather_rows",
    "gather_shards",
    "shard_optimizer",
    "shard_state",
]
