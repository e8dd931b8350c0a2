"""Mixed precision under every split equals plain PyTorch with the same autocast.

The reference is one process running forward and loss under `torch.autocast` (and, for
fp16, `torch.amp.GradScaler`); each plan trains the same global batches with SGD. What we
hold it to: losses within rtol 2e-2 and every parameter within 2% of its tensor's largest
value after 4 steps (bf16 keeps 8 bits of mantissa: a split sums the same products in
another order and rounds them at other places). Besides the numbers, each case checks that
the split's linear layers ran in the low dtype, that parameters and optimizer state stay
float32, that every rank reports the same losses, and for fp16 that overflowing steps were
skipped on every rank alike. Where an fp16 value overflows depends on the rows a rank sums,
so near the threshold a split can skip another step than one process does: the overflowing
runs are held to one process where the rows are the same (tp), to DDP with GradScaler on
the same replicas under dp, and to agreeing ranks under pp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.memory import pools

from reference import OPTIMIZERS

transformers = pytest.importorskip("transformers")

from hf_models import FACTORIES, KINDS, MORE  # noqa: E402

LOSS_RTOL, PARAM_SHARE = 2e-2, 2e-2
BATCH, STEPS = 16, 4
DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
OVERFLOWING = 30.0
"""A loss multiplier under which fp16 overflows twice in 4 steps (the first and the last)."""

Case = tuple[str, dict[str, Any], str, float]
"""(model, plan fields, precision, loss multiplier)."""
AGREE_ONLY = {"pp": 2, "micro_batches": 2}
"""Overflowing fp16 pipelines: checked for ranks that agree, not against one process."""


class Scaled(nn.Module):
    """Cross-entropy (per token, or per row for a classifier) times a constant: with a large
    one, a loss that overflows fp16."""

    def __init__(self, factor: float, model: str = "transformer") -> None:
        super().__init__()
        classify = KINDS.get(model) == "classify"
        self.inner = nn.CrossEntropyLoss() if classify else ms.models.TokenCrossEntropy()
        self.factor = factor

    def forward(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner(output, targets) * self.factor


def _build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "transformer":
        return ms.models.transformer(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=8)
    if model == "moe":  # the CLI's own: its experts add their bf16 answers into fp32 tokens
        return ms.models.moe(vocab_size=64, d_model=32, n_heads=4, seq_len=8, experts=4, hidden=32)
    return (FACTORIES | MORE)[model]()


def _batches(model: str = "transformer") -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = ms.data.synthetic_tokens(BATCH * STEPS, seq_len=8, vocab_size=64, seed=1)
    if KINDS.get(model) == "classify":
        y = y[:, 0] % 3
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _single(model: str, precision: str, factor: float) -> dict[str, Any]:
    """Plain PyTorch: autocast around forward and loss, GradScaler for fp16."""
    net, loss_fn = _build(model), Scaled(factor, model)
    optimizer = OPTIMIZERS["sgd"](net.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16-mixed")
    losses, skipped = [], 0
    for x, y in _batches(model):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=DTYPES[precision]):
            loss = loss_fn(net(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.is_enabled() and scaler.get_scale() < before
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "state": state, "skipped": skipped}


def _linear_dtypes(module: nn.Module) -> tuple[set[torch.dtype], list[Any]]:
    """The output dtypes of every linear layer (split or not) this rank runs, as hooks
    fill them in."""
    seen: set[torch.dtype] = set()
    hooks = []
    for sub in module.modules():
        if "Linear" in type(sub).__name__ or "Conv1D" in type(sub).__name__:
            hooks.append(
                sub.register_forward_hook(
                    lambda _m, _a, out: seen.add(out.dtype) if torch.is_tensor(out) else None
                )
            )
    return seen, hooks


def _train(cases: list[Case]) -> list[dict[str, Any]]:
    results = []
    for model, fields, precision, factor in cases:
        plan = ms.Plan(precision=precision, **fields)
        engine = ms.parallelize(
            _build(model), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=Scaled(factor, model)
        )
        batches = _batches(model)
        engine.prepare(batches[0][0])
        seen, hooks = _linear_dtypes(engine.module)
        losses = [engine.train_step(x, y) for x, y in batches]
        for hook in hooks:
            hook.remove()
        moments = [
            t.dtype
            for state in pools.local_optimizer(engine.optimizer).state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        results.append(
            {
                "losses": losses,
                "state": engine.full_state_dict(),
                "skipped": engine.skipped_steps,
                "linear_dtypes": seen,
                "master_dtypes": {p.dtype for p in engine.module.parameters()} | set(moments),
            }
        )
        engine.close()
    return results


def _check(cases: list[Case], per_rank: list[list[dict[str, Any]]]) -> None:
    for index, (model, fields, precision, factor) in enumerate(cases):
        where = f"{model} {ms.Plan(precision=precision, **fields).describe()}"
        first = per_rank[0][index]
        for rank, results in enumerate(per_rank):
            got = results[index]
            assert got["losses"] == first["losses"], f"{where}: rank {rank} reports other losses"
            assert got["skipped"] == first["skipped"], f"{where}: rank {rank} skipped others"
            assert got["linear_dtypes"] == {DTYPES[precision]}, f"{where} rank {rank}"
            assert got["master_dtypes"] == {torch.float32}, f"{where} rank {rank}"
        if factor != 1.0 and fields.get("pp", 1) > 1:
            assert 0 < first["skipped"] < STEPS, f"{where}: skipped {first['skipped']}"
            continue
        want = _single(model, precision, factor)
        assert first["skipped"] == want["skipped"], f"{where}: skipped {first['skipped']}"
        _close(first, want, where)


def _close(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Losses within LOSS_RTOL, every parameter within PARAM_SHARE of its largest value."""
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=LOSS_RTOL, atol=0,
        msg=lambda m: f"{where} losses: {m}",
    )  # fmt: skip
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        assert got["state"][key].dtype == value.dtype, f"{where} {key}"
        bound = PARAM_SHARE * max(value.abs().max().item(), 1e-3)
        worst = (got["state"][key] - value).abs().max().item()
        assert worst <= bound, f"{where} {key}: off by {worst:.3g} > {bound:.3g}"


HF = ("gpt2", "llama", "bert")
TWO = [
    ("transformer", {"dp": 2}, "bf16-mixed", 1.0),
    ("transformer", {"tp": 2}, "bf16-mixed", 1.0),
    ("transformer", {"pp": 2, "micro_batches": 2}, "bf16-mixed", 1.0),
    ("transformer", {"dp": 2, "zero": 3}, "bf16-mixed", 1.0),
    ("transformer", {"dp": 2, "zero": 1, "reduce_dtype": "bf16"}, "bf16-mixed", 1.0),
    ("transformer", {"dp": 2, "zero": 2, "reduce_dtype": "bf16"}, "fp16-mixed", 1.0),
    ("transformer", {"dp": 2}, "fp16-mixed", 1.0),
    ("transformer", {"tp": 2}, "fp16-mixed", OVERFLOWING),
    ("transformer", {"pp": 2, "micro_batches": 2}, "fp16-mixed", OVERFLOWING),
    *[(m, {"dp": 2}, "bf16-mixed", 1.0) for m in HF],
    *[(m, {"tp": 2}, "bf16-mixed", 1.0) for m in HF],
    *[(m, {"pp": 2, "micro_batches": 2}, "bf16-mixed", 1.0) for m in HF],
    *[(m, {"dp": 2, "zero": 3}, "bf16-mixed", 1.0) for m in HF],
    ("mixtral", {"tp": 2}, "bf16-mixed", 1.0),  # every expert split by its inner width
    ("moe", {"dp": 2, "ep": 2}, "bf16-mixed", 1.0),
]
FOUR = [
    ("transformer", {"pp": 2, "tp": 2, "micro_batches": 2}, "bf16-mixed", 1.0),
    ("transformer", {"pp": 2, "tp": 2, "micro_batches": 2}, "fp16-mixed", OVERFLOWING),
    *[(m, {"pp": 2, "tp": 2, "micro_batches": 2}, "bf16-mixed", 1.0) for m in HF],
]


@pytest.mark.timeout(600)
def test_every_two_rank_plan_matches_plain_autocast() -> None:
    _check(TWO, ms.launch(_train, 2, args=(TWO,), timeout_s=400))


def _ddp_and_dp2(factor: float) -> list[dict[str, Any]]:
    """An overflowing fp16 run of DDP with GradScaler, then of Plan(dp=2), on one replica each."""
    from torch.nn.parallel import DistributedDataParallel

    rank = torch.distributed.get_rank()
    net, loss_fn = _build("transformer"), Scaled(factor)
    ddp = DistributedDataParallel(net)
    optimizer = OPTIMIZERS["sgd"](ddp.parameters())
    scaler = torch.amp.GradScaler("cpu")
    losses, skipped = [], 0
    for x, y in _batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ddp(x.chunk(2)[rank]), y.chunk(2)[rank])
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / 2)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    ours = _train([("transformer", {"dp": 2}, "fp16-mixed", factor)])[0]
    return [{"losses": losses, "state": state, "skipped": skipped}, ours]


@pytest.mark.parametrize("factor", [OVERFLOWING, 100.0])
def test_overflowing_fp16_under_dp2_skips_the_steps_ddp_with_grad_scaler_skips(
    factor: float,
) -> None:
    for ddp, ours in ms.launch(_ddp_and_dp2, 2, args=(factor,), timeout_s=300):
        assert ours["skipped"] == ddp["skipped"] > 0
        _close(ours, ddp, f"fp16 dp2 x{factor} against DDP")


@pytest.mark.timeout(600)
def test_pp2_x_tp2_matches_plain_autocast() -> None:
    _check(FOUR, ms.launch(_train, 4, args=(FOUR,), timeout_s=400))


def test_a_pipeline_of_one_micro_batch_is_plain_autocast_to_the_bit() -> None:
    """Values cross stages in their own dtype: LLaMA's float32 residual stream and its
    gradient are not rounded to bf16 on the way (they were: its loss moved in step 1)."""
    case: Case = ("llama", {"pp": 2, "micro_batches": 1}, "bf16-mixed", 1.0)
    want = _single("llama", "bf16-mixed", 1.0)
    # on the CPU, as the plain run: one bit of difference is the claim
    for results in ms.launch(_train, 2, args=([case],), timeout_s=300, backend="gloo"):
        assert results[0]["losses"] == want["losses"]
        for key, value in want["state"].items():
            torch.testing.assert_close(results[0]["state"][key], value, rtol=0, atol=0, msg=key)


def test_parameter_servers_push_gradients_in_the_reduce_dtype() -> None:
    case: Case = ("transformer", {"dp": 2, "sync": "ps", "reduce_dtype": "bf16"}, "bf16-mixed", 1)
    per_rank = ms.launch(_train, 3, args=([case],), timeout_s=300)
    _check([case], per_rank[:2])  # the workers; the server reports its own counts


def _resume(directory: str) -> dict[str, Any]:
    """fp16 under tp2 for two overflowing steps, saved; resumed under pp2 for two more (the
    rows of one process: see the module's note on where fp16 overflows)."""
    batches = _batches()
    first = ms.parallelize(
        _build("transformer"), ms.Plan(tp=2, precision="fp16-mixed"),
        optimizer=OPTIMIZERS["sgd"], loss_fn=Scaled(OVERFLOWING),
    )  # fmt: skip
    for x, y in batches[:2]:
        first.train_step(x, y)
    first.save(directory)
    saved_scale = first.precision.loss_scale.value if first.precision.loss_scale else None
    first.close()
    second = ms.parallelize(
        _build("transformer"), ms.Plan(pp=2, precision="fp16-mixed"),
        optimizer=OPTIMIZERS["sgd"], loss_fn=Scaled(OVERFLOWING),
    )  # fmt: skip
    second.prepare(batches[0][0])
    second.load(directory)
    scale = second.precision.loss_scale.value if second.precision.loss_scale else None
    losses = [second.train_step(x, y) for x, y in batches[2:]]
    return {"saved": saved_scale, "restored": scale, "losses": losses,
            "state": second.full_state_dict()}  # fmt: skip


def test_a_checkpoint_carries_fp32_master_state_and_the_loss_scale_across_plans(
    tmp_path: Path,
) -> None:
    want = _single("transformer", "fp16-mixed", OVERFLOWING)
    want["losses"] = want["losses"][2:]
    for got in ms.launch(_resume, 2, args=(str(tmp_path),), timeout_s=300):
        assert got["saved"] == got["restored"] == 2.0**15  # step 1 overflowed, step 2 not
        _close(got, want, "fp16 tp2 resumed under pp2")


def _nan_input() -> str:
    """fp16 on a batch with a NaN: the loss itself is not finite, which no scale mends."""
    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.mlp((784, 16, 10)), ms.Plan(dp=2, precision="fp16-mixed"),
        optimizer=OPTIMIZERS["sgd"],
    )  # fmt: skip
    x, y = ms.data.synthetic_images(8, seed=1)
    x[3] = float("nan")
    try:
        engine.train_step(x, y)
    except ms.NonFiniteError as error:
        return str(error)
    return "no error"


def test_a_loss_that_no_scale_mends_is_still_a_nonfinite_error() -> None:
    for message in ms.launch(_nan_input, 2, timeout_s=120):
        assert message.startswith("step 1: a NaN or infinity"), message


def test_bad_precision_values_are_plan_errors_naming_the_allowed_ones() -> None:
    with pytest.raises(ms.PlanError, match=r"Plan.precision='bf16'.*'bf16-mixed'"):
        ms.Plan(precision="bf16")
    with pytest.raises(ms.PlanError, match=r"Plan.reduce_dtype='fp16'.*'fp32', 'bf16'"):
        ms.Plan(reduce_dtype="fp16")
    assert (
        ms.Plan(precision="fp16-mixed", reduce_dtype="bf16")
        .describe()
        .endswith("fp16-mixed reduce=bf16")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="autocast on the mesh's CUDA device")
def test_one_gpu_runs_forward_under_cuda_autocast() -> None:
    cases: list[Case] = [("transformer", {}, "bf16-mixed", 1.0), ("gpt2", {}, "fp16-mixed", 1.0)]
    _check(cases, ms.launch(_train, 1, args=(cases,), timeout_s=300))
