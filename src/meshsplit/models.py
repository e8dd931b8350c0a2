"""The reference models: the source documents' MLP and CNN, a small GPT-style transformer,
and a Mixtral-shaped mixture of experts (the expert split's case).

All are plain `nn.Sequential` stacks of named layers, so the layer split can cut between any
two of them and the operator split finds Linear/Conv2d/attention by walking the tree.
Outputs are logits; pair them with `nn.CrossEntropyLoss` (the softmax lives in the loss).
`reference(name)` keeps each model with its loss and data, so the command line, `compare`
and the benchmarks train the same thing without each spelling it out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshsplit import data

__all__ = [
    "REFERENCE_NAMES",
    "Block",
    "Experts",
    "MoEBlock",
    "Reference",
    "SelfAttention",
    "TokenCrossEntropy",
    "cnn",
    "mlp",
    "moe",
    "reference",
    "transformer",
]


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


class Experts(nn.Module):
    """E SwiGLU experts fused along dim 0, called as transformers v5 calls Mixtral's: each
    token's output is sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over its top-k e."""

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, d_model) / d_model**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, d_model, hidden) / hidden**0.5)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            answer = F.linear(F.silu(gate) * up, self.down_proj[expert])
            weighted = answer * top_k_weights[token, slot, None]  # autocast: a low dtype
            out = out.index_add(0, token, weighted.to(out.dtype))
        return out


class MoEBlock(nn.Module):
    """Pre-norm block with a sparse MLP: x + attn(ln(x)), then x + experts(ln(x)) over the
    top_k experts a linear router picks per token (weights renormalised over the top_k)."""

    def __init__(self, d_model: int, n_heads: int, experts: int, hidden: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = Experts(experts, d_model, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        tokens = self.ln2(x).reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(tokens), -1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(tokens, index, weights).view_as(x)


def moe(
    vocab_size: int = 256,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    seq_len: int = 32,
    experts: int = 8,
    hidden: int = 128,
    top_k: int = 2,
) -> nn.Sequential:
    """Small Mixtral-shaped decoder: embedding, n_layers blocks of attention and a top-2
    router over 8 fused experts, final norm, vocab head. Token ids (N, seq_len) in."""
    layers: list[tuple[str, nn.Module]] = [("embed", Embedding(vocab_size, d_model, seq_len))]
    layers += [
        (f"block{i}", MoEBlock(d_model, n_heads, experts, hidden, top_k)) for i in range(n_layers)
    ]
    layers += [("ln_f", nn.LayerNorm(d_model)), ("head", nn.Linear(d_model, vocab_size))]
    return nn.Sequential(OrderedDict(layers))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy over every position: logits (N, T, V) against token ids (N, T)."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


Batch = tuple[torch.Tensor, torch.Tensor]

TOKEN_ROWS = {"train": 2048, "test": 512}
"""Counting sequences in the token models' training and test sets."""


@dataclass(frozen=True, kw_only=True)
class Reference:
    """One reference model with the loss and the data it trains on."""

    name: str
    """'mlp', 'cnn', 'transformer' or 'moe'."""
    build: Callable[..., nn.Module]
    """The model's factory; with no arguments it builds the default sizes."""
    takes_tokens: bool
    """Token ids (N, 32) in, a next token per position out; else 28x28 images and a class."""

    def model(self, **sizes: Any) -> nn.Module:
        """The model at its default sizes, or with `sizes` changed (e.g. n_layers=4)."""
        return self.build(**sizes)

    def loss(self) -> nn.Module:
        """Cross-entropy per image, or per token position for the token models."""
        return TokenCrossEntropy() if self.takes_tokens else nn.CrossEntropyLoss()

    def data(self, split: str) -> Batch:
        """The learnable set of `split` ('train' or 'test'): digits for the image models;
        counting sequences (2,048 to train, 512 to test) for the token models."""
        if not self.takes_tokens:
            return data.digits(split)
        if split not in TOKEN_ROWS:
            raise ValueError(f"split={split!r}; use 'train' or 'test'")
        return data.counting_tokens(TOKEN_ROWS[split], seed=0 if split == "train" else 1)

    def example_batch(self, rows: int) -> Batch:
        """The first `rows` of the training set: a batch to profile, estimate or plan with."""
        inputs, targets = self.data("train")
        return inputs[:rows], targets[:rows]

    def samples(self, rows: int, seed: int = 0) -> Batch:
        """Exactly `rows` learnable training rows: counting sequences drawn with `seed`, or
        the digits' training set repeated as often as it takes (the digits are fixed)."""
        if self.takes_tokens:
            return data.counting_tokens(rows, seed=seed)
        inputs, targets = data.digits("train")
        repeats = -(-rows // len(inputs))
        return inputs.repeat(repeats, 1, 1, 1)[:rows], targets.repeat(repeats)[:rows]

    def synthetic(self, rows: int, seed: int = 0) -> Batch:
        """`rows` random inputs and targets of the default sizes, for speed and memory."""
        if self.takes_tokens:
            return data.synthetic_tokens(rows, seed=seed)
        return data.synthetic_images(rows, seed=seed)


_REFERENCES = {
    "mlp": Reference(name="mlp", build=mlp, takes_tokens=False),
    "cnn": Reference(name="cnn", build=cnn, takes_tokens=False),
    "transformer": Reference(name="transformer", build=transformer, takes_tokens=True),
    "moe": Reference(name="moe", build=moe, takes_tokens=True),
}
REFERENCE_NAMES = tuple(_REFERENCES)
"""The reference models by name, in the order the command line lists them."""


def reference(name: str) -> Reference:
    """The reference model `name` ('mlp', 'cnn', 'transformer' or 'moe') with its loss and
    data."""
    if name not in _REFERENCES:
        raise ValueError(f"no reference model {name!r}; use one of {', '.join(REFERENCE_NAMES)}")
    return _REFERENCES[name]
