"""Layer split of a Hugging Face LLaMA: meshsplit's block front end against torch's pipeline().

Same model (LlamaForCausalLM from a config, random weights, no cache), same cut (before
`m.model.layers.4`: meshsplit's `Plan.split_points`, torch's `split_spec`), same GPipe
schedule and micro-batches, same SGD, 2 local workers with 1 thread each. meshsplit runs the
model's own forward on each stage with the other stage's blocks stubbed; torch traces it with
torch.export and splits the graph. The runs take turns within each round (A B B A across
rounds); the median round is reported. Prints samples/s and the ratio ours/theirs, or why
torch could not split the model.

    PYTHONPATH=src python benchmarks/bench_nested_split.py [--batch 32 --micro-batches 4]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

import meshsplit as ms

from causal_lm import LlamaLM
from rounds import take_turns

STAGES = 2
CUT = "m.model.layers.4"
VOCAB, SEQ = 512, 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return LlamaLM(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _theirs(x: torch.Tensor, micro: int) -> Callable[..., None]:
    """torch.distributed.pipelining: pipeline() on one micro-batch, this rank's stage, GPipe."""
    rank = dist.get_rank()
    pipe = pipeline(
        _model(), mb_args=(x[: len(x) // micro],), split_spec={CUT: SplitPoint.BEGINNING}
    )
    stage = pipe.build_stage(rank, torch.device("cpu"))
    runner = ScheduleGPipe(stage, n_microbatches=micro, loss_fn=ms.models.TokenCrossEntropy())
    optimizer = _optimizer(stage.submod.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad()

    return step


def _worker(batch: int, micro: int, steps: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = ms.data.synthetic_tokens(batch, seq_len=SEQ, vocab_size=VOCAB, seed=0)
    plan = ms.Plan(pp=STAGES, micro_batches=micro, schedule="gpipe", split_points=(CUT,))
    ours = ms.parallelize(
        _model(), plan, optimizer=_optimizer, loss_fn=ms.models.TokenCrossEntropy(),
        example_inputs=x[: batch // micro],
    )  # fmt: skip
    runs: dict[str, Callable[[], Any]] = {"meshsplit": lambda: ours.train_step(x, y)}
    refused = ""
    try:
        theirs = _theirs(x, micro)
        runs["torch"] = lambda: theirs(x, y)
    except Exception as error:  # torch.export or the split failed: say so, measure ours
        refused = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    times = take_turns(runs, rounds, steps)
    stages = [s["layers"] for s in ours.describe()["stages"]]
    ours.close()
    return {"times": times, "refused": refused, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = ms.launch(
        _worker, STAGES, args=(args.batch, args.micro_batches, args.steps, args.rounds)
    )[0]
    median = {name: statistics.median(values) for name, values in result["times"].items()}
    console = Console()
    table = Table(
        title=f"LLaMA (8 blocks, d=128) layer split, pp={STAGES}, gpipe, "
        f"m={args.micro_batches}, batch {args.batch}x{SEQ}, cut before {CUT}"
    )
    for column in ("meshsplit samples/s", "torch samples/s", "ours/theirs"):
        table.add_column(column, justify="right")
    ours = median["meshsplit"]
    if "torch" in median:
        theirs = median["torch"]
        table.add_row(
            f"{args.batch / ours:.1f}", f"{args.batch / theirs:.1f}", f"{theirs / ours:.2f}"
        )
    else:
        table.add_row(f"{args.batch / ours:.1f}", "refused", "-")
    console.print(table)
    if result["refused"]:
        console.print(f"torch.distributed.pipelining could not split it: {result['refused']}")
    for index, layers in enumerate(result["stages"]):
        console.print(f"meshsplit stage {index}: {' '.join(layers)}")


if __name__ == "__main__":
    main()
