"""The reference models: the source documents' MLP and CNN, and a small GPT-style transformer.

All are plain `nn.Sequential` stacks of named layers, so the layer split can cut between any
two of them and the operator split finds Linear/Conv2d/attention by walking the tree.
Outputs are logits; pair them with `nn.CrossEntropyLoss` (the softmax lives in the loss).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["mlp", "cnn", "transformer", "TokenCrossEntropy", "SelfAttention", "Block"]


def mlp(widths: tuple[int, ...] = (784, 1024, 512, 256, 10)) -> nn.Sequential:
    """Dense 784-1024-512-256-10 with ReLU between layers; takes (N, 1, 28, 28) or (N, 784)."""
    layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
    for index, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append((f"fc{index + 1}", nn.Linear(n_in, n_out)))
        if index < len(widths) - 2:
            layers.append((f"relu{index + 1}", nn.ReLU()))
    return nn.Sequential(OrderedDict(layers))


def cnn(image_size: int = 28, classes: int = 10) -> nn.Sequential:
    """Conv2d(1->32,3)+ReLU, Conv2d(32->64,3)+ReLU, Flatten, Dense 128+ReLU, Dense 10."""
    side = image_size - 4
    return nn.Sequential(
        OrderedDict(
            [
                ("conv1", nn.Conv2d(1, 32, 3)),
                ("relu1", nn.ReLU()),
                ("conv2", nn.Conv2d(32, 64, 3)),
                ("relu2", nn.ReLU()),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(64 * side * side, 128)),
                ("relu3", nn.ReLU()),
                ("fc2", nn.Linear(128, classes)),
            ]
        )
    )


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v and output projections."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # The head count is read off the projection's width, so a head-split copy runs unchanged.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("fc1", nn.Linear(d_model, 4 * d_model)),
                    ("gelu", nn.GELU()),
                    ("fc2", nn.Linear(4 * d_model, d_model)),
                ]
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding plus learned positions."""

    def __init__(self, vocab_size: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


def transformer(
    vocab_size: int = 256,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    seq_len: int = 32,
) -> nn.Sequential:
    """Small GPT-style decoder: embedding, n_layers blocks, final norm, vocab head.

    Takes token ids (N, seq_len); returns logits (N, seq_len, vocab_size).
    """
    layers: list[tuple[str, nn.Module]] = [("embed", Embedding(vocab_size, d_model, seq_len))]
    layers += [(f"block{i}", Block(d_model, n_heads)) for i in range(n_layers)]
    layers += [("ln_f", nn.LayerNorm(d_model)), ("head", nn.Linear(d_model, vocab_size))]
    return nn.Sequential(OrderedDict(layers))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy over every position: logits (N, T, V) against token ids (N, T)."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
