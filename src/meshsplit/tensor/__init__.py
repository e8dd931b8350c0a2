"""Operator split: one operator's weight divided over the tp axis.

`parallelize(model, mesh)` rewrites a model in place (Megatron pairs for Linear and convolutions,
heads for attention, vocabulary for Embedding) and returns one `Decision` per layer;
`plan_splits(model, tp)` makes the same decisions without processes, for checking a plan.
Given `example=` (one model input), pairs are found through the model's data flow.
"""

from meshsplit.tensor.attention import HeadParallelAttention, split_heads
from meshsplit.tensor.collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from meshsplit.tensor.conv import ColumnParallelConv, RowParallelConv
from meshsplit.tensor.conv1d import ColumnParallelConv1D, RowParallelConv1D
from meshsplit.tensor.conv_transpose import ColumnParallelConvTranspose, RowParallelConvTranspose
from meshsplit.tensor.gradient_sum import TpGradientSum
from meshsplit.tensor.layers import (
    ColumnParallelLinear,
    ParallelLayer,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from meshsplit.tensor.loss import vocab_parallel_cross_entropy
from meshsplit.tensor.rewrite import Decision, parallelize, plan_splits
from meshsplit.tensor.shards import (
    local_shard,
    shard_dims,
    shard_layouts,
    unshard_state_dict,
    unshard_tensor,
)

__all__ = [
    "ColumnParallelConv1D",
    "ColumnParallelConv",
    "ColumnParallelConvTranspose",
    "ColumnParallelLinear",
    "Decision",
    "HeadParallelAttention",
    "ParallelLayer",
    "RowParallelConv1D",
    "RowParallelConv",
    "RowParallelConvTranspose",
    "RowParallelLinear",
    "TpGradientSum",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "local_shard",
    "parallelize",
    "plan_splits",
    "reduce_from_tp",
    "scatter_to_tp",
    "shard_dims",
    "shard_layouts",
    "split_heads",
    "unshard_state_dict",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
]
