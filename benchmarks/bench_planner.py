"""The planner's predictions against real runs: step time and memory per plan, and the choice.

For each reference model on 2 and 4 workers, `meshsplit compare` runs every dp x pp x tp
plan for real and the planner predicts each beside it (same model, batch and machine).
Printed per (model, workers): the step-time MAPE, the largest per-rank memory error, the
predicted and the measured best plan, and whether the predicted best ran within 5% of the
fastest. Figures go to benchmarks/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshsplit.cli.compare import CompareConfig, accuracy, compare

STEPS = 14
"""Steps per plan: two untimed, and a median of 12 (one plan's median of 6 moved by 20-30%
between runs here)."""


def main() -> None:
    results = []
    models = sys.argv[1:] or ["mlp", "cnn", "transformer"]
    for model in models:
        for devices in (2, 4):
            config = CompareConfig(model=model, devices=devices, steps=STEPS)
            rows = compare(config, show=False)
            figures = accuracy(rows)
            per_plan = [
                (row["plan"], row["step_s"], row.get("predicted_step_s"))
                for row in rows
                if "refused" not in row
            ]
            results.append({"model": model, "devices": devices, **figures, "plans": per_plan})
            print(
                f"{model:12s} {devices} workers: MAPE {100 * figures['step_time_mape']:5.1f}%  "
                f"memory error {100 * figures['largest_memory_error']:4.1f}%  predicted best "
                f"{figures['predicted_best']:22s} measured best {figures['measured_best']:22s} "
                f"within 5%: {figures['predicted_best_within_5pct']}",
                flush=True,
            )
            for plan, measured, predicted in per_plan:
                print(f"    {plan:24s} measured {measured * 1e3:7.1f} ms  predicted "
                      f"{(predicted or 0) * 1e3:7.1f} ms")  # fmt: skip
    hits = sum(r["predicted_best_within_5pct"] for r in results)
    mape = sum(r["step_time_mape"] for r in results) / len(results)
    print(
        f"overall: mean MAPE {100 * mape:.1f}%, predicted best within 5% in {hits}/{len(results)}"
    )
    out = Path(__file__).parent / "results" / "planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
