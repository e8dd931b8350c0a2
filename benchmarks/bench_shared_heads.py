"""Grouped-query attention with fewer kv heads than tp ranks: kv heads shared against the
attention kept whole.

LlamaForCausalLM from a config (8 query heads, 2 kv heads) under tp=4 on 4 workers x 1
thread: meshsplit's default splits the query heads and o over the 4 ranks and shares each kv
head between 2 of them (k and v whole, gradients summed over tp); the alternative, what a
split that must divide the kv heads does (torch's ColwiseParallel on k_proj cannot cut 2
heads in 4), keeps q/k/v/o whole on every rank (`Plan.tp_plan` 'replicate'), the MLP split
in both. Same model, batch and SGD; the two engines take turns in rounds (A B B A), the
median round reported, with each rank's parameter bytes and live-tensor peak.

    PYTHONPATH=src python benchmarks/bench_shared_heads.py [--rounds 6 --steps 3]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import meshsplit as ms

from causal_lm import LlamaLM
from rounds import take_turns

VOCAB, SEQ, BATCH, LAYERS = 512, 64, 16, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return LlamaLM(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip


def _plans() -> dict[str, ms.Plan]:
    attention = [f"m.model.layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkvo"]
    return {
        "kv heads shared": ms.Plan(tp=4),
        "attention whole": ms.Plan(tp=4, tp_plan=dict.fromkeys(attention, "replicate")),
    }


def _worker(rounds: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    engines = {}
    for name, plan in _plans().items():
        engines[name] = ms.parallelize(
            _model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
    times = take_turns(
        {name: (lambda e=e: e.train_step(x, y)) for name, e in engines.items()}, rounds, steps
    )
    result = {}
    for name, engine in engines.items():
        report = engine.memory_report()
        result[name] = {
            "ms": 1000 * statistics.median(times[name]),
            "parameters": report.parameter_bytes,
            "peak": report.tensor_peak_bytes,
        }
        engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    per_rank = ms.launch(_worker, 4, args=(args.rounds, args.steps), timeout_s=900)
    whole = sum(p.numel() * p.element_size() for p in _model().parameters())
    table = Table(title=f"LLaMA, 8 heads / 2 kv heads, tp=4 (weights {whole / 2**20:.2f} MiB)")
    for column in ("split", "step ms", "x whole", "weights/rank MiB", "share", "peak MiB"):
        table.add_column(column)
    base = statistics.median(rank["attention whole"]["ms"] for rank in per_rank)
    for name in _plans():
        step = statistics.median(rank[name]["ms"] for rank in per_rank)
        held = max(rank[name]["parameters"] for rank in per_rank)
        peak = max(rank[name]["peak"] for rank in per_rank)
        table.add_row(
            name, f"{step:.1f}", f"{step / base:.2f}", f"{held / 2**20:.2f}",
            f"{held / whole:.2f}", f"{peak / 2**20:.2f}",
        )  # fmt: skip
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
