"""The per-rank memory estimate against what real workers hold, and the budget.

`ms.estimate_memory` runs in this process; the same cases then run in real workers (several
cases per launch) and each rank's measured peak of live tensor bytes must be within 10% of
its estimate, over dp/pp/tp and hybrids, both schedules, recompute on and off, on the
reference models and on Hugging Face models.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms

from hf_models import FACTORIES, KINDS
from reference import token_mixing

pytestmark = pytest.mark.timeout(600)

ROWS = 8
TOKEN_MODELS = ("transformer", "token_mixing")
"""Reference models that read token ids and predict a token at every position."""


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name in FACTORIES:
        return FACTORIES[name]()
    return {
        "mlp": ms.models.mlp,
        "cnn": ms.models.cnn,
        "transformer": ms.models.transformer,
        "token_mixing": token_mixing,
    }[name]()


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name in ("mlp", "cnn"):
        return torch.randn(ROWS, 1, 28, 28, generator=g), torch.randint(0, 10, (ROWS,), generator=g)
    if name == "resnet":
        return torch.randn(ROWS, 3, 32, 32, generator=g), torch.randint(0, 10, (ROWS,), generator=g)
    vocab = 256 if name in TOKEN_MODELS else 64
    length = {"transformer": 32, "token_mixing": 64}.get(name, 8)
    x = torch.randint(0, vocab, (ROWS, length), generator=g)
    if KINDS.get(name) == "classify":
        return x, torch.randint(0, 3, (ROWS,), generator=g)
    return x, torch.randint(0, vocab, (ROWS, length), generator=g)


def _loss(name: str) -> nn.Module:
    token_level = name in TOKEN_MODELS or (name in FACTORIES and name not in KINDS)
    return ms.models.TokenCrossEntropy() if token_level else nn.CrossEntropyLoss()


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _estimate(name: str, plan: ms.Plan) -> ms.MemoryEstimate:
    return ms.estimate_memory(
        _model(name), plan, _batch(name), optimizer=_adam, loss_fn=_loss(name)
    )


def _measure(cases: list[tuple[str, ms.Plan]]) -> list[tuple[int | None, str | None]]:
    """Runs in every worker: two steps of each case; this rank's measured peak of each."""
    peaks = []
    for name, plan in cases:
        engine = ms.parallelize(_model(name), plan, optimizer=_adam, loss_fn=_loss(name))
        x, y = _batch(name)
        for _ in range(2):
            engine.train_step(x, y)
        report = engine.memory_report()
        peaks.append((report.tensor_peak_bytes, report.tensor_peak_phase))
        engine.close()
    return peaks


CASES = {
    4: [
        ("transformer", ms.Plan(dp=4)),
        ("transformer", ms.Plan(pp=4, micro_batches=4)),
        ("transformer", ms.Plan(dp=2, pp=2, micro_batches=2, schedule="gpipe")),
        ("transformer", ms.Plan(tp=4)),
        ("transformer", ms.Plan(pp=2, tp=2, micro_batches=4, recompute="always")),
        ("mlp", ms.Plan(dp=2, tp=2)),
        ("cnn", ms.Plan(dp=2, pp=2, micro_batches=2, recompute="except_last")),
        ("gpt2", ms.Plan(pp=2, tp=2, micro_batches=2)),
        ("llama", ms.Plan(pp=4, micro_batches=4, schedule="gpipe")),
        ("bert", ms.Plan(dp=2, tp=2)),
        ("resnet", ms.Plan(dp=2, pp=2)),
        ("mlp", ms.Plan(dp=4, zero=1)),  # whole tensors dealt out: the ranks differ
        # pp x tp: each stage's tp collectives, its receive pools and its wire copies at once
        ("token_mixing", ms.Plan(pp=2, tp=2, micro_batches=2)),
        ("token_mixing", ms.Plan(pp=2, tp=2, micro_batches=2, precision="bf16-mixed")),
        ("token_mixing", ms.Plan(dp=2, tp=2)),
        ("transformer", ms.Plan(pp=2, tp=2, micro_batches=2, precision="bf16-mixed")),
        # ZeRO 3 with the whole model one FSDP2 unit (every block under 1 MiB rides the root):
        # the gathered buffer is freed after its copy-out, as on the workers
        ("transformer", ms.Plan(dp=4, zero=3)),
        ("gpt2", ms.Plan(dp=2, tp=2, zero=3)),
        # after the transformer's tp=4, whose staging its engine's close forgets; two kv heads
        # shared by pairs of ranks, kept whole
        ("llama", ms.Plan(tp=4)),
    ],
    2: [
        ("transformer", ms.Plan(pp=2, micro_batches=4, recompute="always")),
        ("transformer", ms.Plan(dp=2, micro_batches=2, recompute="always")),
        ("mlp", ms.Plan(dp=2, micro_batches=2)),
        ("llama", ms.Plan(tp=2)),
        ("gpt2", ms.Plan(pp=2, micro_batches=4, schedule="gpipe", recompute="always")),
        ("cnn", ms.Plan(dp=2, zero=1)),  # fc1 holds most of the CNN: one rank's Adam state
        ("token_mixing", ms.Plan(pp=2, micro_batches=2)),
        # after llama's: a tp group that is the whole world forgets llama's staging on close
        ("token_mixing", ms.Plan(tp=2)),
        ("transformer", ms.Plan(dp=2, zero=2)),
    ],
}


@pytest.mark.parametrize("workers", sorted(CASES))
def test_estimate_is_within_ten_percent_of_every_ranks_measured_peak(workers: int) -> None:
    estimates = [_estimate(name, plan) for name, plan in CASES[workers]]
    # the workers run the split the estimate assumed (stage sizes pinned from its profile)
    cases = [(name, est.plan) for (name, _), est in zip(CASES[workers], estimates, strict=True)]
    per_rank = ms.launch(_measure, workers, args=(cases,), timeout_s=600)
    for index, (name, plan) in enumerate(cases):
        for rank, estimate in enumerate(estimates[index].ranks):
            measured, phase = per_rank[rank][index]
            error = abs(estimate.peak_bytes - measured) / measured
            assert error <= 0.10, (
                f"{name} {plan.describe()} rank {rank}: estimated {estimate.peak_bytes} "
                f"at {estimate.phase}, measured {measured} at {phase}"
            )
            assert set(estimate.breakdown) == {
                "parameters", "gradients", "optimizer", "activations", "buffers", "temporaries"
            }  # fmt: skip
            assert sum(estimate.breakdown.values()) == estimate.peak_bytes


def test_estimating_leaves_the_callers_excepthook_as_it_was() -> None:
    # each simulated rank's process group wraps sys.excepthook with a "[rank<r>]: " prefix
    hook = sys.excepthook
    _estimate("transformer", ms.Plan(pp=2, tp=2, micro_batches=2))
    assert sys.excepthook is hook


def test_estimate_sees_each_split_hold_less_and_pipelines_hold_buffers() -> None:
    whole = _estimate("transformer", ms.Plan())
    layer = _estimate("transformer", ms.Plan(pp=2, micro_batches=4))
    operator = _estimate("transformer", ms.Plan(tp=2))
    one = whole.ranks[0].breakdown["parameters"]
    assert all(r.breakdown["parameters"] < 0.7 * one for r in layer.ranks + operator.ranks)
    assert all(r.breakdown["buffers"] > 0 for r in layer.ranks)
    assert whole.ranks[0].phase.startswith(("backward", "forward", "optimizer"))
    gpipe = _estimate("transformer", ms.Plan(pp=2, micro_batches=4, schedule="gpipe"))
    first = [layer.ranks[0].breakdown["activations"], gpipe.ranks[0].breakdown["activations"]]
    assert first[1] > first[0]  # GPipe holds all 4 micro-batches, 1F1B at most 2 on stage 0
    assert _estimate("transformer", ms.Plan(dp=2)).plan.world_size == 2


def test_estimate_leaves_the_model_and_random_stream_untouched() -> None:
    model = _model("transformer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    state = torch.get_rng_state()
    ms.estimate_memory(model, ms.Plan(pp=2, tp=2, micro_batches=2), _batch("transformer"),
                       loss_fn=_loss("transformer"))  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_over_budget_is_a_plan_error_with_the_breakdown_and_a_fix() -> None:
    roomy = _estimate("transformer", ms.Plan(micro_batches=1, memory_budget="1GiB"))
    assert roomy.fits
    roomy.check()
    tight = int(0.9 * roomy.ranks[0].peak_bytes)  # short of the need; more micro-batches fit
    estimate = _estimate("transformer", ms.Plan(micro_batches=1, memory_budget=tight))
    assert not estimate.fits
    assert estimate.fix is not None and "fits" in estimate.fix
    with pytest.raises(ms.PlanError, match=r"rank 0 needs .* activations .*With "):
        estimate.check()


def test_a_budget_no_nearby_plan_meets_says_the_smallest_need() -> None:
    estimate = _estimate("mlp", ms.Plan(memory_budget="64KiB"))
    assert estimate.fix is not None and "smallest per-rank need" in estimate.fix


@pytest.mark.parametrize(
    "budget", ["2 GiB", "512MB", "1.5GiB", 4096, "64KiB", "1TB", "10B", "3 KB"]
)
def test_budgets_in_known_units_parse(budget: str | int) -> None:
    assert (ms.Plan(memory_budget=budget).budget_bytes or 0) > 0


@pytest.mark.parametrize("budget", ["2 gigs", "12XB", "-1GiB", "GiB", 0, 2.5, True])
def test_a_budget_in_an_unknown_unit_is_a_plan_error(budget: Any) -> None:
    with pytest.raises(ms.PlanError, match="memory_budget"):
        ms.Plan(memory_budget=budget)


def test_estimate_inside_a_process_group_is_refused() -> None:
    results = ms.launch(_estimate_inside, 1, timeout_s=120)
    assert "outside ms.launch" in results[0]


def _estimate_inside() -> str:
    try:
        _estimate("mlp", ms.Plan())
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_later_stage_reading_received_position_ids_is_estimated() -> None:
    # OPT cut into 8 chunks (the traced front end) sends its position ids from the first
    # chunk on; a simulated rank hears no peer, so what it receives must still index the
    # position table (it held leftover heap bytes: IndexError)
    import transformers

    from hf_models import Wrap

    config = transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Wrap(transformers.OPTForCausalLM(config))
    x, y = _batch("llama")
    plan = ms.Plan(pp=4, micro_batches=4, schedule="interleaved", virtual_stages=2)
    estimate = ms.estimate_memory(model, plan, (x, y), loss_fn=ms.models.TokenCrossEntropy())
    assert all(rank.peak_bytes > 0 for rank in estimate.ranks)
