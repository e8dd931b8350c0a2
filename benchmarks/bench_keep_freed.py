"""Workers that keep the heap memory they free (job/allocator.py) against workers that hand it
back to the system (MESHSPLIT_KEEP_FREED_MEMORY=0, glibc's own behaviour): step time and peak
resident memory, the same plan in fresh workers each way, the order alternating.

    PYTHONPATH=src python benchmarks/bench_keep_freed.py [--repeats 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
from typing import Any

from bench_planner_unseen import MODELS, _model, _optimizer

import meshsplit as ms

from rounds import median_step

CASES: list[tuple[str, dict[str, Any]]] = [
    ("gpt2", {"dp": 2}),
    ("gpt2", {"tp": 2}),
    ("gpt2", {"pp": 2, "micro_batches": 4}),
    ("resnet", {"dp": 2}),
    ("resnet", {"pp": 2, "micro_batches": 4}),
    ("wide_mlp", {"dp": 2}),
    ("wide_mlp", {"pp": 2, "micro_batches": 8}),
]


def _run(name: str, plan: ms.Plan, steps: int) -> tuple[float, int]:
    """Runs in every worker: the median step after three untimed ones, and peak RSS (MiB)."""
    inputs, targets = MODELS[name][1]()
    engine = ms.parallelize(_model(name), plan, optimizer=_optimizer, loss_fn=MODELS[name][2]())
    engine.memory.track = False
    seconds = median_step(lambda: engine.train_step(inputs, targets), steps, untimed=3)
    engine.close()
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _launch(name: str, plan: ms.Plan, steps: int, keep: bool) -> tuple[float, int]:
    os.environ["MESHSPLIT_KEEP_FREED_MEMORY"] = "1" if keep else "0"
    ranks = ms.launch(_run, plan.world_size, args=(name, plan, steps))
    return max(r[0] for r in ranks), max(r[1] for r in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print("| model | plan | handed back ms | kept ms | kept / handed back | peak RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, shape in CASES:
        plan = ms.Plan(**shape)
        runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
        for index in range(args.repeats):
            for keep in (False, True) if index % 2 == 0 else (True, False):
                runs[keep].append(_launch(name, plan, args.steps, keep))
        back, kept = (statistics.median(t for t, _ in runs[k]) for k in (False, True))
        rss = [max(m for _, m in runs[k]) for k in (False, True)]
        print(f"| {name} | {plan.describe()} | {back * 1e3:.1f} | {kept * 1e3:.1f} | "
              f"{kept / back:.2f} | {rss[0]} / {rss[1]} |", flush=True)  # fmt: skip
    os.environ.pop("MESHSPLIT_KEEP_FREED_MEMORY")


if __name__ == "__main__":
    main()
