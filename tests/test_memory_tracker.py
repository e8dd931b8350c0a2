"""The live-tensor tracker, step phases and the recompute knapsack, in one process."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import meshsplit as ms
from meshsplit import phases
from meshsplit.memory.recompute import BlockCost, choose_blocks
from meshsplit.memory.tracker import LiveTensors


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: torch.nn.Module,
) -> None:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_tracker_peak_agrees_with_the_profilers_allocation_events(name: str) -> None:
    """An independent count: PyTorch's profiler records every CPU allocation and free."""
    torch.manual_seed(0)
    if name == "mlp":
        model, loss_fn = ms.models.mlp(), torch.nn.CrossEntropyLoss()
        x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    else:
        model, loss_fn = ms.models.transformer(), ms.models.TokenCrossEntropy()
        x = torch.randint(0, 256, (32, 32))
        y = x.roll(-1, 1)
    optimizer = torch.optim.Adam(model.parameters())
    _step(model, optimizer, x, y, loss_fn)
    state = [t for s in optimizer.state.values() for t in s.values()]
    before = sum(p.nbytes for p in model.parameters()) + sum(t.nbytes for t in state)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, optimizer, x, y, loss_fn)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    holders = {"parameters": lambda: list(model.parameters()), "optimizer": lambda: state}
    with LiveTensors(torch.device("cpu"), holders) as tracker:
        _step(model, optimizer, x, y, loss_fn)
    assert tracker.peak.bytes == pytest.approx(before + peak, rel=0.02)


def test_tracker_sorts_bytes_by_what_holds_them_and_labels_the_peak() -> None:
    weight = torch.nn.Parameter(torch.randn(256, 256))
    with LiveTensors(torch.device("cpu"), {"parameters": lambda: [weight]}) as tracker:
        with phases.phase("forward, micro-batch 0"):
            x = torch.randn(512, 256, requires_grad=True)
            hidden = (x @ weight).relu()  # saves x (leaf input), weight (a parameter), output
            total = hidden.sum()
        at_forward = tracker.breakdown()
        with phases.phase("backward, micro-batch 0"):
            total.backward()
            del hidden, total
    assert at_forward["parameters"] == weight.nbytes
    assert at_forward["activations"] >= 512 * 256 * 4  # relu's output, saved for backward
    assert tracker.peak.phase.startswith(("forward", "backward"))
    assert sum(tracker.peak.breakdown.values()) == tracker.peak.bytes
    assert tracker.live_bytes < tracker.peak.bytes  # freed storages leave the count


def test_autocasts_weight_copies_count_as_parameters_and_its_casts_of_inputs_as_activations() -> (
    None
):
    layer = torch.nn.Linear(256, 256, bias=False)
    with LiveTensors(torch.device("cpu"), {"parameters": lambda: [layer.weight]}) as tracker:
        x = torch.randn(512, 256, requires_grad=True)  # a leaf, as a pipeline's received input
        with phases.phase("forward, micro-batch 0"), torch.autocast("cpu", torch.bfloat16):
            out = layer(x)  # saves bf16 copies of x and of the weight
        at_forward = tracker.breakdown()
        del out
    assert at_forward["parameters"] == layer.weight.nbytes + layer.weight.nbytes // 2
    assert at_forward["activations"] == x.nbytes // 2


def test_a_phase_over_the_budget_raises_at_its_end_naming_it() -> None:
    with (
        pytest.raises(ms.MemoryBudgetError, match="rank 0, step 1: forward, micro-batch 2"),
        LiveTensors(torch.device("cpu"), {}, budget=1_000_000, where="rank 0, step 1"),
        phases.phase("forward, micro-batch 2"),
    ):
        big = torch.zeros(1_000_000)
        del big


def test_the_knapsack_frees_the_need_for_the_least_added_time() -> None:
    blocks = [
        BlockCost("a", forward_ms=5.0, saved_bytes=1000, input_bytes=100),
        BlockCost("b", forward_ms=1.0, saved_bytes=600, input_bytes=100),
        BlockCost("c", forward_ms=1.0, saved_bytes=600, input_bytes=100),
        BlockCost("d", forward_ms=0.1, saved_bytes=50, input_bytes=100),  # frees nothing
    ]
    assert choose_blocks(blocks, in_flight=1, need_bytes=0) == []
    assert sorted(choose_blocks(blocks, in_flight=1, need_bytes=900)) == ["b", "c"]
    assert choose_blocks(blocks, in_flight=1, need_bytes=1200) in (["a", "b"], ["a", "c"])
    assert sorted(choose_blocks(blocks, in_flight=2, need_bytes=1000)) == ["b"] or sorted(
        choose_blocks(blocks, in_flight=2, need_bytes=1000)
    ) == ["c"]
    assert sorted(choose_blocks(blocks, in_flight=1, need_bytes=10**9)) == ["a", "b", "c"]


def test_the_default_counts_a_sample_of_the_steps_and_every_new_batch_shape() -> None:
    from meshsplit.runtime.rank_memory import FIRST_COUNTED, SAMPLE_EVERY, RankMemory

    memory = RankMemory(ms.Plan(), mesh=None)  # type: ignore[arg-type]
    small, large = ((8, 4),), ((16, 4),)
    counted = [n for n in range(1, 2 * SAMPLE_EVERY + 1) if memory.counts(n, small)]
    assert counted == [*range(1, FIRST_COUNTED + 1), SAMPLE_EVERY, 2 * SAMPLE_EVERY]
    assert memory.counts(2 * SAMPLE_EVERY + 1, large)  # a new shape allocates anew: counted
    assert not memory.counts(2 * SAMPLE_EVERY + 2, large)
    memory.track = True
    assert memory.counts(2 * SAMPLE_EVERY + 3, small)
    memory.track = False
    assert not memory.counts(2 * SAMPLE_EVERY + 4, (("new",),))
