"""Hybrid plans: the transformer on 4 workers under every dp x pp x tp plan, side by side.

The same runs as `meshsplit compare --model transformer --devices 4`: each plan trains the
same batches from the same weights; the table shows samples/s (and the ratio to the best
plan), peak memory per rank, bytes sent per step and whether the loss matched one process.
Writes compare.json/.md/.png to --out (default benchmarks/results/hybrid, the figure the
README shows). Run: python benchmarks/bench_hybrid.py [--steps S] [--batch-size B]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from meshsplit.cli import compare_report
from meshsplit.cli.compare import CompareConfig, compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hybrid")
    args = parser.parse_args()
    config = CompareConfig(
        model="transformer", devices=4, steps=args.steps, batch_size=args.batch_size
    )
    rows = compare(config)
    console = Console(width=120)
    console.print(compare_report.table(config, rows))
    for path in compare_report.write(config, rows, args.out):
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
