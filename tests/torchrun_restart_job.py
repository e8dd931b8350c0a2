"""A user script under torchrun --max-restarts: rank 1 of the first generation dies at a chosen
step; the next generation's fit resumes from the latest checkpoint by itself."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms


def main(checkpoints: str, die_at: int) -> None:
    calls = 0

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_generation and dist.get_rank() == 1 and calls == die_at:
            os._exit(1)  # a machine lost mid-epoch: no error, no save
        return nn.functional.cross_entropy(output, target)

    torch.manual_seed(0)
    engine = ms.parallelize(
        ms.models.mlp((784, 32, 10)),
        ms.Plan(dp=dist.get_world_size()),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        loss_fn=loss_fn,
    )
    engine.fit(
        ms.data.digits("train"), epochs=3, batch_size=64, checkpoint_dir=checkpoints, show=False
    )
    engine.close()


if __name__ == "__main__":
    ms.launch(main, nprocs=2, args=(sys.argv[1], int(sys.argv[2])))
