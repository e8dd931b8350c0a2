"""torch's nn.MultiheadAttention split by heads: its fused q|k|v rows by head, out_proj by rows.

Rank r keeps block r of each third of `in_proj_weight` (a fused tensor of 3 parts, as GPT-2's
c_attn), that is the q, k and v rows of heads r·h .. (r+1)·h with h = num_heads / tp, and the
matching input columns of `out_proj` (row-parallel: one all-reduce, its bias added once). The
forward is `F.multi_head_attention_forward`'s for those heads: masks (2-D, 3-D per head, key
padding, bool or float) are cut to the rank's heads, weights asked for are summed over tp
(averaged) or gathered (per head). State-dict names and shapes stay the module's. Every
collective goes through `layers`' fx-wrapped crossings, so a traced pipeline stage records
them as calls.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshsplit.tensor import layers
from meshsplit.tensor.shards import ParallelLayer

__all__ = ["HeadParallelMultiheadAttention", "multihead_refusal", "split_multihead"]


def multihead_refusal(module: nn.MultiheadAttention) -> str | None:
    """Why this nn.MultiheadAttention cannot split by heads here (None: it can)."""
    if type(module).forward is not nn.MultiheadAttention.forward:
        return f"own forward: {type(module).__name__} kept whole"
    if not module._qkv_same_embed_dim:
        return "nn.MultiheadAttention with kdim/vdim of their own kept whole (separate q, k, v)"
    if module.bias_k is not None or module.add_zero_attn:
        return "nn.MultiheadAttention with add_bias_kv or add_zero_attn kept whole"
    return None


class HeadParallelMultiheadAttention(nn.MultiheadAttention, ParallelLayer):
    """An nn.MultiheadAttention holding num_heads / tp heads (see the module doc).

    `num_heads` and `embed_dim` still answer for the whole layer. `_qkv_same_embed_dim` is
    False so torch's fused inference paths (TransformerEncoderLayer's), which read the
    weights whole, are not taken.
    """

    shard_dims: ClassVar[dict[str, int]] = {"in_proj_weight": 0, "in_proj_bias": 0}
    group: dist.ProcessGroup
    parts: int

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)"
            )
        batched = query.dim() == 3
        if not batched and key_padding_mask is not None:  # (L, E): one sequence
            key_padding_mask = key_padding_mask.unsqueeze(0)
        laid_out: dict[int, torch.Tensor] = {}  # once per distinct input: one copy into tp
        for t in (query, key, value):
            if id(t) not in laid_out:
                laid_out[id(t)] = self._batch_first(t, batched)
        q, k, v = self._project(*(laid_out[id(t)] for t in (query, key, value)))
        rows, length, span = q.shape[0], q.shape[2], k.shape[2]
        mask = self._mask(attn_mask, key_padding_mask, rows, length, span, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
            weights = (scores if mask is None else scores + mask).softmax(dim=-1)
            out = (F.dropout(weights, dropout) if dropout > 0 else weights) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        out = self.out_proj(out.transpose(1, 2).reshape(rows, length, -1))
        if weights is not None:
            if average_attn_weights:
                weights = layers.leave_sum(self, weights.sum(dim=1)) / self.num_heads
            else:
                weights = layers.leave_gather(self, weights, 1)
            if not batched:
                weights = weights.squeeze(0)
        if not batched:
            return out.squeeze(0), weights
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _batch_first(self, t: torch.Tensor, batched: bool) -> torch.Tensor:
        """`t` as (batch, length, E)."""
        if not batched:
            return t.unsqueeze(0)
        return t if self.batch_first else t.transpose(0, 1)

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> list[torch.Tensor]:
        """This rank's heads of q, k and v as (batch, heads, length, head_dim); one input copy
        per distinct tensor (self-attention reads one)."""
        entered: dict[int, torch.Tensor] = {}
        for t in (query, key, value):
            if id(t) not in entered:
                entered[id(t)] = layers.enter_copy(self, t)
        weights = self.in_proj_weight.chunk(3)
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        heads = self.num_heads // self.tp
        return [
            F.linear(entered[id(t)], w, b).unflatten(-1, (heads, self.head_dim)).transpose(1, 2)
            for t, w, b in zip((query, key, value), weights, biases, strict=True)
        ]

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        rows: int,
        length: int,
        span: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The additive mask over this rank's heads, (rows or 1, heads or 1, length, span)."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, dtype)
            if mask.dim() == 3:  # (rows * num_heads, length, span): keep this rank's heads
                heads = self.num_heads // self.tp
                first = dist.get_rank(self.group) * heads
                mask = mask.view(rows, self.num_heads, length, span)[:, first : first + heads]
            else:
                mask = mask.view(1, 1, length, span)
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, dtype).view(rows, 1, 1, span)
            mask = padding if mask is None else mask + padding
        return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask to add to the scores: a bool one's True (not attended) becomes -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def split_multihead(module: nn.MultiheadAttention, group: dist.ProcessGroup) -> nn.Module:
    """Split `module` by heads over the tp `group`, in place (see the module doc)."""
    layers.check_heads(
        dist.get_world_size(group), module.num_heads, "nn.MultiheadAttention num_heads"
    )
    shard: dict[str, Any] = {"group": group, "layer": module, "what": "embed_dim", "parts": 3}
    module.in_proj_weight = layers.shard_param(module.in_proj_weight, 0, **shard)
    if module.in_proj_bias is not None:
        module.in_proj_bias = layers.shard_param(module.in_proj_bias, 0, **shard)
    module.out_proj = layers.RowParallelLinear.from_module(module.out_proj, group)  # type: ignore[assignment]
    module.group, module.parts = group, 3  # type: ignore[assignment]
    module._qkv_same_embed_dim = False
    module.__class__ = HeadParallelMultiheadAttention
    return module
