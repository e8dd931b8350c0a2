"""LLaMA written the way Meta's reference code writes it, outside Hugging Face: the attention
reads its per-rank head counts as `n_local_heads` and `n_local_kv_heads` and repeats each kv
head `n_rep` times. Under tp its q/k/v/o pair by heads (kv heads shared by ranks where there
are fewer than tp), instead of splitting alone with their outputs gathered (four all-gathers
an attention), and training equals one process.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshsplit as ms
from meshsplit import tensor

from reference import assert_matches, train_plainly

DIM, HEADS, VOCAB = 32, 4, 64


class Attention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = HEADS, kv_heads
        self.n_rep, self.head_dim = HEADS // kv_heads, DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, _ = x.shape
        q = self.wq(x).view(rows, length, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(rows, length, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(rows, length, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + torch.full((length, length), float("-inf")).triu(1)
        out = F.softmax(scores, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(rows, length, -1))


class Block(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention(kv_heads)
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.silu(self.w1(self.ffn_norm(h))))


class Transformer(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(kv_heads) for _ in range(2))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _build(kv_heads: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(kv_heads)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (3, 8, 9), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(("kv_heads", "tp"), [(4, 2), (4, 4), (2, 4)])
def test_the_attention_pairs_by_heads(kv_heads: int, tp: int) -> None:
    decisions = tensor.plan_splits(_build(kv_heads), tp, example=_batches()[0][0])
    splits = {d.name.rpartition(".")[2]: d for d in decisions if ".attention.w" in d.name}
    assert {n: d.split for n, d in splits.items()} == {
        "wq": "column", "wk": "column", "wv": "column", "wo": "row"
    }, splits  # fmt: skip
    assert "pairs with" in splits["wo"].reason
    assert not splits["wq"].gather_output, "a lone column, its output gathered"


def _run(kv_heads: int, plan: ms.Plan) -> tuple[list[float], dict[str, torch.Tensor], int]:
    engine = ms.parallelize(
        _build(kv_heads), plan, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy()
    )
    losses = [engine.train_step(x, y) for x, y in _batches()]
    rows = engine.runner.local_state_dict()["layers.0.attention.wq.weight"].shape[0]
    state = engine.full_state_dict()
    engine.close()
    return losses, state, rows


def test_two_kv_heads_under_tp4_train_as_one_process() -> None:
    model = _build(2)
    expected = train_plainly(
        model, _sgd(model.parameters()), ms.models.TokenCrossEntropy(), _batches()
    )
    per_rank = ms.launch(_run, 4, args=(2, ms.Plan(tp=4)), timeout_s=300)
    assert_matches([(losses, state) for losses, state, _ in per_rank], expected, rtol=1e-4)
    assert [rows for *_, rows in per_rank] == [DIM // 4] * 4  # each rank its query head
