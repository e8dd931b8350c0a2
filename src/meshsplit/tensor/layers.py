"""Parallel layers: one operator's weight split over the tp group, built from the original layer.

`from_module(module, group, ...)` slices the original's weights, so the split model starts from
the unsplit one's parameters under the same names; `shard_dims` says which are split along
which dim. A column layer feeding a row layer (Megatron) needs one all-reduce in forward and
one in backward. Attention split by heads lives in `attention.py`, convolutions in
`conv.py`, `conv_transpose.py` and `conv1d.py` (Hugging Face's Conv1D).
Rationale: docs/internals.md#tensorlayerspy
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from torch import nn

from meshsplit.mesh import Mesh
from meshsplit.plan import PlanError
from meshsplit.tensor.collectives import (
    copy_to_tp,
    gather_from_tp,
    in_autocast_dtype,
    reduce_from_tp,
    scatter_to_tp,
)
from meshsplit.tensor.shards import ParallelLayer, local_shard

__all__ = [
    "ParallelLayer",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]


def enter_copy(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """Replicated x into `layer`'s split region. forward: identity (a cast under autocast);
    backward: all-reduce.

    Layers given one `input_copies` (see `InputCopies`) share the copy of a tensor they all read.
    """
    copies = getattr(layer, "input_copies", None)
    if copies is not None:
        return copies.copy(x, layer.group)
    return copy_to_tp(in_autocast_dtype(x), layer.group)


def enter_slice(layer: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Replicated x into the region as this rank's slice. forward: slice; backward: all-gather."""
    return scatter_to_tp(x, layer.group, dim)


def leave_sum(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """Partial sums out of the region. forward: all-reduce; backward: identity."""
    return reduce_from_tp(x, layer.group)


def leave_gather(layer: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Split output out of the region, whole. forward: all-gather; backward: own slice."""
    return gather_from_tp(x, layer.group, dim)


for _crossing in (enter_copy, enter_slice, leave_sum, leave_gather):
    torch.fx.wrap(_crossing.__name__)


def embedding_scale(module: nn.Module, dtype: torch.dtype) -> Any:
    """What an Embedding subclass multiplies the rows it looks up by: its `embed_scale`
    (Gemma's, M2M100's, BART's with scale_embedding) when it has one, else 1."""
    scale = getattr(module, "embed_scale", 1.0)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale.to(dtype)
    return scale if isinstance(scale, float | int) and not isinstance(scale, bool) else 1.0


def tp_group(mesh_or_group: Mesh | dist.ProcessGroup) -> dist.ProcessGroup:
    """The tp group of a mesh, or the group itself."""
    return mesh_or_group.group("tp") if isinstance(mesh_or_group, Mesh) else mesh_or_group


def shard_param(
    tensor: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    *,
    layer: nn.Module,
    what: str,
    parts: int = 1,
) -> nn.Parameter:
    """This rank's shard of `tensor` along `dim` (block r of each of `parts` parts)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    full = tensor.shape[dim]
    if full % (size * parts):
        working = [d for d in range(1, full // parts + 1) if full % (d * parts) == 0]
        fused = f" in {parts} fused parts" if parts > 1 else ""
        raise PlanError(
            f"tp={size} does not divide {type(layer).__name__} {what}={full}{fused}; "
            f"use tp in {{{', '.join(map(str, working))}}}"
        )
    piece = local_shard(tensor.detach(), dim, parts, rank, size).clone()
    return nn.Parameter(piece, requires_grad=tensor.requires_grad)


def check_heads(tp: int, heads: int, what: str) -> None:
    """Refuse a split by heads that tp does not divide, naming the tp values that do."""
    if heads % tp:
        working = [d for d in range(1, heads + 1) if heads % d == 0]
        raise PlanError(
            f"tp={tp} does not divide {what}={heads}; use tp in {{{', '.join(map(str, working))}}}"
        )


def check_fused_output(parts: int, gather_output: bool) -> None:
    """A fused column's gathered output would interleave the parts' blocks: refuse it."""
    if parts > 1 and gather_output:
        raise PlanError(
            f"a fused projection ({parts} parts) cannot gather its split output; "
            "pair it with a row layer or replicate it (tp_plan={'<name>': 'replicate'})"
        )


def copy_param(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """A replicated parameter: the original's values, its own storage."""
    if tensor is None:
        return None
    return nn.Parameter(tensor.detach().clone(), requires_grad=tensor.requires_grad)


def channel_bias(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A row convolution's replicated bias, shaped to add along channels (dim 1) of `y`."""
    return bias.to(y.dtype).view(1, -1, *[1] * (y.dim() - 2))


class ColumnParallelLinear(ParallelLayer):
    """Y = X·Aᵀ + b with A's rows (output features) split: rank i computes Y_i = X·A_iᵀ + b_i.

    Input: replicated X, entered by copy (forward: identity; backward: all-reduce dX over tp),
    unless the caller already did (`copy_input=False`, e.g. q, k and v sharing one copy).
    Output: Y_i split along the last dim, or whole when `gather_output` (forward: all-gather;
    backward: own slice). A fused projection (`parts` > 1, e.g. q|k|v in one weight) keeps
    block i of every part, so Y_i = [q_i | k_i | v_i]; its output is never gathered.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        gather_output: bool,
        copy_input: bool,
        parts: int = 1,
    ) -> None:
        super().__init__(group, parts=parts)
        self.weight = weight
        self.bias = bias
        self.gather_output = gather_output
        self.copy_input = copy_input

    @classmethod
    def from_module(
        cls,
        linear: nn.Linear,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        gather_output: bool = False,
        copy_input: bool = True,
        parts: int = 1,
    ) -> ColumnParallelLinear:
        group = tp_group(mesh_or_group)
        check_fused_output(parts, gather_output)
        what = "out_features"
        weight = shard_param(linear.weight, 0, group, layer=linear, what=what, parts=parts)
        bias = None
        if linear.bias is not None:
            bias = shard_param(linear.bias, 0, group, layer=linear, what=what, parts=parts)
        return cls(
            weight=weight,
            bias=bias,
            group=group,
            gather_output=gather_output,
            copy_input=copy_input,
            parts=parts,
        )

    @property
    def in_features(self) -> int:
        """nn.Linear's, of the whole layer: a model may read it (to shape its output)."""
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0]) * self.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = enter_copy(self, x)
        y = F.linear(x, self.weight, self.bias)
        return leave_gather(self, y, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        out, n_in = self.weight.shape
        return f"in={n_in}, out={out}x{self.tp}, gather_output={self.gather_output}"


class RowParallelLinear(ParallelLayer):
    """Y = X·Aᵀ + b with A's columns (input features) split: Y = sum_i X_i·A_iᵀ, then + b.

    Input: X_i, this rank's slice of the last dim, as a column layer leaves it; or replicated X
    sliced here when `scatter_input` (forward: slice; backward: all-gather).
    Output: the sum over tp (forward: all-reduce; backward: identity), then the replicated bias.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: dist.ProcessGroup,
        scatter_input: bool,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.bias = bias
        self.scatter_input = scatter_input

    @classmethod
    def from_module(
        cls,
        linear: nn.Linear,
        mesh_or_group: Mesh | dist.ProcessGroup,
        *,
        scatter_input: bool = False,
    ) -> RowParallelLinear:
        group = tp_group(mesh_or_group)
        weight = shard_param(linear.weight, 1, group, layer=linear, what="in_features")
        bias = copy_param(linear.bias)
        return cls(weight=weight, bias=bias, group=group, scatter_input=scatter_input)

    @property
    def in_features(self) -> int:
        """nn.Linear's, of the whole layer: a model may read it (to shape its output)."""
        return int(self.weight.shape[1]) * self.tp

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scatter_input:
            x = enter_slice(self, x, -1)
        y = leave_sum(self, F.linear(x, self.weight))  # the bias in y's dtype, as F.linear
        return y if self.bias is None else y + self.bias.to(y.dtype)  # would under autocast

    def extra_repr(self) -> str:
        out, n_in = self.weight.shape
        return f"in={n_in}x{self.tp}, out={out}, scatter_input={self.scatter_input}"


class VocabParallelEmbedding(ParallelLayer):
    """E[ids] with E's rows (the vocabulary) split: rank i holds rows [i·V/tp, (i+1)·V/tp).

    Each rank looks up the ids it owns and writes zeros for the others; the sum over tp
    (forward: all-reduce; backward: identity) is the whole lookup, and each row's gradient
    lands only on the rank that owns it. A `padding_idx` row gets no gradient, as in
    nn.Embedding, on the rank that owns it.
    """

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(
        self,
        *,
        weight: nn.Parameter,
        group: dist.ProcessGroup,
        padding_idx: int | None = None,
        scale: Any = 1.0,
    ) -> None:
        super().__init__(group)
        self.weight = weight
        self.scale = scale
        """What the rows looked up are multiplied by (an Embedding subclass's embed_scale)."""
        self.vocab_start = dist.get_rank(group) * weight.shape[0]
        local = None if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = local if local is not None and 0 <= local < weight.shape[0] else None
        """The padding row's local index when this rank owns it."""

    @classmethod
    def from_module(
        cls, embedding: nn.Embedding, mesh_or_group: Mesh | dist.ProcessGroup
    ) -> VocabParallelEmbedding:
        group = tp_group(mesh_or_group)
        if embedding.max_norm is not None or embedding.sparse:
            raise PlanError(
                f"Embedding with max_norm={embedding.max_norm}, sparse={embedding.sparse} cannot "
                "be split by vocabulary; replicate it (tp_plan={'<name>': 'replicate'})"
            )
        weight = shard_param(embedding.weight, 0, group, layer=embedding, what="num_embeddings")
        scale = embedding_scale(embedding, embedding.weight.dtype)
        return cls(weight=weight, group=group, padding_idx=embedding.padding_idx, scale=scale)

    @property
    def num_embeddings(self) -> int:
        """nn.Embedding's, of the whole table: a model may read it (Whisper's positions)."""
        return int(self.weight.shape[0]) * self.tp

    @property
    def embedding_dim(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(owned, local, 0), self.weight, self.padding_idx)
        looked_up = leave_sum(self, rows * owned.unsqueeze(-1).to(rows.dtype))
        if isinstance(self.scale, torch.Tensor) or self.scale != 1.0:
            return looked_up * self.scale
        return looked_up

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"{rows}x{self.tp}, {dim}, vocab_start={self.vocab_start}"
