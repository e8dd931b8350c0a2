"""Data parallel equals single-process training on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshsplit as ms
from meshsplit.data_parallel.allreduce import GradientSync

from reference import OPTIMIZERS, assert_matches, train_parallel, train_single

CASES = [(model, opt) for model in ("mlp", "cnn") for opt in ("sgd", "adamw")]


def _all_cases(dp: int) -> list:
    return [train_parallel(model, opt, ms.Plan(dp=dp)) for model, opt in CASES]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_data_parallel_matches_single_process(dp: int) -> None:
    per_rank = ms.launch(_all_cases, dp, args=(dp,))
    for index, case in enumerate(CASES):
        assert_matches([rank_results[index] for rank_results in per_rank], train_single(*case))


def _with_micro_batches() -> tuple:
    return train_parallel("small_mlp", "adamw", ms.Plan(dp=2, micro_batches=4))


def test_micro_batches_accumulate_to_one_step() -> None:
    assert_matches(ms.launch(_with_micro_batches, 2), train_single("small_mlp", "adamw"))


def _predict_and_report() -> tuple:
    torch.manual_seed(0)
    engine = ms.parallelize(ms.models.mlp((784, 32, 10)), ms.Plan(dp=2))
    inputs = torch.randn(7, 784)  # 7 rows: uneven over 2 replicas
    output = engine.predict(inputs)
    report = engine.memory_report()
    engine.train_step(torch.randn(8, 784), torch.randint(0, 10, (8,)))
    after = engine.memory_report()
    engine.close()
    return output, report, after


def test_predict_returns_full_output_and_report_counts_bytes() -> None:
    results = ms.launch(_predict_and_report, 2)
    torch.manual_seed(0)
    model = ms.models.mlp((784, 32, 10)).eval()
    torch.manual_seed(0)  # same draw order as the worker: model first, then inputs
    ms.models.mlp((784, 32, 10))
    expected = model(torch.randn(7, 784)).detach()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    for output, before, after in results:
        torch.testing.assert_close(output, expected)
        assert before.parameter_bytes == param_bytes
        assert before.gradient_bytes == param_bytes
        # Adam's two moments per parameter, made when the model was split (memory/pools.py)
        assert before.optimizer_bytes >= 2 * param_bytes
        assert after.optimizer_bytes == before.optimizer_bytes
        assert after.peak_bytes > param_bytes


def _zero(dp: int) -> list:
    results = [train_parallel("mlp", opt, ms.Plan(dp=dp, zero=True)) for opt in ("sgd", "adamw")]
    engine = ms.parallelize(
        ms.models.mlp(), ms.Plan(dp=dp, zero=True), optimizer=OPTIMIZERS["adamw"]
    )
    engine.train_step(*ms.data.synthetic_images(8))
    results.append(engine.memory_report().optimizer_bytes)
    engine.close()
    return results


def test_zero_shards_optimizer_state_and_matches_single_process() -> None:
    dp = 2
    per_rank = ms.launch(_zero, dp, args=(dp,))
    for index, opt in enumerate(("sgd", "adamw")):
        assert_matches([rank[index] for rank in per_rank], train_single("mlp", opt))
    model = ms.models.mlp()
    unsharded = sum(p.numel() * 4 * 2 + 4 for p in model.parameters())  # exp_avg, exp_avg_sq, step
    shards = [rank[-1] for rank in per_rank]
    assert sum(shards) == unsharded
    assert max(shards) <= 0.6 * unsharded  # about 1/dp each; whole tensors are not cut


def _all_reduces_per_step(plan: ms.Plan) -> tuple[int, int]:
    """all_reduce calls in one steady train_step of the MLP, and the gradient buckets."""
    import torch.distributed as dist

    calls = []
    original = dist.all_reduce

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    torch.manual_seed(0)
    engine = ms.parallelize(ms.models.mlp((784, 64, 64, 10)), plan)
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    engine.train_step(x, y)
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        engine.train_step(x, y)
    finally:
        dist.all_reduce = original
    buckets = len(getattr(engine.sync, "buckets", []))
    engine.close()
    return len(calls), buckets


def test_under_data_parallel_alone_the_step_adds_no_collective_to_the_buckets() -> None:
    """The loss, the non-finite flags and the batch check ride the first bucket; a pipeline
    (whose stages hold different gradients) sends them in an all-reduce of its own."""
    small = ms.Plan(dp=2, bucket_mb=0.1)  # fc1's weight in a bucket alone, the rest in one
    for calls, buckets in ms.launch(_all_reduces_per_step, 2, args=(small,)):
        assert buckets == 2 and calls == buckets, (calls, buckets)
    piped = ms.Plan(pp=2, micro_batches=2)
    for calls, _ in ms.launch(_all_reduces_per_step, 2, args=(piped,)):
        assert calls == 1, calls


def _sometimes_unused() -> list[list[float]]:
    """Two weights in one bucket; the second gets no gradient in the second and the fourth
    step, and in the fourth the first comes twice, as often as the bucket's two did."""
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    sync = GradientSync([used, unused], dist.group.WORLD, bucket_mb=1.0)
    seen = []
    for both, passes in ((True, 1), (False, 1), (True, 1), (False, 2)):
        sync.begin_step(1)
        for _ in range(passes):
            loss = (used * 2).sum() + ((unused * 3).sum() if both else 0)
            loss.backward()
        sync.finish()
        seen.append([*used.grad.tolist(), *unused.grad.tolist()])
        sync.zero_grad()
        assert used.grad is None and unused.grad is None  # dropped between steps, as DDP's
    return seen


def test_a_weight_no_gradient_reaches_reads_zeros_not_the_last_steps() -> None:
    for seen in ms.launch(_sometimes_unused, 2, timeout_s=60):
        assert seen == [
            [4.0] * 3 + [6.0] * 2,
            [4.0] * 3 + [0.0] * 2,
            [4.0] * 3 + [6.0] * 2,
            [8.0] * 3 + [0.0] * 2,
        ]
