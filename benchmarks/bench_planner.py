"""The planner's predictions against real runs: step time and memory per plan, and the choice.

For each reference model on 2 and 4 workers, `meshsplit compare` runs every dp x pp x tp
plan for real and the planner predicts each beside it (same model, batch and machine), in
ROUNDS rounds one after the other: each round measures the model and the machine afresh,
predicts, and runs every plan again. A plan's measured step is the mean of its rounds'
medians; each round's predictions are scored against it. Printed per (model, workers): the
step-time MAPE (mean over rounds), each round's MAPE against its own run alone, how far one
round's measurement of the same plans was from the other's (the measurement's own
repeatability on this host: no prediction can be expected to beat it), the largest per-rank
memory error, and whether each round's predicted
best ran within 5% of the fastest. Figures go to benchmarks/README.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from meshsplit.cli.compare import CompareConfig, accuracy, compare

STEPS = 14
"""Steps per plan and round: two untimed, and a median of 12."""

ROUNDS = 2
"""Runs of every plan, minutes apart: one run's median of the same plan moved by 10-50%
between runs here (4 workers time-sliced on 2 cores most)."""


def _mape(predicted: dict[str, float], measured: dict[str, float]) -> float:
    return statistics.mean(abs(predicted[p] - measured[p]) / measured[p] for p in measured)


def _case(model: str, devices: int) -> dict[str, Any]:
    """Every plan of `model` on `devices` workers, ROUNDS times; the scores."""
    config = CompareConfig(model=model, devices=devices, steps=STEPS)
    rounds = []
    for _ in range(ROUNDS):
        rows = [r for r in compare(config, show=False) if "refused" not in r]
        rounds.append(rows)
    plans = [r["plan"] for r in rounds[0] if "predicted_step_s" in r]
    step = [{r["plan"]: r["step_s"] for r in rows} for rows in rounds]
    predicted = [{r["plan"]: r["predicted_step_s"] for r in rows if r["plan"] in plans}
                 for rows in rounds]  # fmt: skip
    measured = {p: statistics.mean(s[p] for s in step) for p in plans}
    fastest = min(measured.values())
    chosen = [min(plans, key=lambda p: guess[p]) for guess in predicted]
    return {
        "model": model,
        "devices": devices,
        "step_time_mape": statistics.mean(_mape(guess, measured) for guess in predicted),
        "own_round_mape": [_mape(guess, run) for guess, run in zip(predicted, step, strict=True)],
        "round_to_round": _mape({p: step[-1][p] for p in plans}, {p: step[0][p] for p in plans}),
        "largest_memory_error": max(accuracy(rows)["largest_memory_error"] for rows in rounds),
        "predicted_best": chosen,
        "measured_best": min(plans, key=lambda p: measured[p]),
        "within_5pct": [measured[p] <= 1.05 * fastest for p in chosen],
        "plans": [(p, measured[p], [s[p] for s in step], [g[p] for g in predicted]) for p in plans],
    }


def main() -> None:
    results = []
    models = sys.argv[1:] or ["mlp", "cnn", "transformer"]
    for model in models:
        for devices in (2, 4):
            case = _case(model, devices)
            results.append(case)
            print(
                f"{model:12s} {devices} workers: MAPE {100 * case['step_time_mape']:5.1f}%  "
                f"each against its own round "
                f"{' / '.join(f'{100 * m:4.1f}%' for m in case['own_round_mape'])}  "
                f"round to round {100 * case['round_to_round']:5.1f}%  memory error "
                f"{100 * case['largest_memory_error']:4.1f}%  measured best "
                f"{case['measured_best']:22s} predicted best within 5%: {case['within_5pct']}",
                flush=True,
            )
            for plan, mean, runs, guesses in case["plans"]:
                print(f"    {plan:24s} measured {' / '.join(f'{s * 1e3:6.1f}' for s in runs)} "
                      f"(mean {mean * 1e3:6.1f}) ms  predicted "
                      f"{' / '.join(f'{g * 1e3:6.1f}' for g in guesses)} ms")  # fmt: skip
    hits = [hit for r in results for hit in r["within_5pct"]]
    own = [statistics.mean(r["own_round_mape"][k] for r in results) for k in range(ROUNDS)]
    print(
        f"overall: mean MAPE {100 * statistics.mean(r['step_time_mape'] for r in results):.1f}% "
        f"(each round against its own run: {' / '.join(f'{100 * m:.1f}%' for m in own)}) "
        f"(round to round {100 * statistics.mean(r['round_to_round'] for r in results):.1f}%), "
        f"predicted best within 5% in {sum(hits)}/{len(hits)} predictions "
        f"({len(results)} cases x {ROUNDS} rounds)"
    )
    out = Path(__file__).parent / "results" / "planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
