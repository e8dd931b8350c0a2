"""Operator split (alone and with data parallel) equals single-process training."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.fx

import meshsplit as ms
from meshsplit import tensor

from reference import (
    assert_matches,
    batches,
    build,
    train_parallel,
    train_plainly,
    train_single,
)

# The CNN trains with SGD: its channel-split conv sums partial maps in another order than one
# conv does, and Adam's 1/sqrt(v) turns that ~1e-7 noise on near-zero gradients into ~2e-6.
CASES = [("mlp", "adamw"), ("cnn", "sgd"), ("transformer", "adamw")]
HYBRID_CASES = [("mlp", "adamw"), ("cnn", "sgd"), ("transformer", "adamw")]


def _train_all(plan: ms.Plan, cases: list[tuple[str, str]]) -> list:
    return [train_parallel(model, opt, plan) for model, opt in cases]


@pytest.mark.parametrize("tp", [2, 4])
def test_operator_split_matches_single_process(tp: int) -> None:
    per_rank = ms.launch(_train_all, tp, args=(ms.Plan(tp=tp), CASES))
    for index, case in enumerate(CASES):
        assert_matches([results[index] for results in per_rank], train_single(*case))


def test_operator_split_with_data_parallel_matches_single_process() -> None:
    per_rank = ms.launch(_train_all, 4, args=(ms.Plan(dp=2, tp=2), HYBRID_CASES))
    for index, case in enumerate(HYBRID_CASES):
        assert_matches([results[index] for results in per_rank], train_single(*case))


def _split_transformer() -> dict:
    """Train two steps; report the split, this rank's replicated tensors, and an fx trace."""
    engine = ms.parallelize(
        build("transformer"), ms.Plan(tp=2), loss_fn=ms.models.TokenCrossEntropy()
    )
    for x, y in batches("transformer", 8, 2):
        engine.train_step(x, y)
    split = tensor.shard_dims(engine.module)
    replicated = {k: v.clone() for k, v in engine.module.state_dict().items() if k not in split}
    x = batches("transformer", 8, 1)[0][0]
    traced = torch.fx.symbolic_trace(engine.module)
    same_after_trace = torch.equal(traced(x), engine.predict(x))
    wrapped_calls = [
        node.target.__name__
        for node in traced.graph.nodes
        if node.op == "call_function" and node.target.__module__ == "meshsplit.tensor.layers"
    ]
    result = {
        "describe": engine.describe()["operator_split"],
        "shard_dims": split,
        "replicated": replicated,
        "same_after_trace": same_after_trace,
        "wrapped_calls": wrapped_calls,
        "local_shapes": {k: tuple(v.shape) for k, v in engine.module.state_dict().items()},
    }
    dist.barrier()
    engine.close()
    return result


@functools.cache
def _transformer_results() -> list[dict]:
    return ms.launch(_split_transformer, 2)


def test_describe_lists_every_layer_with_its_split_and_reason() -> None:
    rows = {row["name"]: row for row in _transformer_results()[0]["describe"]}
    assert rows["block0.attn"]["split"] == "heads"
    assert rows["block0.mlp.fc1"]["split"] == "column"
    assert rows["block0.mlp.fc2"]["split"] == "row"
    assert rows["embed.tokens"]["split"] == "vocab"
    assert rows["embed.positions"]["split"] == "replicate"
    assert rows["block0.ln1"]["split"] == "replicate"
    assert rows["head"]["split"] == "column"
    assert all(row["reason"] and row["layer"] for row in rows.values())


def test_replicated_parameters_stay_identical_across_tp_ranks() -> None:
    first, second = _transformer_results()
    assert first["replicated"].keys() == second["replicated"].keys()
    assert "ln_f.weight" in first["replicated"]
    assert "block0.mlp.fc2.bias" in first["replicated"]  # a row layer's bias
    for key, value in first["replicated"].items():
        assert torch.equal(value, second["replicated"][key]), key


def test_shard_dims_name_split_tensors_under_original_keys() -> None:
    result = _transformer_results()[0]
    full = build("transformer").state_dict()
    assert result["local_shapes"].keys() == full.keys()
    for key, dim in result["shard_dims"].items():
        want = list(full[key].shape)
        want[dim] //= 2
        assert list(result["local_shapes"][key]) == want, key
    assert result["shard_dims"]["block0.attn.q.weight"] == 0
    assert result["shard_dims"]["block0.attn.out.weight"] == 1


def test_symbolic_trace_keeps_collectives_as_single_calls() -> None:
    result = _transformer_results()[0]
    assert result["same_after_trace"]
    assert result["wrapped_calls"].count("leave_sum") == 1 + 2 * 2  # embedding, attn, mlp
    # one copy per attention (attention.py) and per column layer (layers.py): 2 blocks + head
    assert result["wrapped_calls"].count("enter_copy") == 2 * 2 + 1
    assert result["wrapped_calls"].count("leave_gather") == 1


def _autoencoder() -> torch.nn.Module:
    """Conv2d down, ConvTranspose2d up (an autoencoder's decoder, a GAN's generator)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 16, 4, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 28 * 28, 10),
    )


def _signal_net() -> torch.nn.Module:
    """Conv1d over a signal, a pooling between the pair, ConvTranspose1d up (audio, sequences)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Flatten(2),  # (B, 1, 28, 28) -> a 784-sample signal
        nn.Conv1d(1, 16, 5, stride=4, padding=2),
        nn.ReLU(),
        nn.Conv1d(16, 16, 3, padding=1),
        nn.MaxPool1d(2),
        nn.Conv1d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose1d(16, 8, 2, stride=2),
        nn.Flatten(),
        nn.Linear(8 * 196, 10),
    )


def _volume_net() -> torch.nn.Module:
    """Conv3d pairs over a volume (video, medical scans)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Unflatten(2, (4, 7)),  # (B, 1, 28, 28) -> a 4 x 7 x 28 volume
        nn.Conv3d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(16, 16, 3, stride=(1, 1, 2), padding=1),
        nn.ReLU(),
        nn.AvgPool3d((2, 1, 2)),
        nn.Flatten(),
        nn.Linear(16 * 2 * 7 * 7, 10),
    )


CONV_NETS = {"autoencoder": _autoencoder, "signal": _signal_net, "volume": _volume_net}


def _train_conv_net(name: str, plan: ms.Plan | None) -> tuple[list[float], dict, list[float]]:
    """Losses and state after 3 SGD steps; under a plan also each convolution's share of its
    whole weight on this rank."""
    model = CONV_NETS[name]()
    steps = batches("cnn", 8, 3)
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    if plan is None:
        loss_fn = torch.nn.CrossEntropyLoss()
        return (*train_plainly(model, sgd(model.parameters()), loss_fn, steps), [])
    whole = {n: p.numel() for n, p in model.named_parameters() if p.dim() > 2}
    engine = ms.parallelize(model, plan, optimizer=sgd, loss_fn=torch.nn.CrossEntropyLoss())
    losses = [engine.train_step(x, y) for x, y in steps]
    held = dict(engine.module.named_parameters())
    shares = [held[n].numel() / size for n, size in whole.items()]
    state = engine.full_state_dict()
    engine.close()
    return losses, state, shares


def _train_conv_nets(plan: ms.Plan) -> list[tuple[list[float], dict, list[float]]]:
    return [_train_conv_net(name, plan) for name in CONV_NETS]


def test_convolutions_of_every_dimension_split_by_channels() -> None:
    # Conv1d/2d/3d and their transposed forms: every convolution holds half its weight
    per_rank = ms.launch(_train_conv_nets, 2, args=(ms.Plan(tp=2),))
    for index, name in enumerate(CONV_NETS):
        losses, state, _ = _train_conv_net(name, None)
        assert_matches([r[index][:2] for r in per_rank], (losses, state), case=name)
        for rank, results in enumerate(per_rank):
            shares = results[index][2]
            assert shares == [0.5] * len(shares), (name, rank, shares)
