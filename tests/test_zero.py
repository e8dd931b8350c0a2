"""ZeRO stages 2 and 3 (FSDP2 over dp) equal one process under every axis they compose with,
and each rank holds the paper's share of the model state.

With Ψ parameter bytes and fp32 Adam (two moments: K = 2): stage 1 holds Ψ + Ψ + 2Ψ/dp,
stage 2 Ψ + 3Ψ/dp plus (FSDP2 keeps each shard beside its gathered copy) Ψ/dp, stage 3
4Ψ/dp. One launch of 4 workers runs every case: starting workers dominates the time.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from test_hf_models import _batches, _build, _loss, _sgd, _single
from torch import nn

import meshsplit as ms

from reference import (
    ATOL,
    OPTIMIZERS,
    RTOL,
    assert_matches,
    batches,
    build,
    loss_for,
    train_plainly,
    train_single,
)

pytestmark = pytest.mark.timeout(900)

WORKERS = 4
EXACT = [
    ("mlp", ms.Plan(dp=4, zero=2)),
    ("cnn", ms.Plan(dp=4, zero=3)),
    ("mlp", ms.Plan(dp=2, tp=2, zero=3)),
    ("cnn", ms.Plan(dp=2, pp=2, micro_batches=2, zero=3)),
    ("mlp", ms.Plan(dp=2, pp=2, micro_batches=4, schedule="gpipe", recompute="always", zero=2)),
    ("cnn", ms.Plan(dp=4, micro_batches=2, recompute="always", zero=3)),  # blocks after sharding
]
HF = [
    ("gpt2", ms.Plan(dp=2, pp=2, micro_batches=2, zero=3)),  # tied embeddings across stages
    ("llama", ms.Plan(dp=2, tp=2, zero=3)),
    ("bert", ms.Plan(dp=4, zero=2)),
    ("resnet", ms.Plan(dp=4, zero=3)),  # BatchNorm: statistics gathered over dp, buffers whole
]
STAGES = [0, 1, 2, 3]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _model_state(stage: int) -> dict[str, Any]:
    """One Adam step of the reference MLP at dp=4 under `stage`: what the rank holds."""
    engine = ms.parallelize(ms.models.mlp(), ms.Plan(dp=WORKERS, zero=stage), optimizer=_adam)
    x, y = ms.data.synthetic_images(8)
    engine.train_step(x, y)
    engine.train_step(x, y)
    report = engine.memory_report()
    engine.close()
    return {
        "parameters": report.parameter_bytes,
        "gradients": report.gradient_bytes,
        "optimizer": report.optimizer_bytes,
        "peak parameters": (report.tensor_breakdown or {})["parameters"],
    }


def _job() -> dict[str, Any]:
    exact = []
    for name, plan in EXACT:
        engine = ms.parallelize(
            build(name), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=loss_for(name)
        )
        losses = [engine.train_step(x, y) for x, y in batches(name, 16, 3)]
        exact.append((losses, engine.full_state_dict()))
        engine.close()
    hf = []
    for name, plan in HF:
        engine = ms.parallelize(_build(name), plan, optimizer=_sgd, loss_fn=_loss(name))
        losses = [engine.train_step(x, y) for x, y in _batches(name)]
        hf.append((losses, engine.full_state_dict()))
        engine.close()
    return {
        "exact": exact,
        "hf": hf,
        "state": [_model_state(s) for s in STAGES],
        "refused": _refusal(),
    }


def _refusal() -> tuple[str, bool]:
    """zero=3 on a model whose one block mixes dtypes: the error, and whether the model was
    left unsharded."""
    # block 1 is large enough to be a unit of its own (zero.UNIT_FLOOR_BYTES)
    model = torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 512))
    model[1].bias.data = model[1].bias.data.double()
    try:
        engine = ms.parallelize(model, ms.Plan(dp=WORKERS, zero=3), optimizer=OPTIMIZERS["sgd"])
        engine.train_step(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    except ms.PlanError as error:
        untouched = all(type(p) is torch.nn.Parameter for p in model.parameters())
        return str(error), untouched
    return "", False


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return ms.launch(_job, WORKERS, timeout_s=600)


@pytest.mark.parametrize("index", range(len(EXACT)), ids=[p.describe() for _, p in EXACT])
def test_zero_matches_one_process(per_rank: list[dict[str, Any]], index: int) -> None:
    name, _ = EXACT[index]
    assert_matches([rank["exact"][index] for rank in per_rank], train_single(name, "sgd"))


@pytest.mark.parametrize("index", range(len(HF)), ids=[f"{m} {p.describe()}" for m, p in HF])
def test_zero_matches_one_process_on_hugging_face_models(
    per_rank: list[dict[str, Any]], index: int
) -> None:
    name, _ = HF[index]
    want_losses, want_state = _single(name)
    for rank in per_rank:
        losses, state = rank["hf"][index]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5
        )
        assert state.keys() == want_state.keys()
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_each_stage_holds_the_papers_share_of_model_state(per_rank: list[dict[str, Any]]) -> None:
    psi = sum(p.numel() * 4 for p in ms.models.mlp().parameters())
    dp = WORKERS
    expected = {  # (parameters at the step's peak, gradients, optimizer) in units of Ψ
        0: (1, 1, 2),
        1: (1, 1, 2 / dp),
        2: (1 + 1 / dp, 1 / dp, 2 / dp),
    }
    layers = [sum(p.numel() * 4 for p in m.parameters()) for m in ms.models.mlp()]
    largest = max(layers)
    small = sum(b for b in layers if b * 2 * sum(1 for n in layers if n) < psi)
    for stage in (0, 1, 2):
        held = [rank["state"][stage] for rank in per_rank]
        for what, share in zip(
            ("peak parameters", "gradients", "optimizer"), expected[stage], strict=True
        ):
            if stage == 1 and what == "optimizer":
                # ZeroRedundancyOptimizer deals out whole tensors: the ranks' shares add up
                # to 2Ψ, but a rank holding the MLP's 784x1024 layer holds more than 2Ψ/dp
                got, want = sum(h[what] for h in held), 2 * psi
            else:
                got, want = max(h[what] for h in held), share * psi
            message = f"zero={stage} {what}: {got} B, paper {want:.0f}"
            if stage == 2 and what == "peak parameters":  # at most: the peak may fall in
                assert got <= 1.1 * want, message  # backward, some blocks already sharded
            else:
                assert abs(got - want) <= 0.1 * want, message
    for h in (
        rank["state"][3] for rank in per_rank
    ):  # stage 3: (2 + 2 + K)Ψ/dp with K = 2, 16 bytes per fp32 parameter over dp
        total = h["parameters"] + h["gradients"] + h["optimizer"]
        assert abs(total - 4 * psi / dp) <= 0.1 * 4 * psi / dp
        # and, during the step, one block gathered whole at a time (at most the largest),
        # beside the layers too small to gather alone, which ride with the root (fc3, fc4)
        assert h["peak parameters"] <= 1.1 * (psi / dp + largest + small)


def test_zero_3_refuses_a_block_it_cannot_gather_and_leaves_the_model_whole(
    per_rank: list[dict[str, Any]],
) -> None:
    message, untouched = per_rank[0]["refused"]
    assert "Plan.zero=3" in message and "'1'" in message
    assert "torch.float32, torch.float64" in message and "zero=1" in message
    assert untouched


def _warned(in_place: bool, plan: ms.Plan) -> list[str]:
    """The warnings of two zero=3 steps of the reference transformer, whose output is a view;
    with `in_place`, the loss scales that output in place first (and the step fails)."""
    plain = loss_for("transformer")

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if in_place:
            output.mul_(1.0)
        return plain(output, target)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ms.parallelize(
            build("transformer"), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=loss
        )
        for x, y in batches("transformer", 8, 2):
            engine.train_step(x, y)
        engine.close()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "plan",
    [ms.Plan(dp=2, zero=3), ms.Plan(dp=2, pp=2, zero=3, micro_batches=2)],
    ids=["dp2", "dp2xpp2"],
)
def test_a_sharded_root_returning_a_view_is_checked_where_the_loss_reads_it(
    plan: ms.Plan,
) -> None:
    """FSDP2 warns of any view its root returns (an in-place change drops its backward hook,
    and with it every gradient of the shards); only the loss reads the root's output, so
    meshsplit checks that instead: no warning for a loss computed out of place, a clear
    error before backward for one that changes the output in place (it failed later, in the
    non-finite check, with "stack expects a non-empty TensorList")."""
    for quiet in ms.launch(_warned, plan.world_size, args=(False, plan)):
        assert not [m for m in quiet if "view" in m or "in place" in m], quiet
    with pytest.raises(
        ms.WorkerError, match="returned: (the model's output|the output of 'head');"
    ):
        ms.launch(_warned, plan.world_size, args=(True, plan), timeout_s=60)


class _ViewBlock(nn.Module):
    """A block large enough to be a ZeRO 3 unit of its own, returning a view."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.fc2(torch.tanh(self.fc1(x)))).transpose(0, 1).transpose(0, 1)


class _BlockViews(nn.Module):
    """Blocks returning views, which the model's own code changes in place or not."""

    def __init__(self, change: bool) -> None:
        super().__init__()
        self.change = change
        self.inp, self.head = nn.Linear(8, 256), nn.Linear(256, 4)
        self.blocks = nn.ModuleList(_ViewBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
            if self.change:
                h.mul_(0.9)
        return self.head(h)


def _block_views(
    change: bool, plan: ms.Plan | None = None
) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """Losses and state of three steps under `plan`, and FSDP2's view warnings."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ms.parallelize(
            _BlockViews(change), plan or ms.Plan(dp=2, zero=3), optimizer=OPTIMIZERS["sgd"],
            loss_fn=nn.CrossEntropyLoss(),
        )  # fmt: skip
        losses = [engine.train_step(x, y) for x, y in _view_batches()]
        state = engine.full_state_dict()
    return losses, state, [str(w.message) for w in caught if "view tensor" in str(w.message)]


def _view_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))] * 3


@pytest.mark.parametrize(
    "plan",
    [
        ms.Plan(dp=2, zero=3),
        # each stage runs its forward again in backward, its units' hooks with it
        ms.Plan(dp=2, pp=2, micro_batches=2, zero=2, recompute="always"),
    ],
    ids=["dp2 zero3", "dp2 pp2 zero2 recompute"],
)
def test_block_views_nothing_changes_train_without_a_warning(plan: ms.Plan) -> None:
    """FSDP2 warns of every view a unit returns (torch 2.13); meshsplit watches them instead,
    so blocks returning views that nothing changes (as T5's do) train quietly and exactly."""
    torch.manual_seed(0)
    model = _BlockViews(change=False)
    want_losses, want_state = train_plainly(
        model, OPTIMIZERS["sgd"](model.parameters()), nn.CrossEntropyLoss(), _view_batches()
    )
    workers = plan.dp * plan.pp
    for losses, state, warned in ms.launch(_block_views, workers, args=(False, plan)):
        assert not warned, warned
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=RTOL,
                                   atol=ATOL)  # fmt: skip
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)


def test_a_block_view_changed_by_the_models_own_code_is_refused_naming_the_block() -> None:
    """The change drops FSDP2's hook that gathers the block's shards for backward: refused
    before backward, naming the blocks (it failed in backward, after FSDP2's warning)."""
    with pytest.raises(
        ms.WorkerError, match="returned: the output of 'blocks.0', the output of 'blocks.1';"
    ):
        ms.launch(_block_views, 2, args=(True,), timeout_s=60)


class _StagesOfBlocks(nn.Module):
    """Twins' layout: a ModuleList per stage inside a ModuleList, walked by this forward; each
    stage (no forward of its own) holds over 1 MiB, enough to be a ZeRO 3 unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, 256), nn.Linear(256, 4)
        self.stages = nn.ModuleList(
            nn.ModuleList([nn.Linear(256, 512), nn.Linear(512, 256)]) for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for stage in self.stages:
            for layer in stage:
                h = torch.tanh(layer(h))
        return self.head(h)


def _stages_of_blocks(zero: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    engine = ms.parallelize(
        _StagesOfBlocks(), ms.Plan(dp=2, zero=zero), optimizer=OPTIMIZERS["sgd"],
        loss_fn=nn.CrossEntropyLoss(),
    )  # fmt: skip
    losses = [engine.train_step(x, y) for x, y in _view_batches()]
    return losses, engine.full_state_dict(), engine.memory_report().parameter_bytes


@pytest.mark.parametrize("zero", [2, 3])
def test_blocks_kept_in_lists_the_forward_walks_are_sharded_by_their_layers(zero: int) -> None:
    """FSDP2 cannot wrap a ModuleList (no forward to hook): such a unit (Twins' stages) was
    refused with a ValueError; its layers are the units instead."""
    torch.manual_seed(0)
    model = _StagesOfBlocks()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    want_losses, want_state = train_plainly(
        model, OPTIMIZERS["sgd"](model.parameters()), nn.CrossEntropyLoss(), _view_batches()
    )
    for losses, state, held in ms.launch(_stages_of_blocks, 2, args=(zero,)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=RTOL,
                                   atol=ATOL)  # fmt: skip
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
        assert held <= 0.55 * whole, (held, whole)
