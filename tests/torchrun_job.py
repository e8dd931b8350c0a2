"""A user script run under torchrun: ms.launch joins the job instead of spawning workers."""

import json
import os
import sys

import torch
import torch.distributed as dist

import meshsplit as ms


def main() -> dict:
    torch.manual_seed(0)
    engine = ms.parallelize(ms.models.mlp((784, 16, 10)), ms.Plan(dp=dist.get_world_size()))
    loss = engine.train_step(*ms.data.synthetic_images(8))
    engine.close()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "loss": loss}


if __name__ == "__main__":
    results = ms.launch(main, nprocs=99)  # nprocs is ignored: torchrun decides the world
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as out:
            json.dump(results, out)
