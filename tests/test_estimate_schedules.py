"""The memory estimate under every pipeline schedule against what real workers hold.

Under interleaving rank 0 also receives from rank pp-1 (chunk pp-1 to chunk pp), so the
estimate runs a rank again once a later rank has told what it sends; zero bubble keeps each
micro-batch's graph from its B to its W. Each rank's estimate must be within 10% of the peak
real workers measure, and the schedules must rank alike by activations, estimated and measured.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import meshsplit as ms
from meshsplit.memory.estimate import RankEstimate
from meshsplit.memory.tracker import CATEGORIES, Sample

from reference import token_mixing

pytestmark = pytest.mark.timeout(300)

ROWS, LENGTH, VOCAB = 8, 64, 256
INTERLEAVED = {"schedule": "interleaved", "virtual_stages": 2}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
"""The two-stage cases ranked by activations."""
CASES = {
    2: {
        "gpipe": ms.Plan(pp=2, micro_batches=4, schedule="gpipe"),
        "1f1b": ms.Plan(pp=2, micro_batches=4),
        "interleaved": ms.Plan(pp=2, micro_batches=4, **INTERLEAVED),
        "zero-bubble": ms.Plan(pp=2, micro_batches=4, schedule="zero-bubble"),
        # three chunks a rank: the estimate runs each rank three times to hear every header
        "interleaved v3": ms.Plan(pp=2, micro_batches=4, schedule="interleaved", virtual_stages=3),
    },
    4: {"dp2 interleaved": ms.Plan(dp=2, pp=2, micro_batches=4, **INTERLEAVED)},
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same token batch in this process and in every worker."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    return x, torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)


def _model() -> torch.nn.Module:
    """The token mixer (six items: enough for three chunks on each of two ranks)."""
    torch.manual_seed(0)
    return token_mixing()


def _adam(params: Any) -> torch.optim.Optimizer:
    """Adam, so the steady step holds optimizer state as a real one does."""
    return torch.optim.Adam(params, lr=1e-3)


def _most_activations(samples: list[Sample]) -> int:
    """The most bytes autograd holds saved at any moment of a step (not only at its peak)."""
    column = CATEGORIES.index("activations")
    return max(sample.bytes_by_category[column] for sample in samples)


def _measure(plans: list[ms.Plan]) -> list[tuple[int, str, int]]:
    """Runs in every worker: two steps of each plan; this rank's peak, its phase and the most
    activations of the second step."""
    results = []
    for plan in plans:
        engine = ms.parallelize(
            _model(), plan, optimizer=_adam, loss_fn=ms.models.TokenCrossEntropy()
        )
        x, y = _batch()
        engine.train_step(x, y)
        engine.memory.timeline = []
        engine.train_step(x, y)
        report = engine.memory_report()
        results.append(
            (
                report.tensor_peak_bytes,
                report.tensor_peak_phase,
                _most_activations(engine.memory.timeline),
            )
        )
        engine.close()
    return results


@functools.cache
def _estimated_and_measured(workers: int) -> dict[str, tuple[list[RankEstimate], list[Any]]]:
    """Per case: every rank's estimate and what that rank measured (one launch for all)."""
    estimates = {
        name: ms.estimate_memory(
            _model(),
            plan,
            _batch(),
            optimizer=_adam,
            loss_fn=ms.models.TokenCrossEntropy(),
            timeline=True,
        )
        for name, plan in CASES[workers].items()
    }
    # the workers cut where the estimate did (stage sizes pinned from its profile)
    plans = [estimate.plan for estimate in estimates.values()]
    per_rank = ms.launch(_measure, workers, args=(plans,), timeout_s=240)
    return {
        name: (estimate.ranks, [per_rank[r.rank][index] for r in estimate.ranks])
        for index, (name, estimate) in enumerate(estimates.items())
    }


@pytest.mark.parametrize("workers", sorted(CASES))
def test_every_schedule_is_estimated_within_ten_percent_on_every_rank(workers: int) -> None:
    for name, (ranks, measured) in _estimated_and_measured(workers).items():
        for estimate, (peak, phase, _) in zip(ranks, measured, strict=True):
            error = abs(estimate.peak_bytes - peak) / peak
            assert error <= 0.10, (
                f"{name} rank {estimate.rank}: estimated {estimate.peak_bytes} at "
                f"{estimate.phase}, measured {peak} at {phase}"
            )


def _activations(rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """Each two-stage schedule's most activations on `rank` in a step: estimated, measured."""
    cases = {name: _estimated_and_measured(2)[name] for name in SCHEDULES}
    estimated = {n: _most_activations(ranks[rank].timeline) for n, (ranks, _) in cases.items()}
    return estimated, {n: got[rank][2] for n, (_, got) in cases.items()}


def test_schedules_rank_alike_by_activations_estimated_and_measured() -> None:
    for rank in range(2):
        estimated, measured = _activations(rank)
        assert _order(estimated) == _order(measured), (rank, estimated, measured)
        assert measured["gpipe"] == max(measured.values())  # all 4 micro-batches in flight
    # rank 0 holds 1F1B's 2 micro-batches, as many under zero bubble (each W right after its
    # B), and 5 chunks under interleaving (Megatron's warm-up: 2(p-1) + (v-1)p + 1)
    estimated, _ = _activations(0)
    assert _order(estimated) == [("gpipe",), ("interleaved",), ("1f1b", "zero-bubble")]
    # rank 1 holds 1 micro-batch under 1F1B, 3 chunks under interleaving ((v-1)p + 1)
    estimated, _ = _activations(1)
    assert estimated["gpipe"] > estimated["interleaved"] > estimated["1f1b"]


def test_zero_bubble_holds_two_micro_batches_on_the_last_stage() -> None:
    # ZB-H1 runs the last stage's W one backward late: 2 graphs in flight, GPipe's 4; a graph
    # W has run must be freed, also while the tracker's saved-tensor hook is on
    estimated, measured = _activations(1)
    assert _order(measured) == [("gpipe",), ("zero-bubble",), ("interleaved",), ("1f1b",)]
    assert _order(estimated) == _order(measured)


def _order(values: dict[str, int]) -> list[tuple[str, ...]]:
    """Names from most to least, those within 1% of each other tied (sorted together)."""
    groups: list[list[str]] = []
    for name in sorted(values, key=lambda n: -values[n]):
        if groups and values[groups[-1][0]] - values[name] <= 0.01 * values[groups[-1][0]]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return [tuple(sorted(group)) for group in groups]


def test_a_model_with_too_few_layers_for_its_chunks_is_refused_by_the_estimate() -> None:
    plan = ms.Plan(pp=2, micro_batches=2, **INTERLEAVED)
    batch = ms.data.synthetic_images(4, seed=1)
    with pytest.raises(ms.PlanError, match="4 chunks exceeds the 2 layers"):
        ms.estimate_memory(
            ms.models.mlp((784, 16, 10)), plan, batch, loss_fn=torch.nn.CrossEntropyLoss()
        )


@pytest.mark.parametrize("zero", [2, 3])
def test_a_sharded_pipeline_whose_routing_reads_the_weights_is_estimated(zero: int) -> None:
    """Zero bubble re-runs the backward (and so the recomputed forward) in W under ZeRO: the
    simulated gathers must hand the router the same weights both times, or the experts get
    other rows and the recompute check refuses the step."""
    reference = ms.models.reference("moe")
    plan = ms.Plan(
        dp=2, pp=2, zero=zero, schedule="zero-bubble", recompute="always", micro_batches=2
    )
    estimate = ms.estimate_memory(
        reference.model(), plan, reference.synthetic(16, seed=1), loss_fn=reference.loss()
    )
    assert len(estimate.ranks) == 4
    assert all(rank.peak_bytes > 0 for rank in estimate.ranks)
