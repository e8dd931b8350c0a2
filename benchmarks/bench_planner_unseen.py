"""The planner on models it was not tuned on: every plan `ms.choose_plan` ranks, run for real.

The reference models are what the cost model was fitted against (bench_planner.py); a user's
model is not. Three others, each with something the reference ones lack:

    resnet     convolutions with BatchNorm (statistics gathered over dp) and residual blocks
    gpt2       Hugging Face GPT-2, 4 blocks of width 128 (tied embeddings; a block list whose
               forward reads the position embedding across a cut); needs `transformers`
    wide_mlp   GELU layers of 1024: matmuls large enough to be memory-bound on a CPU

For each model and device count, every plan the planner ranks (or only those without
recompute, with --no-recompute) runs its own workers: two untimed steps, then the median of
`--steps` more. Printed per plan: predicted and measured step time and the error; per model:
the MAPE, the planner's choice and the fastest measured. Results go to
benchmarks/results/planner_unseen.json.

    PYTHONPATH=src python benchmarks/bench_planner_unseen.py [--models resnet gpt2] \
        [--devices 2] [--steps 12] [--no-recompute]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import meshsplit as ms

from rounds import median_step


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(inner)))


def _resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), _ResidualBlock(32), _ResidualBlock(32),
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), _ResidualBlock(64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def _images(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 3, 16, 16, generator=generator)
    return x, torch.randint(0, 10, (rows,), generator=generator)


class _Logits(nn.Module):
    """A Hugging Face causal LM as tokens -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _Logits(transformers.GPT2LMHeadModel(config))


def _tokens(rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, 2048, (rows, 64), generator=generator)
    return x, torch.roll(x, -1, 1)


def _wide_mlp() -> nn.Module:
    widths = (512, 1024, 1024, 1024, 512)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def _vectors(rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 512, generator=generator)
    return x, torch.randint(0, 10, (rows,), generator=generator)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Callable[[], nn.Module]]] = {
    "resnet": (_resnet, _images, nn.CrossEntropyLoss),
    "gpt2": (_gpt2, _tokens, lambda: ms.models.TokenCrossEntropy()),
    "wide_mlp": (_wide_mlp, _vectors, nn.CrossEntropyLoss),
}


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _timed(name: str, plan: ms.Plan, steps: int) -> float:
    """Runs in every worker: the median step of `plan` after two untimed ones."""
    inputs, targets = MODELS[name][1]()
    engine = ms.parallelize(_model(name), plan, optimizer=_optimizer, loss_fn=MODELS[name][2]())
    engine.memory.track = False
    seconds = median_step(lambda: engine.train_step(inputs, targets), steps, untimed=2)
    engine.close()
    return seconds


def _case(name: str, devices: int, steps: int, recompute: bool) -> dict[str, Any]:
    report = ms.choose_plan(
        _model(name), MODELS[name][1](), devices, optimizer=_optimizer, loss_fn=MODELS[name][2]()
    )
    rows = [r for r in report.rows if recompute or r.plan.recompute == "never"]
    plans = []
    for row in rows:
        measured = ms.launch(_timed, row.plan.world_size, args=(name, row.plan, steps))[0]
        error = (row.step_time_s - measured) / measured
        plans.append((row.plan.describe(), row.step_time_s, measured))
        print(f"  {row.plan.describe():46s} predicted {row.step_time_s * 1e3:7.1f} ms  "
              f"measured {measured * 1e3:7.1f} ms  {100 * error:+4.0f}%", flush=True)  # fmt: skip
    fastest = min(plans, key=lambda p: p[2])
    chosen = plans[0]
    mape = statistics.mean(abs(p - m) / m for _, p, m in plans)
    return {
        "model": name,
        "devices": devices,
        "step_time_mape": mape,
        "predicted_best": chosen[0],
        "measured_best": fastest[0],
        "predicted_best_within_5pct": chosen[2] <= 1.05 * fastest[2],
        "plans": plans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--devices", nargs="+", type=int, default=[2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-recompute", action="store_true", help="skip recomputing plans")
    args = parser.parse_args()
    results = []
    for name in args.models:
        for devices in args.devices:
            print(f"{name}, {devices} workers:", flush=True)
            case = _case(name, devices, args.steps, not args.no_recompute)
            results.append(case)
            print(f"{name} {devices}: MAPE {100 * case['step_time_mape']:.1f}%, predicted best "
                  f"{case['predicted_best']}, measured best {case['measured_best']}, within 5%: "
                  f"{case['predicted_best_within_5pct']}", flush=True)  # fmt: skip
    out = Path(__file__).parent / "results" / "planner_unseen.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
