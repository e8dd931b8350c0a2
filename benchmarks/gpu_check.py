"""The GPU path, proven in one run of a few minutes on the machine's own torch (no pip).

On one GPU: a GPT-2-small-shaped decoder (12 x 768, vocab 50257, batch 16 x 1024, AdamW) in
plain PyTorch and under meshsplit Plan() in the same process, in fp32 and bf16 (autocast in
plain PyTorch; Plan(precision='bf16-mixed')): step time, TFLOP/s, the
fraction of the GPU's bf16 peak, peak memory; the bf16 step again without its one host read
(plain PyTorch without loss.item(); train_step(as_tensor=True) with nonfinite='off'); the
memory estimate beside max_memory_allocated;
the GPU-only tests (pytest -m gpu). With two GPUs or more: dp2, pp2 and tp2 on NCCL against one
GPU. Prints a table and writes JSON. On a machine without a GPU it says so and exits 0.
Run: PYTHONPATH=src python benchmarks/gpu_check.py [--out gpu_check.json] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import meshsplit as ms

GPT2 = {"vocab_size": 50257, "d_model": 768, "n_heads": 12, "n_layers": 12, "seq_len": 1024}
BATCH = 16
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core FLOP/s by GPU name (vendor datasheets), for the fraction of peak."""


def _flops_per_step(rows: int) -> float:
    """6 N per token for the weights plus the attention scores and their product."""
    model = ms.models.transformer(**GPT2).to("meta")
    params = sum(p.numel() for p in model.parameters())
    tokens, layers, width, seq = (
        rows * GPT2["seq_len"],
        GPT2["n_layers"],
        GPT2["d_model"],
        GPT2["seq_len"],
    )
    return 6 * params * tokens + 12 * layers * width * seq * tokens


def _batch(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT2["vocab_size"], (rows, GPT2["seq_len"] + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _timed(step: Any, steps: int) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def _plain(precision: str, steps: int, read_loss: bool = True) -> dict[str, float]:
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = ms.models.transformer(**GPT2).to(device)
    optimizer, loss_fn = _adamw(model.parameters()), ms.models.TokenCrossEntropy()
    x, y = _batch(BATCH, device)
    autocast = (
        torch.autocast("cuda", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    )

    def step() -> None:
        optimizer.zero_grad()
        with autocast:
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if read_loss:
            loss.item()  # the float train_step returns

    seconds = _timed(step, steps)
    return {"step_s": seconds, "peak_bytes": torch.cuda.max_memory_allocated(device)}


def _meshsplit(precision: str, steps: int, as_tensor: bool = False) -> dict[str, float]:
    """`as_tensor`: the loss left on the device, the non-finite check off (no host read)."""
    checks = {"nonfinite": "off"} if as_tensor else {}
    plan = ms.Plan(precision="bf16-mixed" if precision == "bf16" else "fp32", **checks)
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.transformer(**GPT2), plan, optimizer=_adamw, loss_fn=ms.models.TokenCrossEntropy()
    )
    x, y = _batch(BATCH, device)
    seconds = _timed(lambda: engine.train_step(x, y, as_tensor=as_tensor), steps)
    peak = torch.cuda.max_memory_allocated(device)
    engine.close()
    return {"step_s": seconds, "peak_bytes": peak}


def _one_gpu(steps: int) -> dict[str, Any]:
    """Runs in the one worker of a one-rank launch (NCCL, cuda:0)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        results[f"plain {precision}"] = _plain(precision, steps)
        results[f"meshsplit {precision}"] = _meshsplit(precision, steps)
    # the step without its one host read: a plain loop that never calls loss.item()
    results["plain bf16 no read"] = _plain("bf16", steps, read_loss=False)
    results["meshsplit bf16 tensor"] = _meshsplit("bf16", steps, as_tensor=True)
    rows = 2  # the estimate replays a step: a smaller batch keeps it quick
    x, y = _batch(rows, torch.device("cpu"))
    estimate = ms.estimate_memory(
        ms.models.transformer(**GPT2), ms.Plan(), (x, y), optimizer=_adamw,
        loss_fn=ms.models.TokenCrossEntropy(),
    )  # fmt: skip
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    engine = ms.parallelize(
        ms.models.transformer(**GPT2), ms.Plan(), optimizer=_adamw,
        loss_fn=ms.models.TokenCrossEntropy(),
    )  # fmt: skip
    engine.train_step(*_batch(rows, device))
    results["estimate"] = {
        "rows": rows,
        "estimated_bytes": estimate.ranks[0].peak_bytes,
        "measured_bytes": torch.cuda.max_memory_allocated(device),
    }
    engine.close()
    return results


SMALL = {"vocab_size": 512, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64}


def _small_losses(plan: ms.Plan, steps: int) -> list[float]:
    """Runs in every worker: SGD steps of a small decoder (fp32, TF32 off) under `plan`."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.transformer(**SMALL), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=ms.models.TokenCrossEntropy(),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SMALL["vocab_size"], (8, SMALL["seq_len"] + 1), generator=g)
    return [engine.train_step(tokens[:, :-1], tokens[:, 1:]) for _ in range(steps)]


def _exact_plans(steps: int) -> dict[str, bool]:
    """dp2, pp2 and tp2 on NCCL against one GPU."""
    reference = torch.tensor(ms.launch(_small_losses, 1, args=(ms.Plan(), steps))[0])
    plans = {"dp2": ms.Plan(dp=2), "pp2": ms.Plan(pp=2, micro_batches=2), "tp2": ms.Plan(tp=2)}
    verdicts = {}
    for name, plan in plans.items():
        losses = torch.tensor(ms.launch(_small_losses, 2, args=(plan, steps))[0])
        verdicts[name] = bool(torch.allclose(losses, reference, rtol=1e-4))
    return verdicts


def _gpu_tests() -> str:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "pytest is not installed here: GPU-only tests not run"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"],
        cwd=root, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return (done.stdout.strip().splitlines() or ["(no output)"])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"no GPU: torch {torch.__version__} sees no CUDA device; nothing to check here")
        Path(args.out).write_text(json.dumps({"gpu": None, "torch": torch.__version__}) + "\n")
        return
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in BF16_PEAK.items() if key in name), None)
    report: dict[str, Any] = {
        "gpu": name,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
    report.update(ms.launch(_one_gpu, 1, args=(args.steps,))[0])
    flops = _flops_per_step(BATCH)
    print(
        f"{name}, torch {torch.__version__}; GPT-2-small shape, batch {BATCH} x {GPT2['seq_len']}"
    )
    print(f"{'run':<22}{'s/step':>9}{'TFLOP/s':>9}{'of bf16 peak':>14}{'peak GiB':>10}")
    runs = ("plain fp32", "meshsplit fp32", "plain bf16", "meshsplit bf16")
    for run in (*runs, "plain bf16 no read", "meshsplit bf16 tensor"):
        row = report[run]
        achieved = flops / row["step_s"]
        fraction = f"{achieved / peak:.1%}" if peak else "?"
        print(
            f"{run:<22}{row['step_s']:>9.3f}{achieved / 1e12:>9.1f}{fraction:>14}"
            f"{row['peak_bytes'] / 2**30:>10.2f}"
        )
    estimate = report["estimate"]
    error = estimate["estimated_bytes"] / estimate["measured_bytes"] - 1
    print(f"memory estimate at batch {estimate['rows']}: {error:+.1%} of max_memory_allocated")
    report["gpu_tests"] = _gpu_tests()
    print(f"GPU-only tests: {report['gpu_tests']}")
    if torch.cuda.device_count() >= 2:
        report["exact_on_nccl"] = _exact_plans(args.steps)
        print(f"dp2, pp2, tp2 on NCCL equal one GPU: {report['exact_on_nccl']}")
    else:
        print("one GPU: dp2, pp2 and tp2 on NCCL need two (NCCL refuses two ranks on one GPU)")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
