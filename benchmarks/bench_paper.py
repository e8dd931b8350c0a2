"""Paper mode against Megatron-LM's published Table 1 (Narayanan et al. 2021, arXiv:2104.04473).

For each of the ten GPT models (1.7B to 1008B parameters on 32 to 3072 A100 GPUs) it prints
the published layout (t, p, d) and TFLOP/s per GPU, meshsplit's prediction for that layout
(with the micro-batch and interleave the model finds best for it) and its error, the layout
the planner chooses for the same model, GPUs and batch, and, when the choice differs, the one
sentence saying which term lost the published layout. Pure arithmetic: no GPU is needed.

    python benchmarks/bench_paper.py [--cluster dgx-a100] [--calibrate]

--calibrate fits the one global constant, `paper.KERNEL_EFFICIENCY`, to all ten rows at once
(least squares on log(predicted / published)) and prints it; nothing is fitted per row.
"""

from __future__ import annotations

import argparse
import math

from meshsplit.plan import PlanError
from meshsplit.planner import paper
from meshsplit.planner.cluster import Cluster, load_cluster
from meshsplit.planner.megatron_table import MegatronRow, megatron_table


def published(row: MegatronRow, cluster: Cluster) -> paper.Prediction | None:
    """The prediction for the published mesh (best micro-batch and interleave)."""
    try:
        ranking = paper.best_layout(
            row.model(), cluster, row.gpus, row.batch, mesh=(row.tp, row.pp, row.dp)
        )
    except PlanError:
        return None
    return ranking.best


def log_error(cluster: Cluster) -> float:
    """Mean squared log(predicted / published) over the table."""
    errors = []
    for row in megatron_table():
        guess = published(row, cluster)
        errors.append(math.log(guess.tflops_per_gpu / row.tflops) if guess else 10.0)
    return sum(e * e for e in errors) / len(errors)


def calibrate(cluster: Cluster) -> float:
    """Golden-section search of KERNEL_EFFICIENCY in [0.5, 1.0] for the least log error."""
    low, high = 0.5, 1.0
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        left, right = high - ratio * (high - low), low + ratio * (high - low)
        paper.KERNEL_EFFICIENCY = left
        at_left = log_error(cluster)
        paper.KERNEL_EFFICIENCY = right
        at_right = log_error(cluster)
        if at_left < at_right:
            high = right
        else:
            low = left
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="dgx-a100", help="shipped name or JSON file")
    parser.add_argument("--calibrate", action="store_true", help="fit KERNEL_EFFICIENCY first")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    if args.calibrate:
        shipped = paper.KERNEL_EFFICIENCY
        fitted = calibrate(cluster)
        paper.KERNEL_EFFICIENCY = fitted
        print(
            f"fitted KERNEL_EFFICIENCY = {fitted:.4f} (rms log error "
            f"{math.sqrt(log_error(cluster)):.4f}); paper.py ships {shipped:.4f}"
        )
    print(
        f"cluster {cluster.name}: {cluster.peak_flops('fp16') / 1e12:.0f} TFLOP/s fp16 peak, "
        f"matmul_efficiency {cluster.matmul_efficiency}, KERNEL_EFFICIENCY "
        f"{paper.KERNEL_EFFICIENCY:.3f}, {cluster.memory_bytes / 1e9:.0f} GB per GPU"
    )
    if cluster.name != "dgx-a100":
        print(
            "note: the published figures were measured on DGX A100; on this cluster the "
            "error column compares different hardware"
        )
    header = (
        "model",
        "published t,p,d",
        "TFLOP/s",
        "predicted",
        "error",
        "with",
        "planner choice",
        "TFLOP/s",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    within, reasons = 0, []
    for row in megatron_table():
        ranking = paper.best_layout(row.model(), cluster, row.gpus, row.batch)
        mine = published(row, cluster)
        best = ranking.best
        if mine is None:
            cells = ["does not fit", "", ""]
        else:
            error = (mine.tflops_per_gpu / row.tflops - 1) * 100
            within += abs(error) <= 20
            cells = [
                f"{mine.tflops_per_gpu:.1f}",
                f"{error:+.1f}%",
                f"b{mine.layout.micro_batch} v{mine.layout.interleave}",
            ]
        same = best.layout.mesh == (row.tp, row.pp, row.dp)
        choice = "same" if same else best.layout.describe()
        print(
            f"| {row.name} | {row.tp},{row.pp},{row.dp} | {row.tflops:.0f} | "
            + " | ".join(cells)
            + f" | {choice} | {best.tflops_per_gpu:.1f} |"
        )
        if not same:
            losing = mine if mine is not None else ranking.infeasible[0]
            reasons.append(f"- {row.name}: {ranking.why(losing)}")
    print(f"\n{within} of {len(megatron_table())} rows predicted within 20%")
    if reasons:
        print("\nWhere the planner chooses another layout:")
        print("\n".join(reasons))


if __name__ == "__main__":
    main()
