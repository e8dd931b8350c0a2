"""A layer whose weight the model reads outside the layer's own forward stays whole under tp.

nn.MultiheadAttention hands `out_proj.weight` to a function without calling `out_proj` (a
read inside the attention, which splits whole by heads, not outside it); a model may add
`pos.weight[:T]` to its input (silently wrong when that table was split by vocabulary rows:
rank 1 read rows 32-39 as positions 0-7); DeBERTa-v2 reads its relative position table
whole. Split layers also answer `num_embeddings`, `in_features`, `out_features` and a
convolution's channel counts for the whole layer, as model code reads them. Decisions are
checked in one process, training against one process in one launch of 2 workers (SGD, 3
steps), with what each rank holds: the other layers still split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.tensor import plan_splits

from reference import train_plainly

RTOL, ATOL = 1e-4, 1e-5


class ReadsTable(nn.Module):
    """A position table added as `pos.weight[:T]`, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.pos = nn.Embedding(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.pos.weight[: x.shape[1]]
        return self.head(torch.tanh(h).mean(1))


class ReadsSizes(nn.Module):
    """Reads `num_embeddings` and a row layer's `out_features`; holds a layer it never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.pos = nn.Embedding(8, 64)
        self.unused = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) + self.pos(torch.arange(self.pos.num_embeddings))
        h = torch.tanh(self.mid(h))
        return self.head(h.reshape(-1, x.shape[1], self.mid.out_features).mean(1))


class ReadsChannels(nn.Module):
    """A convolution pair whose channel counts the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(torch.relu(self.conv1(x)))
        assert self.conv1.out_channels == self.conv2.in_channels == 16
        return self.head(h.reshape(h.shape[0], self.conv2.out_channels, -1).mean(2))


class _Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + weight.T


class Parametrized(nn.Module):
    """A Linear whose weight a parametrization computes (A + A^T): split, the rule is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        torch.nn.utils.parametrize.register_parametrization(self.mid, "weight", _Symmetric())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))).mean(1))


class TorchEncoder(nn.Module):
    """torch's own TransformerEncoderLayer: its attention is an nn.MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.inp(x)).mean(1))


def _deberta() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from hf_models import Wrap

    config = transformers.DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, relative_attention=True,
        position_buckets=8, pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return Wrap(transformers.DebertaV2ForSequenceClassification(config))


MODELS = {
    "table": ReadsTable,
    "sizes": ReadsSizes,
    "channels": ReadsChannels,
    "parametrized": Parametrized,
    "torch": TorchEncoder,
    "deberta": _deberta,
}
SPLIT = {  # a layer each model still splits (the split is real)
    "table": "inp.weight",
    "sizes": "mid.weight",
    "channels": "conv1.weight",
    "parametrized": "inp.weight",
    "torch": "layer.linear1.weight",
    "deberta": "m.deberta.encoder.layer.0.intermediate.dense.weight",
}


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if name == "deberta":
        x = torch.randint(0, 64, (24, 8), generator=g)
        y = torch.randint(0, 3, (24,), generator=g)
    elif name == "channels":
        x, y = torch.randn(24, 3, 8, 8, generator=g), torch.randint(0, 10, (24,), generator=g)
    else:
        x, y = torch.randn(24, 8, 16, generator=g), torch.randint(0, 10, (24,), generator=g)
    return list(zip(x.split(8), y.split(8), strict=True))


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def test_layers_read_outside_their_forward_or_never_called_stay_whole() -> None:
    table = {d.name: d for d in plan_splits(ReadsTable(), 2, example=_batches("table")[0][0])}
    assert table["pos"].split == "replicate", table["pos"]
    assert "read outside its own forward" in table["pos"].reason
    encoder = {d.name: d for d in plan_splits(TorchEncoder(), 2, example=torch.randn(4, 8, 16))}
    # nn.MultiheadAttention reads its out_proj's weight in its own forward: inside the layer,
    # which splits by heads as a whole (tests/test_tensor_multihead.py)
    assert encoder["layer.self_attn"].split == "heads"
    assert "layer.self_attn.out_proj" not in encoder
    assert encoder["layer.linear1"].split == "column" and encoder["layer.linear2"].split == "row"
    kept = {d.name: d for d in plan_splits(Parametrized(), 2, example=torch.randn(4, 8, 16))}
    assert kept["mid"].split == "replicate" and "parametrization" in kept["mid"].reason
    sizes = {d.name: d for d in plan_splits(ReadsSizes(), 2, example=torch.randn(4, 8, 16))}
    assert sizes["pos"].split == "vocab"  # called: split, and answers num_embeddings whole


class AsksShapes(nn.Module):
    """Takes dtype and shape from weights (not a read of their values); reads `c` whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.a.weight.dtype).type_as(self.a.weight) + torch.zeros_like(self.b.weight)[0]
        y = self.a(x) + self.b(x)
        return y @ self.c.weight.to(y.dtype)


class ReadsThroughProperties(nn.Module):
    """Reads weights through `.T` (a head tied by hand) and `.data`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(64, 16), nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos.weight.data[: ids.shape[1]]
        return self.mid(h) @ self.emb.weight.T


def test_asking_a_weight_its_dtype_or_shape_is_no_read_of_it() -> None:
    from meshsplit.tensor.reads import outside_reads

    model = AsksShapes()
    layers = {"a": model.a, "b": model.b, "c": model.c}
    assert outside_reads(model, torch.randn(2, 4), layers) == {"c"}
    model = ReadsThroughProperties()
    layers = {"emb": model.emb, "pos": model.pos, "mid": model.mid}
    ids = torch.randint(0, 64, (2, 8))
    assert outside_reads(model, ids, layers) == {"emb", "pos"}  # .T and .data are reads


def _train(names: list[str]) -> dict[str, Any]:
    results = {}
    for name in names:
        engine = ms.parallelize(
            _build(name), ms.Plan(tp=2), optimizer=_sgd, loss_fn=nn.CrossEntropyLoss()
        )
        losses = [engine.train_step(x, y) for x, y in _batches(name)]
        held = {k: tuple(v.shape) for k, v in engine.runner.local_state_dict().items()}
        results[name] = (losses, engine.full_state_dict(), held)
        engine.close()
    return results


@pytest.mark.timeout(600)
def test_models_that_read_weights_directly_train_exactly_under_tp2() -> None:
    names = list(MODELS)
    per_rank = ms.launch(_train, 2, args=(names,), timeout_s=300)
    for name in names:
        model = _build(name)
        whole = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        losses, _ = train_plainly(
            model, _sgd(model.parameters()), nn.functional.cross_entropy, _batches(name)
        )
        for rank, results in enumerate(per_rank):
            got_losses, state, held = results[name]
            where = f"{name} rank {rank}"
            torch.testing.assert_close(
                torch.tensor(got_losses), torch.tensor(losses), rtol=RTOL, atol=ATOL, msg=where
            )
            for key, value in model.state_dict().items():
                torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=where)
            split = SPLIT[name]
            assert held[split] != whole[split], f"{where}: {split} held whole {held[split]}"
