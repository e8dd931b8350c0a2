"""One user script for one machine and for two: `ms.launch(main, nprocs=4)` spawns 4 local
workers, and the same launch under two torchrun agents of 2 workers each joins their job.
Several plans run in a row under one launch, each a few SGD-with-momentum steps on a small MLP;
`summary` keeps every plan's losses and final parameters, and where each rank ran."""

import os
import sys

import torch
import torch.distributed as dist

import meshsplit as ms

PLANS = {
    "dp4": ms.Plan(dp=4),
    "dp2 x pp2": ms.Plan(dp=2, pp=2, micro_batches=2, split_points=("fc2",)),
    "dp2 x tp2": ms.Plan(dp=2, tp=2),
    "pp2 x tp2": ms.Plan(pp=2, tp=2, micro_batches=2, split_points=("fc2",)),
}
STEPS = 3


def main() -> dict:
    batches = [ms.data.synthetic_images(16, image_size=8, seed=step) for step in range(STEPS)]
    runs = {}
    for name, plan in PLANS.items():
        torch.manual_seed(0)
        engine = ms.parallelize(
            ms.models.mlp((64, 32, 32, 10)),
            plan,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            loss_fn=torch.nn.CrossEntropyLoss(),
        )
        losses = [engine.train_step(*batch) for batch in batches]
        runs[name] = {"losses": losses, "state": engine.full_state_dict()}
        engine.close()
    where = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "node": int(os.environ.get("GROUP_RANK", 0)),  # torchrun's agent (node) index
        "net_namespace": os.stat("/proc/self/ns/net").st_ino,
    }
    return {"where": where, "runs": runs if dist.get_rank() == 0 else None}


def summary(results: list[dict]) -> dict:
    """Rank 0's runs (every rank ends with the same full parameters) and every rank's place."""
    return {"where": [result["where"] for result in results], "runs": results[0]["runs"]}


if __name__ == "__main__":
    results = ms.launch(main, nprocs=4, timeout_s=60)  # under torchrun: torchrun's world
    if os.environ.get("RANK", "0") == "0":  # torchrun's rank 0, or this (launching) process
        torch.save(summary(results), sys.argv[1])
