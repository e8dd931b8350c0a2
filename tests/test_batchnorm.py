"""BatchNorm over the global batch: dp and micro-batches train as one process on the whole batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import meshsplit as ms
from meshsplit.batchnorm import (
    BatchNorm,
    _combine,
    commit_batchnorm,
    convert_batchnorm,
    describe_batchnorm,
)
from meshsplit.data_parallel.allreduce import GradientSync
from meshsplit.gather import ALL_GATHER

from reference import ATOL, RTOL

ROWS, STEPS, CLASSES = 16, 3, 5


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.BatchNorm2d(6, momentum=None),  # cumulative average of the running statistics
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, CLASSES),
    )


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 8),
        nn.BatchNorm1d(8, affine=False),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, track_running_stats=False),  # batch statistics in eval too
        nn.Linear(8, CLASSES),
    )


def _dead_channels() -> nn.Module:
    """Channels that a ReLU leaves at zero, shifted by a depthwise convolution's bias: each
    is constant over the batch, so BatchNorm makes it its bias (zero) but for an ulp, which
    side of the ReLU after it deciding whether that bias trains at all."""
    torch.manual_seed(0)
    first = nn.Conv2d(1, 6, 3)
    depthwise = nn.Conv2d(6, 6, 1, groups=6)
    with torch.no_grad():
        first.weight[:4] = 0.0
        first.bias[:4] = -1.0
        depthwise.bias.copy_(torch.tensor([0.3, -0.7, 1.1, 0.013, 0.2, -0.1]))
    # frozen: its gradient on a dead channel is rounding noise times 1/sqrt(eps)
    depthwise.bias.requires_grad_(False)
    return nn.Sequential(
        first,
        nn.ReLU(),
        depthwise,
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, CLASSES),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": _cnn, "mlp": _mlp, "dead": _dead_channels}
NORMS = {"cnn": 2, "mlp": 3, "dead": 1}
"""BatchNorm layers per model (statistics all-gathers per micro-batch under dp)."""


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed global batches, off-centre so the mean matters, the same in every process."""
    g = torch.Generator().manual_seed(1)
    shape = {"cnn": (ROWS, 1, 10, 10), "dead": (ROWS, 1, 11, 11)}.get(name, (ROWS, 12))
    return [
        (2 * torch.randn(shape, generator=g) + 0.5, torch.randint(0, CLASSES, (ROWS,), generator=g))
        for _ in range(STEPS)
    ]


def _regroup(x: torch.Tensor, dp: int, micro_batches: int) -> torch.Tensor:
    """Rows reordered so that micro-batch j of one process is micro-batch j of every replica."""
    parts = [rows.tensor_split(micro_batches) for rows in x.tensor_split(dp)]
    return torch.cat([part[j] for j in range(micro_batches) for part in parts])


def _train(
    name: str, *, convert: bool, micro_batches: int = 1, recompute: bool = False, regroup: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor, list[int], int]:
    """3 SGD steps over this replica's rows (the whole batch with no process group).

    Returns losses, state, eval output on this replica's rows of the last batch, the
    statistics all-gathers of each step and those of the eval forward.
    """
    group = dist.group.WORLD if dist.is_initialized() else None
    dp, rank = (dist.get_world_size(), dist.get_rank()) if group is not None else (1, 0)
    model = MODELS[name]()
    if convert:
        convert_batchnorm(model, group, micro_batches)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sync = GradientSync(params, group, bucket_mb=0.0005) if group is not None else None
    loss_fn = nn.CrossEntropyLoss()
    losses, gathers = [], []
    wrapped = getattr(dist, ALL_GATHER)
    with mock.patch.object(dist, ALL_GATHER, wraps=wrapped) as counter:
        for x, y in _batches(name):
            x, y = _regroup(x, regroup, micro_batches), _regroup(y, regroup, micro_batches)
            counter.reset_mock()
            total = torch.zeros(())
            if sync is not None:
                sync.begin_step(micro_batches)
            mine = zip(
                x.tensor_split(dp)[rank].tensor_split(micro_batches),
                y.tensor_split(dp)[rank].tensor_split(micro_batches),
                strict=True,
            )
            for xm, ym in mine:
                out = checkpoint(model, xm, use_reentrant=False) if recompute else model(xm)
                loss = loss_fn(out, ym) * (len(xm) / len(x))
                loss.backward()
                total += loss.detach()
            if sync is None:
                commit_batchnorm(model)
                optimizer.step()
                optimizer.zero_grad()
            else:
                sync.finish()
                dist.all_reduce(total)
                commit_batchnorm(model)
                optimizer.step()
                sync.zero_grad()
            losses.append(total.item())
            gathers.append(counter.call_count)
        counter.reset_mock()
        with torch.no_grad():
            evaluated = model.eval()(_batches(name)[-1][0].tensor_split(dp)[rank])
        eval_gathers = counter.call_count
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, evaluated, gathers, eval_gathers


def _assert_same(got: tuple, want: tuple, what: str) -> None:
    """Losses, every state tensor (parameters and running statistics) and eval output agree."""
    torch.testing.assert_close(
        torch.tensor(got[0]), torch.tensor(want[0]), rtol=RTOL, atol=ATOL, msg=f"{what} losses"
    )
    assert got[1].keys() == want[1].keys(), what
    for key, value in want[1].items():
        torch.testing.assert_close(
            got[1][key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{what} {k}: {m}"
        )
    torch.testing.assert_close(got[2], want[2], rtol=RTOL, atol=ATOL, msg=f"{what} eval")


DP_CASES = [
    ("cnn", 1, False),
    ("mlp", 1, False),
    ("cnn", 1, True),
    ("mlp", 2, True),
    ("dead", 1, False),
]
"""(model, micro_batches, recompute) run in each dp launch."""


def _uneven_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """15 rows (replicas of unequal size under dp=2 and dp=4) and a fixed output gradient."""
    g = torch.Generator().manual_seed(2)
    return 3 * torch.randn(15, 3, generator=g) + 1, torch.randn(15, 3, generator=g)


def _uneven(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and state of `norm` after one step on this replica's rows."""
    group = dist.group.WORLD if dist.is_initialized() else None
    dp, rank = (dist.get_world_size(), dist.get_rank()) if group is not None else (1, 0)
    x, dy = (t.tensor_split(dp)[rank] for t in _uneven_batch())
    if group is not None:
        convert_batchnorm(norm, group, 1)
    x.requires_grad_()
    out = norm(x)
    (out * dy).sum().backward()
    commit_batchnorm(norm)
    return out.detach(), x.grad, norm.state_dict()


def _dp_cases(cases: list[tuple[str, int, bool]]) -> tuple[list[tuple], tuple]:
    trained = [_train(name, convert=True, micro_batches=m, recompute=r) for name, m, r in cases]
    torch.manual_seed(0)
    return trained, _uneven(nn.Sequential(nn.BatchNorm1d(3)))


@pytest.mark.parametrize(("dp", "cases"), [(2, DP_CASES), (4, [*DP_CASES[:2], DP_CASES[-1]])])
def test_dp_matches_one_process_on_the_global_batch(dp: int, cases: list) -> None:
    per_rank = ms.launch(_dp_cases, dp, args=(cases,))
    torch.manual_seed(0)
    want_out, want_grad, want_state = _uneven(nn.Sequential(nn.BatchNorm1d(3)))
    uneven = [rank[1] for rank in per_rank]  # exact for replicas of unequal size too
    torch.testing.assert_close(torch.cat([u[0] for u in uneven]), want_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat([u[1] for u in uneven]), want_grad, rtol=RTOL, atol=ATOL)
    for _, _, state in uneven:
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
    for index, (name, m, recompute) in enumerate(cases):
        what = f"dp={dp} {name} micro_batches={m} recompute={recompute}"
        # micro-batch j of the one process holds micro-batch j of every replica
        want = _train(name, convert=m > 1, micro_batches=m, regroup=dp)
        results = [rank[0][index] for rank in per_rank]
        evaluated = torch.cat([r[2] for r in results])
        for rank, (losses, state, _, gathers, eval_gathers) in enumerate(results):
            _assert_same((losses, state, evaluated), want, f"{what} rank {rank}")
            # forward: one all-gather per layer and micro-batch, again when recomputed
            assert gathers == [NORMS[name] * m * (1 + recompute)] * STEPS, what
            # eval: running statistics need none; track_running_stats=False still gathers
            assert eval_gathers == (1 if name == "mlp" else 0), what


def test_plain_batchnorm_is_the_reference_at_one_micro_batch() -> None:
    for name in MODELS:
        _assert_same(_train(name, convert=True), _train(name, convert=False), name)


def test_every_input_rank_matches_nn_batchnorm() -> None:
    for norm, shape in [
        (nn.BatchNorm1d(3), (6, 3)),
        (nn.BatchNorm1d(3, momentum=None), (4, 3, 5)),
        (nn.BatchNorm2d(3), (4, 3, 5, 5)),
        (nn.BatchNorm3d(3, affine=False), (2, 3, 3, 4, 4)),
    ]:
        plain = nn.Sequential(copy.deepcopy(norm))
        ours = nn.Sequential(norm)
        convert_batchnorm(ours, None, 1)
        for seed in range(2):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1
            probe = torch.randn(shape)
            inputs = [x.clone().requires_grad_() for _ in range(2)]
            for model, inp in zip((plain, ours), inputs, strict=True):
                (model(inp) * probe).sum().backward()
            commit_batchnorm(ours)
            torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=RTOL, atol=ATOL)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[key], value, rtol=RTOL, atol=ATOL)
        for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
        plain.eval()
        ours.eval()
        torch.testing.assert_close(ours(x), plain(x), rtol=RTOL, atol=ATOL)


def test_one_replica_normalises_bit_for_bit_as_nn_batchnorm() -> None:
    """Without dp (one process, pp, tp) a converted layer computes what nn.BatchNorm does to
    the last bit, forward and backward: a value an ulp from zero before a ReLU must keep its
    side (a formula of its own flipped one on a random SE-ResNeXt, whose zero-initialised
    last norms make such ties, and put a gradient 15% off one process's)."""
    for zero_weight in (False, True):
        plain = nn.BatchNorm2d(6)
        with torch.no_grad():
            plain.weight.copy_(torch.zeros(6) if zero_weight else torch.rand(6) + 0.5)
            plain.bias.copy_(torch.randn(6))
        ours = nn.Sequential(copy.deepcopy(plain))
        convert_batchnorm(ours, None, 1)
        x = torch.randn(8, 6, 1, 1, generator=torch.Generator().manual_seed(4)) * 5 + 3
        probe = torch.randn(8, 6, 1, 1)
        outputs, inputs = [], [x.clone().requires_grad_() for _ in range(2)]
        for model, inp in zip((plain, ours), inputs, strict=True):
            outputs.append(model(inp))
            (torch.relu(outputs[-1]) * probe).sum().backward()
        assert torch.equal(outputs[1], outputs[0])
        assert torch.equal(inputs[1].grad, inputs[0].grad)
        for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)


def test_replicas_with_equal_means_combine_to_that_mean_exactly() -> None:
    """A channel constant on every replica (a dead ReLU channel shifted by a convolution's
    bias) combines to exactly its value and no spread, so it normalises to the layer's bias;
    a weighted sum of the means put it an ulp off, and x − μ, times 1/sqrt(eps), on either
    side of the ReLU after it."""
    value = torch.tensor([0.3, -0.7, 1.1, 0.013, 3.7, 1e-3])
    for sizes in ([648.0, 648.0], [405.0, 243.0], [0.0, 81.0, 162.0, 81.0]):
        counts = torch.tensor(sizes).view(-1, 1)
        means = value.expand(len(sizes), -1) * (counts > 0)  # an empty replica sends zeros
        count, mean, m2 = _combine(counts, means, torch.zeros_like(means))
        assert count.item() == sum(sizes)
        assert torch.equal(mean, value), sizes
        assert torch.equal(m2, torch.zeros_like(value)), sizes


def test_micro_batches_normalise_apart_and_update_running_stats_once() -> None:
    plain = _cnn()
    ours = copy.deepcopy(plain)
    convert_batchnorm(ours, None, micro_batches=2)
    norms = [m for m in plain if isinstance(m, nn.BatchNorm2d)]
    once = [copy.deepcopy(m) for m in norms]  # one nn.BatchNorm update per step, whole batch
    seen: list[list[torch.Tensor]] = [[] for _ in norms]
    for norm, inputs in zip(norms, seen, strict=True):
        norm.register_forward_hook(lambda _m, args, _o, inputs=inputs: inputs.append(args[0]))
    for x, _ in _batches("cnn")[:2]:
        for inputs in seen:
            inputs.clear()
        for xm in x.tensor_split(2):
            probe = torch.randn(len(xm), CLASSES) / ROWS  # a mean over the batch
            got, want = ours(xm), plain(xm)  # each micro-batch on its own, in train mode
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            (got * probe).sum().backward()
            (want * probe).sum().backward()
        commit_batchnorm(ours)
        with torch.no_grad():
            for norm, inputs in zip(once, seen, strict=True):
                norm(torch.cat(inputs))
    for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
    converted = [m for m in ours if isinstance(m, BatchNorm)]
    for mine, reference in zip(converted, once, strict=True):
        assert int(mine.num_batches_tracked) == 2  # one per step, not one per micro-batch
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(
                getattr(mine, key), getattr(reference, key), rtol=RTOL, atol=ATOL
            )


def test_recompute_counts_each_micro_batch_once() -> None:
    for name in MODELS:
        _assert_same(
            _train(name, convert=True, micro_batches=2, recompute=True),
            _train(name, convert=True, micro_batches=2),
            name,
        )


class _OwnForward(nn.BatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class _SameForward(nn.BatchNorm2d):
    """A subclass that only adds a method: its rule is nn.BatchNorm2d's."""

    def scale(self) -> torch.Tensor:
        return self.weight


def test_conversion_keeps_state_and_leaves_own_forwards_alone() -> None:
    shared = nn.BatchNorm2d(3)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 3, 1), shared),
        shared,
        _OwnForward(3),
        _SameForward(3),
        nn.BatchNorm1d(3, affine=False, track_running_stats=False),
    )
    with torch.no_grad():
        shared.running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    names = convert_batchnorm(model, None, micro_batches=2)  # (own forwards: elsewhere)
    assert names == ["0.1", "3", "4"]
    assert model[1] is model[0][1]  # a shared module stays one module
    assert type(model[2]) is _OwnForward
    assert list(model.parameters()) == params  # the same Parameter objects
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value)
    assert "dp=1, micro_batches=2" in repr(model[0][1])
    assert describe_batchnorm(names, dp=2, micro_batches=4) == {
        "layers": ["0.1", "3", "4"],
        "dp": "BatchNorm: statistics of each micro-batch gathered over dp=2",
        "pp": "BatchNorm: running statistics updated once per step over all 4 micro-batches "
        "of all replicas (as torchgpipe's DeferredBatchNorm)",
    }
    assert describe_batchnorm([], dp=2, micro_batches=4) == {}


def test_bad_use_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="micro_batches=0"):
        convert_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), None, 0)
    with pytest.raises(TypeError, match="wrap it in nn.Sequential"):
        convert_batchnorm(nn.BatchNorm1d(2), None, 1)
    model = nn.Sequential(nn.BatchNorm2d(2))
    convert_batchnorm(model, None, 1)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 2D input\)"):
        model(torch.randn(3, 2))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(torch.randn(1, 2, 1, 1))
