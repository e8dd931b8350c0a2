"""Layer split inside containers whose own forward loops over their blocks, equal to one process.

x-transformers keeps each layer as a ModuleList of (norms, attention or feed-forward,
residual) that its `AttentionLayers.forward` walks itself: the blocks are never called, so
the cuts follow the traced data flow between them. T5 runs an encoder and a decoder stack, the
encoder's output crossing every cut after it. A stand-in with x-transformers' structure runs
whether the library is installed or not. Two more keep the residual sum outside their blocks
(zipped ModuleLists of norms and nn.MultiheadAttention; a ModuleDict called through
torch.utils.checkpoint): a cut between those blocks would have to carry more than a block's
input, so they are traced instead. One keeps its blocks in a ModuleDict by name, as torchtitan
does. Each is trained 3 SGD steps under pp=2 and pp=4 and
must equal one process, with every rank holding a fair share of the weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import meshsplit as ms
from meshsplit.pipeline.blocks import find_blocks
from meshsplit.pipeline.cuts import Cuts, find_cuts
from meshsplit.pipeline.frontend import layer_graph
from meshsplit.pipeline.profile import LayerCost

from reference import train_plainly

VOCAB, DIM, HEADS, DEPTH, SEQ = 64, 32, 4, 4, 8
RTOL, ATOL = 1e-4, 1e-5
BATCH, STEPS = 8, 3
FAIR = 1.5
"""No rank may hold more than this many times its even share (total / pp) of the weights."""


class Residual(nn.Module):
    """x-transformers' residual: `prepare` hands the stream on, `forward` adds it back."""

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x

    def forward(self, out: torch.Tensor, residual: torch.Tensor, **_: Any) -> torch.Tensor:
        return out + residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention taking its mask and rotary angles as keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.to_out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, rotary: torch.Tensor) -> Any:
        b, n, _ = x.shape
        q, k, v = (
            f(x).view(b, n, HEADS, DIM // HEADS).transpose(1, 2)
            for f in (self.to_q, self.to_k, self.to_v)
        )
        q = q * rotary.cos() + _rotate_half(q) * rotary.sin()
        k = k * rotary.cos() + _rotate_half(k) * rotary.sin()
        scores = (q @ k.transpose(-1, -2)) * (DIM // HEADS) ** -0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, DIM)
        return self.to_out(out), weights  # (output, intermediates), as x-transformers returns


class AttentionLayers(nn.Module):
    """Layers as ModuleLists of (norms, block, residual) that this forward walks itself."""

    def __init__(self, check_length: bool) -> None:
        super().__init__()
        self.check_length = check_length
        self.kinds = ("a", "f") * DEPTH
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    nn.ModuleList([nn.LayerNorm(DIM)]),
                    Attention()
                    if kind == "a"
                    else nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)),
                    Residual(),
                ]
            )
            for kind in self.kinds
        )
        self.final_norm = nn.LayerNorm(DIM)
        half = DIM // HEADS // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(half).float() / half))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.check_length and x.shape[1] > 16:  # fx cannot trace this; torch.export can
            raise ValueError(f"sequence of {x.shape[1]} exceeds 16 positions")
        positions = torch.arange(x.shape[1], device=x.device)
        angles = torch.outer(positions.float(), self.inv_freq)
        rotary = torch.cat((angles, angles), dim=-1)
        causal = positions[:, None] >= positions[None, :]
        for kind, ((pre_norm,), block, residual_fn) in zip(self.kinds, self.layers, strict=True):
            x, inner_residual = residual_fn.prepare(x)
            x = pre_norm(x)
            if kind == "a":
                out, _ = block(x, mask=causal, rotary=rotary)
            else:
                out = block(x)
            x = residual_fn(out, inner_residual, mask=mask)
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    """Embeddings, the attention layers and the logits, as x-transformers wraps them."""

    def __init__(self, check_length: bool = True) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(16, DIM)
        self.attn_layers = AttentionLayers(check_length)
        self.to_logits = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_emb(ids) + self.pos_emb(positions)
        return self.to_logits(self.attn_layers(x))


class OutsideResidual(nn.Module):
    """Blocks that return only what they add: the forward keeps the running sum
    (`h = h + attn(norm(h))`) over two ModuleLists it zips, so no cut between the blocks
    carries the whole state as a block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.RMSNorm(DIM) for _ in range(DEPTH))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(DIM, HEADS, batch_first=True) for _ in range(DEPTH)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
        for norm, attn in zip(self.norms, self.attns, strict=True):
            y = norm(h)
            h = h + attn(y, y, y, attn_mask=causal, need_weights=False)[0]
        return self.head(h)


class Checkpointed(nn.Module):
    """A ModuleDict of feed-forward blocks called through torch.utils.checkpoint, the sum
    kept outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict(
            {
                f"b{k}": nn.Sequential(
                    nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)
                )
                for k in range(DEPTH)
            }
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks.values():
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.head(h)


class ResidualBlock(nn.Module):
    """x + w2(silu(w1(norm(x)))): a block that keeps its own residual, its layers attributes
    of its own (no list inside), as torchtitan's do."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, _ = x.shape
        return x + self.w2(F.silu(self.w1(self.norm(x)))).view(rows, length, DIM)


class BlocksByName(nn.Module):
    """torchtitan's layout: the blocks in a ModuleDict keyed by layer number, walked by
    `.values()` (a tracer sees the dict as one layer: before, pp=2 put 98% of the weights on
    the first stage and pp=4 one rank held all the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(k): ResidualBlock() for k in range(DEPTH)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _x_transformers() -> nn.Module:
    from x_transformers import Decoder
    from x_transformers import TransformerWrapper as Library

    return Library(
        num_tokens=VOCAB, max_seq_len=16, attn_layers=Decoder(dim=DIM, depth=DEPTH, heads=HEADS)
    )


def _t5() -> nn.Module:
    from hf_models import MORE

    return MORE["t5"]()


MODELS = {
    "stand-in": TransformerWrapper,
    "x-transformers": _x_transformers,
    "t5": _t5,
    "outside-residual": OutsideResidual,
    "checkpointed": Checkpointed,
    "blocks-by-name": BlocksByName,
}
SOURCES = {
    "t5": "blocks",
    "outside-residual": "export",
    "checkpointed": "fx",
    "blocks-by-name": "blocks",
}
"""How each is cut: between its blocks, or traced (by torch.export where fx cannot)."""
LIBRARIES = {"x-transformers": "x_transformers", "t5": "transformers"}
INSTALLED = [
    name
    for name in MODELS
    if name not in LIBRARIES or importlib.util.find_spec(LIBRARIES[name]) is not None
]
"""The models this machine can build: the stand-in always, the others with their library."""


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _example() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(3))


def _shares(cuts: Cuts, model: nn.Module) -> list[float]:
    """Each stage's share of the model's parameters (a tied weight counts on every holder)."""
    whole = sum(p.numel() for p in model.parameters())
    shares = []
    for stage in range(len(cuts.sizes)):
        held = {id(p): p for p in cuts.stage_module(stage).parameters()}
        shares.append(sum(p.numel() for p in held.values()) / whole)
    return shares


def test_blocks_that_are_never_called_are_refused_by_the_block_front_end() -> None:
    with pytest.raises(ms.PlanError, match=r"'attn_layers.layers.0'.*never called themselves"):
        find_blocks(TransformerWrapper(), _example())
    with pytest.raises(ms.PlanError, match="leave Plan.split_points unset"):
        find_cuts(
            TransformerWrapper(),
            _example(),
            ms.Plan(pp=2, split_points=("attn_layers.layers.4",)),
            agree=list,
        )


@pytest.mark.parametrize("check_length", [True, False], ids=["export", "fx"])
def test_the_traced_front_end_cuts_between_the_blocks_inside_the_container(
    check_length: bool,
) -> None:
    model, x = TransformerWrapper(check_length).eval(), _example()
    graph = layer_graph(model, x)
    # fx would keep the untraceable container whole: torch.export traces into it instead
    assert graph.source == ("export" if check_length else "fx")
    names = [layer.name for layer in graph.layers]
    blocks = [f"attn_layers.layers.{k}" for k in range(2 * DEPTH)]
    assert names == ["token_emb", "pos_emb", *blocks, "attn_layers.final_norm", "to_logits"]
    values = {graph.input: x}
    for layer in graph.layers:
        values.update(zip(layer.outputs, layer(*(values[n] for n in layer.inputs)), strict=True))
    with torch.no_grad():
        torch.testing.assert_close(values[graph.output], model(x))
    # the rotary angles and the mask, made before the loop, go straight to every attention block
    before_loop = set(graph.layers[names.index("pos_emb")].outputs)
    for k in range(2, 2 * DEPTH, 2):  # (the first also reads the stream from there)
        attention = graph.layers[names.index(f"attn_layers.layers.{k}")]
        assert len(before_loop & set(attention.inputs)) == 2


def _by_weight(costs: list[LayerCost]) -> list[LayerCost]:
    """Each layer's profiled time replaced by one that follows its weights: between two
    near-even cuts the balancer then takes the same one on every run, where the measured
    times of layers this small move with what ran before (what is tested is that the cuts
    fall between the container's layers, not this machine's timing)."""
    return [
        replace(
            c, forward_ms=1e-3 * (1 + c.parameter_bytes), backward_ms=2e-3 * (1 + c.parameter_bytes)
        )
        for c in costs
    ]


@pytest.mark.parametrize("name", INSTALLED)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_stage_holds_a_fair_share(name: str, pp: int) -> None:
    model = _build(name)
    cuts = find_cuts(model, _example(), ms.Plan(pp=pp), agree=_by_weight)
    shares = _shares(cuts, model)
    assert max(shares) <= FAIR / pp, f"{name} pp={pp} {cuts.source}: shares {shares}"
    assert cuts.source.startswith(SOURCES.get(name, "export"))


def test_x_transformers_is_cut_between_its_layers() -> None:
    pytest.importorskip("x_transformers")
    model = _build("x-transformers")
    cuts = find_cuts(model, _example(), ms.Plan(pp=4), agree=list)
    assert sum(name.startswith("attn_layers.layers.") for name in cuts.names) == 2 * DEPTH


def test_t5_stage_between_two_cuts_in_the_decoder_sends_the_encoder_output_on() -> None:
    """The middle stage's next piece is called with the encoder output it received."""
    pytest.importorskip("transformers")
    split = ("m.encoder.block.1", "m.decoder.block.0", "m.decoder.block.1")
    cuts = find_cuts(_build("t5"), _example(), ms.Plan(pp=4, split_points=split), agree=list)
    assert cuts.sizes == (2, 3, 1, 3)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _single(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _build(name)
    return train_plainly(model, _sgd(model.parameters()), ms.models.TokenCrossEntropy(), _batches())


def _parallel(names: list[str], plan: ms.Plan) -> list[dict[str, Any]]:
    results = []
    for name in names:
        engine = ms.parallelize(
            _build(name), plan, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy()
        )
        losses = [engine.train_step(x, y) for x, y in _batches()]
        results.append(
            {
                "losses": losses,
                "state": engine.full_state_dict(),
                "held": engine.memory_report().parameter_bytes,
            }
        )
        engine.close()
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [2, 4])
def test_containers_match_one_process_with_a_fair_share_on_every_rank(pp: int) -> None:
    plan = ms.Plan(pp=pp, micro_batches=2)
    per_rank = ms.launch(_parallel, pp, args=(INSTALLED, plan), timeout_s=300)
    _check(per_rank, INSTALLED, fair=FAIR / pp)


def _check(per_rank: list[list[dict[str, Any]]], names: list[str], fair: float) -> None:
    """Every rank's losses and parameters equal one process's; each holds at most `fair` of
    the weights."""
    for index, name in enumerate(names):
        want_losses, want_state = _single(name)
        whole = sum(p.numel() * p.element_size() for p in _build(name).parameters())
        for rank, results in enumerate(per_rank):
            got, where = results[index], f"{name} rank {rank}"
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL,
                msg=lambda m, where=where: f"{where} losses: {m}",
            )  # fmt: skip
            assert got["state"].keys() == want_state.keys(), f"{where}: state keys differ"
            for key, value in want_state.items():
                torch.testing.assert_close(
                    got["state"][key], value, rtol=RTOL, atol=ATOL,
                    msg=lambda m, where=where, key=key: f"{where} {key}: {m}",
                )  # fmt: skip
            share = got["held"] / whole
            assert share <= fair, f"{where} holds {share:.0%} of the weights"


@pytest.mark.timeout(600)
def test_containers_match_one_process_under_pp2_x_tp2_with_a_fair_share_on_every_rank() -> None:
    """The layer split traces the tp-split model, whose collectives torch.export keeps as
    operators with their backward (tensor/exportable.py): before, it inlined them without
    it, the models traced only by export were refused, and those with blocks kept their
    uneven block cuts (the outside-residual one's first stage held 0.46 on each rank)."""
    plan = ms.Plan(pp=2, tp=2, micro_batches=2)
    per_rank = ms.launch(_parallel, 4, args=(INSTALLED, plan), timeout_s=300)
    _check(per_rank, INSTALLED, fair=FAIR / 4)
