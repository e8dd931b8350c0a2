"""Activation compression and bf16 pipeline transfers: error bounds, bytes, and training.

Lossy options are outside the exactness contract, so training is checked against the exact
run by closeness of the losses, and the packing itself by per-kind error bounds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.job.traffic import count_traffic
from meshsplit.memory import compress
from meshsplit.memory.tracker import CATEGORIES, LiveTensors

from reference import OPTIMIZERS, batches, build, loss_for

pytestmark = pytest.mark.timeout(300)

ACTIVATIONS = CATEGORIES.index("activations")


def _round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    return compress.pack(x, kind).unpack()


@pytest.mark.parametrize("shape", [(64, 300), (8, 16, 12, 12)])
def test_each_kind_round_trips_within_its_bound(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    # channels of very different ranges: one scale per channel keeps the small ones exact enough
    channel = compress.channel_dim(torch.empty(shape))
    assert channel == 1  # the features of a Linear input, the channels of a convolution's
    ranges = torch.logspace(-3, 2, shape[channel])
    view = [1] * len(shape)
    view[channel] = -1
    x = torch.randn(shape, generator=g) * ranges.view(view)
    amax = x.abs().amax(dim=[d for d in range(x.dim()) if d != channel], keepdim=True)

    bf16 = _round_trip(x, "bf16")
    assert bf16.dtype == x.dtype
    assert ((bf16 - x).abs() <= 2**-8 * x.abs()).all()
    int8 = _round_trip(x, "int8")
    assert int8.dtype == x.dtype
    assert ((int8 - x).abs() <= amax / 127 / 2 * (1 + 1e-5)).all()
    fp8 = _round_trip(x, "fp8")
    assert ((fp8 - x).abs() <= (2**-4 * x.abs() + 2**-10 * amax / 448) * (1 + 1e-5)).all()
    assert compress.pack(x, "int8").codes.dtype == torch.int8
    assert compress.pack(x, "fp8").codes.dtype == torch.float8_e4m3fn


def _saved_bytes(model: nn.Module, x: torch.Tensor, kind: str) -> tuple[int, dict[str, int]]:
    """The tracker's activation bytes after forward (all saved, none freed yet)."""
    params = {"parameters": lambda: list(model.parameters())}
    with LiveTensors(torch.device("cpu"), params) as tracker:
        with compress.packing(kind, model) as packer:
            loss = model(x).logsumexp(1).mean()
        saved = tracker.breakdown()["activations"]
        loss.backward()
    return saved, packer.decisions if packer is not None else {}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_saved_activations_take_a_half_or_a_quarter_of_the_bytes(name: str) -> None:
    model = build(name)
    x = torch.randn(64, 1, 28, 28)  # per-feature scales of a Linear input: 4/64 of its codes
    plain, _ = _saved_bytes(model, x, "none")
    for kind, ratio in (("bf16", 2.0), ("int8", 4.0), ("fp8", 4.0)):
        packed, decisions = _saved_bytes(model, x, kind)
        assert plain / packed == pytest.approx(ratio, rel=0.1), (kind, plain, packed)
        assert decisions["packed"] > 0 and decisions["shared"] > 0  # ReLU out = next input


def test_weights_indices_small_and_partial_views_are_never_packed() -> None:
    weight = nn.Parameter(torch.randn(64, 64))
    embedding = nn.Embedding(100, 64)
    module = nn.ModuleList([embedding])
    index = torch.randint(0, 100, (32, 40))
    with compress.packing("int8", module) as packer:
        assert packer is not None
        big = torch.randn(4096, 64, requires_grad=True) * 1.0  # not a leaf: packed
        hidden = embedding(index)  # saves the indices (int64): kept
        out = (big @ weight).sum() + (hidden[:, :20] * 2).sum()  # weight: kept
        small = (torch.randn(8, 8, requires_grad=True) * 1.0).exp()  # 64 elements: kept
        half = big[:2048]  # a view of half a packed storage: shares the packed copy
        out = out + small.sum() + (half * half).sum()
        # packed: big; shared: half, twice (mul saves both operands); kept: the weight,
        # the indices, exp's small output
        assert packer.decisions == {"packed": 1, "shared": 2, "kept": 3}
        kept = [
            weight.t(),  # a view of a parameter
            index,
            embedding.weight,  # a module's parameter
            torch.randn(4096, 2)[:, :1],  # covers half its storage
            torch.randn(4096, 64).to_sparse(),
        ]
        assert all(packer.pack_hook(t) is t for t in kept)
    out.backward()  # the packed activations unpack into the right shapes
    assert weight.grad is not None and weight.grad.shape == weight.shape
    # a model whose only saved tensors are its weights and its input trains exactly
    torch.manual_seed(0)
    linear = nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)  # a leaf that needs a gradient: kept
    grads = []
    for kind in ("none", "int8"):
        linear.zero_grad()
        x.grad = None
        with compress.packing(kind, linear) as packer:
            linear(x).sum().backward()
        if packer is not None:
            assert packer.decisions == {"packed": 0, "shared": 0, "kept": 2}
        assert linear.weight.grad is not None and x.grad is not None
        grads.append((linear.weight.grad.clone(), x.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_lossy_options_say_so_and_unknown_kinds_are_refused() -> None:
    assert ms.Plan(compress="int8").lossy and ms.Plan(compress_transfers="bf16").lossy
    assert not ms.Plan().lossy
    with pytest.raises(ms.PlanError, match="compress"), compress.packing("int4"):
        pass


def test_engine_reports_and_estimates_packed_activations() -> None:
    """One rank in this process: the estimate's activation bytes and peak under int8."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    figures = {}
    for kind in ("none", "bf16", "int8"):
        estimate = ms.estimate_memory(
            build("cnn"), ms.Plan(compress=kind), batch, loss_fn=nn.CrossEntropyLoss(),
            optimizer=OPTIMIZERS["sgd"], timeline=True,
        )  # fmt: skip
        rank = estimate.ranks[0]
        figures[kind] = max(s.bytes_by_category[ACTIVATIONS] for s in rank.timeline)
        assert rank.breakdown["activations"] <= figures[kind]
    assert figures["none"] / figures["bf16"] == pytest.approx(2.0, rel=0.05)
    assert figures["none"] / figures["int8"] == pytest.approx(4.0, rel=0.05)


def _train(plan: ms.Plan, name: str, steps: int) -> dict[str, Any]:
    """Runs in every worker: losses, p2p bytes sent, and this rank's peak and breakdown."""
    engine = ms.parallelize(build(name), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=loss_for(name))
    losses, sent = [], []
    for x, y in batches(name, 16, steps):
        with count_traffic() as traffic:
            losses.append(engine.train_step(x, y))
        sent.append(traffic.bytes["isend"])
    report = engine.memory_report()
    engine.close()
    return {
        "losses": losses,
        "sent": sent,
        "peak": report.tensor_peak_bytes,
        "breakdown": report.tensor_breakdown,
    }


def _run_plans(plans: list[ms.Plan], name: str, steps: int) -> list[list[dict[str, Any]]]:
    return [_train(plan, name, steps) for plan in plans]


def test_two_workers_train_close_to_exact_with_compression_and_halve_p2p_bytes() -> None:
    exact_pp = ms.Plan(pp=2, micro_batches=2)
    plans = [
        exact_pp,
        ms.Plan(pp=2, micro_batches=2, compress_transfers="bf16"),
        ms.Plan(dp=2, compress="int8"),
        ms.Plan(pp=2, micro_batches=2, compress="int8", recompute="always"),
    ]
    per_rank = ms.launch(_run_plans, 2, args=(plans, "cnn", 3), timeout_s=240)
    exact, bf16, dp_int8, pp_int8 = zip(*per_rank, strict=True)
    for rank in range(2):
        # the steps after the first send no headers: exactly half the bytes
        assert bf16[rank]["sent"][1:] == [n // 2 for n in exact[rank]["sent"][1:]]
        assert exact[rank]["sent"][1] > 0
        for lossy in (bf16, dp_int8, pp_int8):
            torch.testing.assert_close(
                torch.tensor(lossy[rank]["losses"]),
                torch.tensor(exact[0]["losses"]),
                rtol=1e-2,
                atol=0,
            )
    # the estimate of a compressed plan still agrees with what the workers measured, and
    # their activations at the peak are about a quarter of the uncompressed plan's
    estimates = [
        ms.estimate_memory(
            build("cnn"),
            plan,
            batches("cnn", 16, 1)[0],
            loss_fn=loss_for("cnn"),
            optimizer=OPTIMIZERS["sgd"],
        )  # fmt: skip
        for plan in (ms.Plan(dp=2), plans[2])
    ]
    for rank, measured in enumerate(dp_int8):
        assert estimates[1].ranks[rank].peak_bytes == pytest.approx(measured["peak"], rel=0.10)
        plain = estimates[0].ranks[rank].breakdown["activations"]
        assert measured["breakdown"]["activations"] < 0.4 * plain
