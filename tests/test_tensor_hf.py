"""Operator split on real Hugging Face layers: GPT-2 (Conv1D, fused qkv, tied head), LLaMA
(grouped-query attention, the model's own tp plan), BERT (pairs across sibling modules; its
masked-LM head's bias held under two names), T5 and M2M100 (one weight tied four ways), and
what is kept whole (own forward, HF ResNet's small convolutions).

Decisions are checked in one process; exactness, bytes per rank, un-sharding and the forward
all-reduces per block in one launch of 2 gloo workers.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import meshsplit as ms  # noqa: E402
from meshsplit import tensor  # noqa: E402
from meshsplit.gather import ALL_GATHER  # noqa: E402
from meshsplit.mesh import Mesh  # noqa: E402
from meshsplit.tensor import Decision, plan_splits  # noqa: E402
from meshsplit.tensor.shards import local_shard, shard_layouts  # noqa: E402

import hf_models  # noqa: E402
from reference import HeadNormAttention  # noqa: E402

TP = 2
STEPS = 3
BLOCKS = {"gpt2": "m.transformer.h", "llama": "m.model.layers", "bert": "m.bert.encoder.layer"}
TIES = {
    "gpt2": ["m.transformer.wte", "m.lm_head"],
    "bert_mlm": ["m.bert.embeddings.word_embeddings", "m.cls.predictions.decoder"],
    "roberta_mlm": ["m.roberta.embeddings.word_embeddings", "m.lm_head.decoder"],
    "albert_mlm": ["m.albert.embeddings.word_embeddings", "m.predictions.decoder"],
    "t5": ["m.shared", "m.encoder.embed_tokens", "m.decoder.embed_tokens", "m.lm_head"],
    "m2m100": [
        "m.model.shared",
        "m.model.encoder.embed_tokens",
        "m.model.decoder.embed_tokens",
        "m.lm_head",
    ],
}
"""Layers sharing one weight: after the split, one vocabulary shard on each rank."""
ALIASES = {
    "bert_mlm": ["m.cls.predictions", "m.cls.predictions.decoder"],
    "roberta_mlm": ["m.lm_head", "m.lm_head.decoder"],
    "albert_mlm": ["m.predictions", "m.predictions.decoder"],
}
"""Modules holding one bias under two names (the masked-LM head and its decoder)."""


def _decisions(name: str, tp: int, **kwargs: Any) -> dict[str, tensor.Decision]:
    model, x = hf_models.build(name)
    return {d.name: d for d in plan_splits(model, tp, example=x, **kwargs)}


def test_gpt2_splits_conv1d_pairs_fused_qkv_and_the_tied_head() -> None:
    d = _decisions("gpt2", TP)
    attn = "m.transformer.h.0.attn"
    assert (d[f"{attn}.c_attn"].split, d[f"{attn}.c_attn"].parts) == ("column", 3)
    assert not d[f"{attn}.c_attn"].gather_output
    assert d[f"{attn}.c_proj"].split == "row" and not d[f"{attn}.c_proj"].scatter_input
    assert set(d[f"{attn}.c_proj"].per_rank) == {
        (f"{attn}.split_size", TP),
        (f"{attn}.num_heads", TP),
    }
    assert d["m.transformer.h.0.mlp.c_fc"].split == "column"
    assert d["m.transformer.h.0.mlp.c_proj"].split == "row"
    assert (d["m.transformer.wte"].split, d["m.transformer.wte"].tied) == ("vocab", "m.lm_head")
    head = d["m.lm_head"]
    assert (head.split, head.gather_output, head.tied) == ("column", True, "m.transformer.wte")


def test_a_plan_that_splits_a_tie_apart_is_refused() -> None:
    """One weight cannot be a vocabulary shard in the embeddings and whole in the head."""
    plan = {"m.shared": "vocab", "m.lm_head": "replicate"}
    with pytest.raises(
        ms.PlanError, match="share one weight differently.*'m.lm_head': 'replicate'"
    ):
        _decisions("t5", TP, tp_plan=plan)
    d = _decisions("t5", TP, tp_plan={"m.shared": "vocab"})  # the rest of the tie follows
    assert [d[layer].split for layer in TIES["t5"]] == ["vocab", "vocab", "vocab", "column"]


def test_llama_takes_its_own_plan_and_splits_kv_heads_at_tp2() -> None:
    d = _decisions("llama", 2)
    layer = "m.model.layers.1"
    for name in ("q_proj", "k_proj", "v_proj"):
        assert d[f"{layer}.self_attn.{name}"].split == "column"
        assert "model's tp plan" in d[f"{layer}.self_attn.{name}"].reason
    assert d[f"{layer}.self_attn.o_proj"].split == "row"
    assert d[f"{layer}.mlp.down_proj"].split == "row"
    assert d["m.model.embed_tokens"].split == "vocab"
    assert d["m.lm_head"].split == "column" and d["m.lm_head"].gather_output


def _shares_kv_heads(d: dict[str, Decision], attention: str) -> None:
    """Two kv heads at tp=4: the query heads and o split, k and v whole, their heads shared by
    two ranks each and their gradients summed over tp; each rank's head counts follow."""
    assert d[f"{attention}.q_proj"].split == "column" and not d[f"{attention}.q_proj"].shared
    for name in ("k_proj", "v_proj"):
        decision = d[f"{attention}.{name}"]
        assert decision.split == "column" and decision.shared == 2, decision
        assert decision.summed == (f"{attention}.{name}.weight",), decision
        assert "2 kv heads are shared" in decision.reason
    assert d[f"{attention}.o_proj"].split == "row"
    assert set(d[f"{attention}.o_proj"].per_rank) == {(f"{attention}.num_key_value_groups", 2)}


def test_llama_at_tp4_shares_its_two_kv_heads_between_pairs_of_ranks() -> None:
    d = _decisions("llama", 4)
    _shares_kv_heads(d, "m.model.layers.0.self_attn")
    assert d["m.model.layers.0.self_attn.q_proj"].reason.startswith("data flow")  # not its plan
    assert d["m.model.layers.0.mlp.gate_proj"].split == "column"


def test_data_flow_finds_the_same_llama_pairs_without_the_models_plan() -> None:
    model, x = hf_models.build("llama")
    for module in model.modules():
        if hasattr(module, "_tp_plan"):
            module._tp_plan = {}
    d = {x.name: x for x in plan_splits(model, 2, example=x)}
    assert d["m.model.layers.0.self_attn.k_proj"].split == "column"
    assert d["m.model.layers.0.self_attn.o_proj"].split == "row"
    assert d["m.model.layers.0.mlp.down_proj"].reason.startswith("data flow")
    _shares_kv_heads(
        {x.name: x for x in plan_splits(model, 4, example=x)}, "m.model.layers.0.self_attn"
    )


def test_bert_pairs_across_sibling_modules() -> None:
    d = _decisions("bert", TP)
    layer = "m.bert.encoder.layer.2"
    for name in ("query", "key", "value"):
        assert d[f"{layer}.attention.self.{name}"].split == "column"
    assert d[f"{layer}.attention.output.dense"].split == "row"
    assert d[f"{layer}.intermediate.dense"].split == "column"
    assert d[f"{layer}.output.dense"].split == "row"
    assert d[f"{layer}.output.LayerNorm"].split == "replicate"


def test_without_an_example_hf_layers_split_alone() -> None:
    model, _ = hf_models.build("bert")
    d = {x.name: x for x in plan_splits(model, TP)}
    assert d["m.bert.encoder.layer.0.attention.output.dense"].gather_output


def test_hf_resnet_splits_large_convolutions_alone_and_keeps_norms() -> None:
    d = _decisions("resnet", TP)
    assert d["m.resnet.embedder.embedder.convolution"].split == "column"
    assert d["m.resnet.embedder.embedder.normalization"].split == "replicate"
    small = d["m.resnet.encoder.stages.0.layers.0.layer.0.convolution"]
    assert small.split == "replicate" and "small" in small.reason


class LearnedPositions(nn.Embedding):
    """OPT's learned positional embedding: takes extra arguments and offsets its indices."""

    def forward(self, ids: torch.Tensor, offset: int = 2) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids + offset)


def test_a_subclass_with_its_own_forward_is_kept_whole() -> None:
    model = nn.Sequential(LearnedPositions(130, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    d = {x.name: x for x in plan_splits(model, TP)}
    assert d["0"].split == "replicate"
    assert d["0"].reason == "own forward: LearnedPositions kept whole"
    assert (d["1"].split, d["3"].split) == ("column", "row")


class SpelledOut(nn.Linear):
    """Falcon's FalconLinear: Linear's own computation, written out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class Shifted(nn.Linear):
    """A forward that adds something of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


class InPlaceSum(nn.Module):
    """Falcon's parallel block: the MLP's output is added to in place after its row layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.side = SpelledOut(16, 64), SpelledOut(64, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.relu(self.up(x)))
        out += self.side(x)
        return out


def test_a_plan_that_keeps_every_layer_whole_says_why_each_is() -> None:
    with pytest.raises(ms.PlanError, match="Sequential: 0: own forward: Shifted kept whole;"):
        plan_splits(nn.Sequential(Shifted(16, 32), nn.ReLU()), TP)


def test_a_subclass_that_only_spells_out_the_base_is_split() -> None:
    model = nn.Sequential(InPlaceSum(), Shifted(16, 32), nn.ReLU(), nn.Linear(32, 4))
    d = {x.name: x for x in plan_splits(model, TP, example=torch.randn(4, 16))}
    assert (d["0.up"].split, d["0.down"].split) == ("column", "row"), d["0.down"].reason
    assert d["1"].split == "replicate"
    assert d["1"].reason == "own forward: Shifted kept whole"


def _spelled_out_on_meta() -> dict[str, Any]:
    """tp=2 of a model built on the meta device whose layers spell out Linear's forward."""
    with torch.device("meta"):
        model = nn.Sequential(SpelledOut(16, 64), nn.ReLU(), SpelledOut(64, 8))
    x, y = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 8)
    engine = ms.parallelize(
        model,
        ms.Plan(tp=TP),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=F.mse_loss,
        example_inputs=x,
    )
    start = engine.full_state_dict()
    held = sum(p.numel() for p in engine.module.parameters())
    splits = [(d["split"], d["reason"]) for d in engine.describe()["operator_split"]]
    loss = engine.train_step(x, y)
    return {"start": start, "loss": loss, "x": x, "held": held, "splits": splits}


def test_a_meta_subclass_that_only_spells_out_the_base_is_split() -> None:
    with torch.device("meta"):
        plain, shifted = SpelledOut(16, 64), Shifted(16, 32)
    assert (tensor.units.own_forward(plain), tensor.units.own_forward(shifted)) == (None, "Shifted")
    first, second = ms.launch(_spelled_out_on_meta, TP, timeout_s=300)
    whole = 16 * 64 + 64 + 64 * 8 + 8
    assert first["splits"] == [
        ("column", "data flow: pairs with '2'"),
        ("row", "data flow: pairs with '0': one all-reduce"),
    ]
    assert first["held"] == second["held"] == (whole - 8) // TP + 8  # the row's bias whole
    model = nn.Sequential(SpelledOut(16, 64), nn.ReLU(), SpelledOut(64, 8))
    model.load_state_dict(first["start"])
    assert sum(p.numel() for p in model.parameters()) == whole
    expected = F.mse_loss(model(first["x"]), torch.zeros(4, 8)).item()
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_whole_layer_reading_a_pairs_split_values_has_its_gradients_summed() -> None:
    model = nn.Sequential(nn.LayerNorm(16), HeadNormAttention(), nn.Linear(16, 64), nn.ReLU())
    d = {x.name: x for x in plan_splits(model, TP, example=torch.randn(2, 3, 16))}
    assert (d["1.q"].split, d["1.o"].split) == ("column", "row")
    assert d["1.q_norm"].summed == ("1.q_norm.weight", "1.q_norm.bias")
    assert "inside the pair of '1.o' on split values" in d["1.q_norm"].reason
    assert d["0"].split == "replicate" and not d["0"].summed  # before the pair: whole values


class HeadNormTwice(HeadNormAttention):
    """The per-head norm also run on the whole input: a use outside the pair."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outside = self.q_norm(x.unflatten(-1, (-1, 4))).flatten(-2)
        return super().forward(x) + outside


def test_a_pair_around_a_whole_layer_that_also_runs_elsewhere_stays_whole() -> None:
    model = nn.Sequential(HeadNormTwice(), nn.Linear(16, 64), nn.ReLU())
    d = {x.name: x for x in plan_splits(model, TP, example=torch.randn(2, 3, 16))}
    assert (d["0.q"].split, d["0.o"].split) == ("replicate", "replicate")
    assert "0.q_norm (kept whole) read their split values and run again" in d["0.o"].reason
    assert not d["0.q_norm"].summed


class SharedRotaryKey(nn.Module):
    """DeepSeek's attention in small: a key part made outside q and o, read by every head."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.q(x).unflatten(-1, (-1, 4)) + x[..., :4].unsqueeze(-2)
        return self.o(heads.flatten(-2))


def test_a_pair_read_by_a_value_made_outside_it_stays_whole() -> None:
    model = nn.Sequential(nn.LayerNorm(16), SharedRotaryKey(), nn.Linear(16, 64), nn.ReLU())
    d = {x.name: x for x in plan_splits(model, TP, example=torch.randn(2, 3, 16))}
    assert (d["1.q"].split, d["1.o"].split) == ("replicate", "replicate")
    assert "made before its columns ran, is read between them" in d["1.o"].reason
    assert d["2"].split == "column"  # a layer after the pair splits as before


def test_a_user_plan_overrides_the_models_plan() -> None:
    down = "m.model.layers.0.mlp.down_proj"
    d = _decisions("llama", TP, tp_plan={down: "replicate"})
    assert (d[down].split, d[down].reason) == ("replicate", "user plan")
    gate = d["m.model.layers.0.mlp.gate_proj"]
    assert gate.split == "column" and gate.gather_output  # its row partner is gone
    assert "model's plan not taken" in gate.reason
    assert d["m.model.layers.1.mlp.down_proj"].split == "row"


def test_local_shard_takes_block_r_of_each_fused_part() -> None:
    full = torch.arange(12)
    assert local_shard(full, 0, 3, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    assert local_shard(full, 0, 1, 0, 2).tolist() == list(range(6))


@contextmanager
def _all_reduces(group: dist.ProcessGroup) -> Iterator[Counter[str]]:
    """Count all_reduce and flat all-gather calls on `group`."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", ALL_GATHER)}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is group:
                counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _per_block(model: nn.Module, blocks: str, group: dist.ProcessGroup, x: torch.Tensor) -> list:
    """Forward all-reduces inside each block during one forward."""
    seen: list[int] = []
    with _all_reduces(group) as counts:
        starts: dict[int, int] = {}
        handles = []
        for index, block in enumerate(model.get_submodule(blocks)):
            handles.append(
                block.register_forward_pre_hook(
                    lambda _m, _a, i=index: starts.__setitem__(i, counts["all_reduce"])
                )
            )
            handles.append(
                block.register_forward_hook(
                    lambda _m, _a, _o, i=index: seen.append(counts["all_reduce"] - starts[i])
                )
            )
        with torch.no_grad():
            model(x)
        for handle in handles:
            handle.remove()
    return seen


def _train(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """3 SGD steps; the first output and the last gradients, by parameter name."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(x)
        first = logits.detach() if first is None else first
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
        optimizer.step()
    grads = {f"grad/{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"output": first, **grads}


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check(name: str, group: dist.ProcessGroup) -> dict[str, Any]:
    model, x = hf_models.build(name)
    reference = copy.deepcopy(model)
    shape = (x.shape[0],) if name == "bert" else tuple(x.shape)
    classes = 3 if name == "bert" else hf_models.VOCAB
    target = torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(5))
    tensor.parallelize(model, group, example=x)
    layouts = shard_layouts(model)
    full = dict(reference.named_parameters())
    split_params = {n: p for n, p in model.named_parameters() if n in layouts}
    result: dict[str, Any] = {
        "local_bytes": _bytes(split_params.values()),
        "full_bytes": _bytes(full[n] for n in split_params),
        "tied": [model.get_submodule(layer).weight for layer in TIES.get(name, [])],
        "alias": [model.get_submodule(owner).bias for owner in ALIASES.get(name, [])],
    }
    if name in ("gpt2", "llama"):
        result["per_block"] = _per_block(model, BLOCKS[name], group, x)
        logits = model(x)
        with _all_reduces(group) as counts:
            logits.float().pow(2).mean().backward()
        result["backward"] = counts["all_reduce"]
        model.zero_grad()
    trained = _train(model, x, target)
    grads = {k.removeprefix("grad/"): v for k, v in trained.items() if k.startswith("grad/")}
    result["grads"] = tensor.unshard_state_dict(model, grads, group)
    result["output"] = trained["output"]
    result["state"] = tensor.unshard_state_dict(model, model.state_dict(), group)
    result["expected"] = _train(reference, x, target)
    result["expected_state"] = reference.state_dict()
    return result


def _check_all(names: list[str]) -> dict[str, dict[str, Any]]:
    group = Mesh.build(ms.Plan(tp=TP)).group("tp")
    results = {name: _check(name, group) for name in names}
    dist.barrier()
    return results


NAMES = ["gpt2", "llama", "bert", "t5", "m2m100", "bert_mlm", "roberta_mlm", "albert_mlm"]


@functools.cache
def _results() -> list[dict[str, dict[str, Any]]]:
    return ms.launch(_check_all, TP, args=(NAMES,))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_split_hf_model_trains_like_the_unsplit_one(name: str) -> None:
    for rank in _results():
        result = rank[name]
        expected = result["expected"]
        _close(result["output"], expected["output"])
        for key, grad in result["grads"].items():
            _close(grad, expected[f"grad/{key}"])
        assert result["grads"].keys() == {k[5:] for k in expected if k.startswith("grad/")}


@pytest.mark.parametrize("name", NAMES)
def test_unshard_gives_the_original_keys_shapes_and_values(name: str) -> None:
    result = _results()[0][name]
    assert list(result["state"]) == list(result["expected_state"])
    for key, value in result["state"].items():
        assert value.shape == result["expected_state"][key].shape, key
        _close(value, result["expected_state"][key])


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_a_tp_th_of_the_split_layers(name: str) -> None:
    for rank in _results():
        assert rank[name]["local_bytes"] * TP == rank[name]["full_bytes"] > 0


@pytest.mark.parametrize("name", sorted(TIES))
def test_tied_layers_share_one_vocabulary_shard(name: str) -> None:
    """GPT-2's two tied layers, and the four of T5 and M2M100 (shared, the encoder's and the
    decoder's embeddings, the head), hold one weight of VOCAB / tp rows on each rank."""
    for rank in _results():
        first, *others = rank[name]["tied"]
        assert first.shape[0] * TP == hf_models.VOCAB
        assert all(other is first for other in others)


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_an_alias_of_a_split_bias_holds_the_same_shard(name: str) -> None:
    """BERT's `cls.predictions.bias` (RoBERTa's `lm_head.bias`, ALBERT's) is its decoder's
    bias under another name: after the vocabulary split it is still that tensor, VOCAB / tp
    long (the state dict, un-sharded, matches one process in
    test_unshard_gives_the_original_keys_shapes_and_values)."""
    for rank in _results():
        head, decoder = rank[name]["alias"]
        assert head is decoder and head.shape[0] * TP == hf_models.VOCAB


def test_t5s_cross_attentions_split_together_and_its_self_attentions_stay_whole() -> None:
    # the decoder's first cross-attention makes a zero position bias with its own head count
    # and hands it to the next: split alone, either meets the other's whole count; together
    # they agree (checked one pair at a time, both were refused)
    d = _decisions("t5", TP)
    for block in (0, 1):
        cross = f"m.decoder.block.{block}.layer.1.EncDecAttention"
        assert [d[f"{cross}.{p}"].split for p in "qkvo"] == ["column"] * 3 + ["row"]
        assert d[f"{cross}.o"].per_rank == ((f"{cross}.n_heads", TP),)
        own = f"m.decoder.block.{block}.layer.0.SelfAttention.o"  # relative bias: whole heads
        assert d[own].reason.startswith("data-flow pair not taken"), d[own]


def test_the_tie_of_four_layers_is_decided_together() -> None:
    d = _decisions("t5", TP)
    assert [d[layer].split for layer in TIES["t5"]] == ["vocab", "vocab", "vocab", "column"]
    assert d["m.lm_head"].gather_output
    assert d["m.shared"].tied == "m.encoder.embed_tokens, m.decoder.embed_tokens, m.lm_head"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_each_block_runs_two_forward_all_reduces(name: str) -> None:
    for rank in _results():
        assert rank[name]["per_block"] == [2, 2, 2, 2]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_backward_runs_one_all_reduce_per_region(name: str) -> None:
    """Columns reading one tensor (q, k, v; gate, up) share its copy into the region: per
    block one all-reduce for attention and one for the MLP, plus one for the head's input."""
    for rank in _results():
        assert rank[name]["backward"] == 2 * 4 + 1


def test_layers_kept_whole_say_why() -> None:
    """Grouped convolutions, and expert weights without an example to prove their split on,
    stay whole, and the decision says so (test_experts_tp.py splits them with one)."""
    for name, example, layer, reason in (
        ("mixtral", None, "mlp.experts", "holds a 3-D weight (4, "),
        ("convnext", torch.randn(4, 3, 32, 32), "dwconv", "groups="),
    ):
        torch.manual_seed(0)
        decisions = plan_splits(hf_models.MORE[name](), 2, example=example)
        kept = [d for d in decisions if d.name.endswith(layer)]
        assert kept and all(d.split == "replicate" and reason in d.reason for d in kept), name


def test_an_embedding_that_scales_its_rows_splits_by_vocabulary() -> None:
    """Gemma 3 multiplies the rows it looks up by sqrt(hidden) (an embed_scale buffer): the
    vocabulary split does the same after its sum, so the embedding and its tied head split;
    tests/test_hf_models.py trains it under pp2 x tp2 against one process."""
    torch.manual_seed(0)
    decisions = {d.name: d for d in plan_splits(hf_models.MORE["gemma3"](), 2)}
    assert decisions["m.model.embed_tokens"].split == "vocab"
    assert decisions["m.lm_head"].split == "column" and decisions["m.lm_head"].tied
