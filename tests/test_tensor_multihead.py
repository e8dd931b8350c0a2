"""torch's own nn.MultiheadAttention under the operator split: split by heads, equal to one process.

Three models built from torch's layers: a causal encoder LM (TransformerEncoderLayer,
batch_first, pre-norm, a key padding mask), torch's encoder-decoder nn.Transformer (sequence
first, cross-attention) and attention whose weights enter the loss (averaged, and per head
under a 3-D boolean mask). Each trains 3 SGD steps under tp=2, dp2 x tp2 with ZeRO 3 and
pp2 x tp2, must equal one process, and each tp rank must hold about half the attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.tensor import plan_splits

from reference import assert_matches, train_plainly

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS = 64, 32, 4, 8, 8, 3


class EncoderLM(nn.Module):
    """A causal LM of torch's TransformerEncoderLayers; token 0 is padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(
            DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        hidden = self.encoder(
            self.emb(ids), mask=causal, is_causal=True, src_key_padding_mask=ids == 0
        )
        return self.head(hidden)


class Seq2Seq(nn.Module):
    """torch's nn.Transformer, sequence first (its default layout), fed the same tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.transformer = nn.Transformer(DIM, HEADS, 1, 1, 2 * DIM, dropout=0.0)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.transformer(x, x, tgt_mask=causal).transpose(0, 1))


class WeightsInLoss(nn.Module):
    """Attention weights read by the model: averaged over heads, and per head under a 3-D
    boolean mask (one per row and head, as nn.MultiheadAttention takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.first = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.second = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mix = nn.Linear(SEQ, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        out, averaged = self.first(x, x, x)
        # per row and head, from the row's own tokens (so a replica's rows keep their masks)
        heads = torch.arange(HEADS).view(1, HEADS, 1, 1)
        blocked = (ids[:, None, :, None] + ids[:, None, None, :] + heads) % 3 == 0
        blocked = blocked & ~torch.eye(ids.shape[1], dtype=torch.bool)  # a query sees itself
        out2, per_head = self.second(
            out, x, x, attn_mask=blocked.flatten(0, 1), average_attn_weights=False
        )
        return self.head(out2 + self.mix(averaged) + self.mix(per_head.mean(1)))


MODELS = {"encoder": EncoderLM, "seq2seq": Seq2Seq, "weights": WeightsInLoss}
PLANS = {
    2: [ms.Plan(tp=2)],
    4: [ms.Plan(dp=2, tp=2, zero=3), ms.Plan(pp=2, tp=2, micro_batches=2)],
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
    x[::3, -2:] = 0  # padding at the end of some rows
    y = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _attention_bytes(module: nn.Module) -> int:
    return sum(
        p.numel() * p.element_size()
        for m in module.modules()
        if isinstance(m, nn.MultiheadAttention)
        for p in m.parameters()
    )


def _parallel(plans: list[ms.Plan]) -> list[dict[str, Any]]:
    results = []
    for plan in plans:
        for name in MODELS:
            engine = ms.parallelize(
                _build(name), plan, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy()
            )
            losses = [engine.train_step(x, y) for x, y in _batches()]
            results.append(
                {
                    "run": (losses, engine.full_state_dict()),
                    "predicted": engine.predict(_batches()[0][0]),
                    "attention": _attention_bytes(engine.model),
                }
            )
            engine.close()
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [2, 4])
def test_torch_attention_splits_by_heads_and_equals_one_process(workers: int) -> None:
    per_rank = ms.launch(_parallel, workers, args=(PLANS[workers],), timeout_s=400)
    cases = [(plan, name) for plan in PLANS[workers] for name in MODELS]
    for index, (plan, name) in enumerate(cases):
        model = _build(name)
        whole = _attention_bytes(model)
        want = train_plainly(
            model, _sgd(model.parameters()), ms.models.TokenCrossEntropy(), _batches()
        )
        with torch.no_grad():
            evaluated = model.eval()(_batches()[0][0])
        got = [results[index] for results in per_rank]
        case = f"{name} dp={plan.dp} pp={plan.pp} tp={plan.tp} zero={plan.zero}"
        assert_matches([g["run"] for g in got], want, rtol=1e-4, atol=1e-5, case=case)
        for g in got:
            torch.testing.assert_close(g["predicted"], evaluated, rtol=1e-4, atol=1e-5)
            # a tp rank holds half of each attention's q|k|v and out weights; the out bias whole
            assert g["attention"] < 0.55 * whole, f"{case}: {g['attention']} of {whole} bytes"


def test_what_stays_whole_says_why() -> None:
    kinds = nn.Sequential(
        nn.MultiheadAttention(DIM, HEADS, kdim=16, vdim=16),
        nn.MultiheadAttention(DIM, HEADS, add_bias_kv=True),
        nn.MultiheadAttention(DIM, HEADS),
    )
    decided = {d.name: d for d in plan_splits(kinds, 2)}
    assert decided["0"].split == "replicate" and "kdim/vdim" in decided["0"].reason
    assert decided["1"].split == "replicate" and "add_bias_kv" in decided["1"].reason
    assert decided["2"].split == "heads"
    with pytest.raises(ms.PlanError, match=r"num_heads=4; use tp in \{1, 2, 4\}"):
        plan_splits(nn.Sequential(nn.MultiheadAttention(DIM, HEADS)), 3)


class _Encoder(nn.Module):
    """Two of torch's encoder layers, causal; eval mode would take torch's fused path in
    every layer without hooks on it."""

    def __init__(self, bias_kv: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)
        if bias_kv:  # an attention that stays whole
            layer.self_attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True, add_bias_kv=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.encoder(x, mask=causal, is_causal=True)


@pytest.mark.parametrize("bias_kv", [False, True])
def test_every_encoder_layer_pairs_its_feed_forward(bias_kv: bool) -> None:
    """The pair search compares forwards hooked in different places: torch's fused inference
    path, taken only by layers without hooks, must not make them differ."""
    torch.manual_seed(0)
    decided = {
        d.name: d.split for d in plan_splits(_Encoder(bias_kv), 2, example=torch.randn(2, SEQ, DIM))
    }
    for k in range(2):
        assert decided[f"encoder.layers.{k}.linear1"] == "column", decided
        assert decided[f"encoder.layers.{k}.linear2"] == "row", decided
    assert torch.backends.mha.get_fastpath_enabled()  # left as it was


def _copies_into_tp(batch_first: bool) -> int:
    """How many input copies into the tp region one self-attention call makes."""
    from unittest import mock

    from meshsplit.tensor import layers

    torch.manual_seed(0)
    attention = nn.Sequential(nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first))
    ms.tensor.parallelize(attention, torch.distributed.group.WORLD)
    x = torch.randn(2, SEQ, DIM)
    with mock.patch.object(layers, "enter_copy", wraps=layers.enter_copy) as copies:
        attention[0](x, x, x)
    return copies.call_count


def test_self_attention_enters_the_tp_region_once_in_either_layout() -> None:
    """One copy of the shared input: one all-reduce of its gradient, not three."""
    for batch_first in (True, False):
        assert ms.launch(_copies_into_tp, 2, args=(batch_first,)) == [1, 1]
