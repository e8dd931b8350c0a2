"""The block front end, without processes: pieces found in nested models, cuts checked.

Each model is cut in one process and its stages chained by hand: the chain must give the
model's own output, and a cut whose stages cannot chain must be refused with its name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.pipeline.blocks import find_blocks, has_nested_blocks, sizes_at
from meshsplit.pipeline.cuts import find_cuts
from meshsplit.pipeline.spine import Spine, check_chain, cut_positions

transformers = pytest.importorskip("transformers")

from hf_models import FACTORIES  # noqa: E402
from reference import LoopsOverBlocks  # noqa: E402


def _example(name: str) -> torch.Tensor:
    if name == "resnet":
        return torch.randn(4, 3, 32, 32)
    return torch.randint(0, 64, (4, 8))


PIECES = {
    "gpt2": ("m.transformer.h", ["m.transformer.wte", "m.transformer.wpe", "m.transformer.h.0"]),
    "llama": ("m.model.layers", ["m.model.embed_tokens", "m.model.layers.0"]),
    "bert": ("m.bert.encoder.layer", ["m.bert.embeddings", "m.bert.encoder.layer.0"]),
    "resnet": ("m.resnet.encoder.stages", ["m.resnet.embedder", "m.resnet.encoder.stages.0"]),
}
LAST = {"gpt2": "m.lm_head", "llama": "m.lm_head", "bert": "m.classifier", "resnet": "m.classifier"}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_blocks_of_hugging_face_models_are_found_in_call_order(name: str) -> None:
    torch.manual_seed(0)
    model = FACTORIES[name]()
    assert has_nested_blocks(model)
    blocks = find_blocks(model, _example(name))
    lists, first = PIECES[name]
    names = [piece.name for piece in blocks.pieces]
    assert blocks.lists == (lists,)
    assert names[: len(first)] == first and names[-1] == LAST[name]
    assert sum(name.startswith(lists + ".") for name in names) == 4
    assert all(piece.forward_ms > 0 and piece.parameter_bytes > 0 for piece in blocks.pieces)


@pytest.mark.parametrize("name", sorted(PIECES))
def test_stages_chained_in_one_process_give_the_models_output(name: str) -> None:
    torch.manual_seed(0)
    model, x = FACTORIES[name]().eval(), _example(name)
    blocks = find_blocks(model, x)
    spine = Spine(model, blocks.pieces)
    cuts = cut_positions(spine, x)
    # GPT-2 adds its token and position embeddings after calling both: no cut between them
    assert (1 not in cuts) == (name == "gpt2")
    with torch.no_grad():
        want = model(x)
        for starts in (cuts[:1], cuts[:3]):
            bounds = [0, *starts, len(blocks.pieces)]
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            check_chain(spine, sizes, x)  # raises on a mismatch
            values: tuple = ()
            start = 0
            for size in sizes:
                values = spine.run(start, start + size, x, [t for t in values])
                start += size
            torch.testing.assert_close(values[0], want)
        assert torch.equal(model(x), want)  # outside a stage the pieces run as before


class ReusesEmbedding(nn.Module):
    """The head reads the embedding output directly, past every block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        x = e
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x + e)


def test_a_cut_the_forward_reads_across_is_refused_with_its_name() -> None:
    torch.manual_seed(0)
    model, x = ReusesEmbedding(), torch.randint(0, 16, (4, 5))
    blocks = find_blocks(model, x)
    spine = Spine(model, blocks.pieces)
    with pytest.raises(ms.PlanError, match=r"cutting ReusesEmbedding before \['blocks.1'\]"):
        check_chain(spine, sizes_at(blocks.pieces, ["blocks.1"]), x)


def test_split_points_name_pieces_or_are_refused_with_the_choices() -> None:
    torch.manual_seed(0)
    blocks = find_blocks(FACTORIES["llama"](), _example("llama"))
    assert sizes_at(blocks.pieces, ["m.model.layers.2"]) == (3, 4)
    assert sizes_at(blocks.pieces, ["m.model.layers.1", "m.model.layers.3"]) == (2, 2, 3)
    with pytest.raises(ms.PlanError, match=r"names \['m.model.layer.2'\].*m.model.embed_tokens"):
        sizes_at(blocks.pieces, ["m.model.layer.2"])
    with pytest.raises(ms.PlanError, match="distinct pieces after the first"):
        sizes_at(blocks.pieces, ["m.model.embed_tokens"])
    with pytest.raises(ms.PlanError, match="must name pp-1 = 1 module paths"):
        ms.Plan(pp=2, split_points=("a", "b"))


def test_a_loop_over_pieces_stays_on_one_stage() -> None:
    """No cut falls inside the loop; cuts around it chain to the model's output, and a piece
    the loop calls twice costs both calls."""
    torch.manual_seed(0)
    model, x = LoopsOverBlocks().eval(), torch.randint(0, 16, (4, 5))
    blocks = find_blocks(model, x)
    assert [p.name for p in blocks.pieces] == [
        "emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"
    ]  # fmt: skip
    spine = Spine(model, blocks.pieces)
    assert cut_positions(spine, x) == [1, 2, 4, 5]  # never before blocks.2
    check_chain(spine, (2, 2, 2), x)
    with pytest.raises(ms.PlanError, match=r"before \['blocks.2'\]"):
        check_chain(spine, (3, 3), x)
    with torch.no_grad():
        assert torch.equal(model(x), LoopsOverBlocks.forward(model, x))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_stages_take_batches_of_other_shapes_than_the_example(name: str) -> None:
    """Placeholders keep the example's shapes, yet what crosses comes from the real stage."""
    torch.manual_seed(0)
    model = FACTORIES[name]().eval()
    blocks = find_blocks(model, _example(name))
    spine = Spine(model, blocks.pieces)
    other = torch.randint(0, 64, (3, 5))  # 3 rows of 5 tokens instead of 4 of 8
    with torch.no_grad():
        received = spine.run(0, 3, other, [])
        got = spine.run(3, len(blocks.pieces), other, list(received))[0]
        torch.testing.assert_close(got, model(other))


def test_only_cuts_that_keep_the_output_are_taken() -> None:
    """Before the head is the one place: the head is called with x + e, made before the cut."""
    torch.manual_seed(0)
    cuts = find_cuts(ReusesEmbedding(), torch.randint(0, 16, (4, 5)), ms.Plan(pp=2), agree=list)
    assert cuts.source.startswith("blocks") and cuts.sizes == (4, 1)


class AddsEmbeddingAfterTheHead(ReusesEmbedding):
    """No cut keeps the output: the embeddings are read after every piece."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        x = e
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) + e.sum(-1, keepdim=True)


def test_a_model_whose_blocks_cannot_be_cut_falls_back_to_the_traced_front_end() -> None:
    """fx sends the embeddings straight to the stage that reads them; the blocks stay apart."""
    torch.manual_seed(0)
    model = AddsEmbeddingAfterTheHead()
    cuts = find_cuts(model, torch.randint(0, 16, (4, 5)), ms.Plan(pp=2), agree=list)
    assert cuts.source == "fx"
    assert cuts.names == ("emb", "blocks.0", "blocks.1", "blocks.2", "head")


class DropsLayers(LoopsOverBlocks):
    """LayerDrop (Hugging Face's M2M100, Whisper, wav2vec 2.0, ...): blocks skipped at random
    while training, as the module's `layerdrop` rate says."""

    def __init__(self) -> None:
        super().__init__()
        self.layerdrop = 0.05


def test_a_model_that_drops_layers_at_random_is_refused_with_the_setting_to_change() -> None:
    x = torch.randint(0, 16, (4, 5))
    with pytest.raises(ms.PlanError, match=r"layerdrop=0.05.*set it to 0"):
        find_cuts(DropsLayers(), x, ms.Plan(pp=2), agree=list)
    model = DropsLayers()
    model.layerdrop = 0.0
    assert find_cuts(model, x, ms.Plan(pp=2), agree=list).source.startswith("blocks")


class PadsWithItsEmbedding(nn.Module):
    """Embeds its padding with a second call of the embedding, in another shape (Hugging
    Face's LED pads its input to the attention window so), then adds positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.pos = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        padding = self.emb(ids.new_zeros(ids.shape[0], 3))
        x = torch.cat([self.emb(ids), padding], 1) + self.pos(torch.arange(length + 3))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x[:, :length])


def test_a_piece_called_in_two_shapes_stands_in_with_each_calls_shape() -> None:
    """A later stage's stand-ins for the embedding take each call's shape: one taken from
    the first call would not concatenate to the positions' length."""
    torch.manual_seed(0)
    model, x = PadsWithItsEmbedding().eval(), torch.randint(0, 16, (4, 5))
    blocks = find_blocks(model, x)
    assert [p.name for p in blocks.pieces] == ["emb", "pos", "blocks.0", "blocks.1", "head"]
    spine = Spine(model, blocks.pieces)
    assert cut_positions(spine, x) == [2, 3, 4]
    check_chain(spine, (2, 3), x)
