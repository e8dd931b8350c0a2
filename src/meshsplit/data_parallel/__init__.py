"""The data-parallel axis: gradient buckets (allreduce.py) and sharded state (zero.py)."""

from meshsplit.data_parallel.allreduce import GradientSync, gather_rows
from meshsplit.data_parallel.zero import shard_optimizer

__all__ = ["GradientSync", "gather_rows", "shard_optimizer"]
