"""Grouped-query attention with fewer kv heads than tp ranks: the query heads split, the kv
heads are shared by the ranks whose query heads read them (tensor/shared_heads.py).

LLaMA with 2 kv heads under tp=4, and with one kv head (multi-query) under tp=2, dp2 x tp2 with
ZeRO 2 and pp2 x tp2 (zero bubble), train 3 SGD steps exactly as one process, and each rank
holds its query heads' share of the attention: the kv weights are the only whole ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshsplit as ms

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, Wrap  # noqa: E402
from reference import assert_matches, train_plainly  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
ATTENTION = "m.model.layers.0.self_attn"


def _llama(kv_heads: int) -> Wrap:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
    )  # fmt: skip
    return Wrap(transformers.LlamaForCausalLM(config))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (3, 8, 9), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


LAUNCHES: dict[int, list[tuple[int, ms.Plan, float]]] = {
    # (kv heads, plan, the most a rank may hold of the model's weights)
    4: [
        (2, ms.Plan(tp=4), 0.36),  # whole attention (tp does not divide 2): 0.48
        (1, ms.Plan(dp=2, tp=2, zero=2), 0.29),
        (1, ms.Plan(pp=2, tp=2, micro_batches=2, schedule="zero-bubble"), 0.29),
    ],
    2: [(1, ms.Plan(tp=2), 0.56)],  # whole attention (one kv head): 0.63
}


def _run(cases: list[tuple[int, ms.Plan, float]]) -> list[dict[str, Any]]:
    results = []
    for kv_heads, plan, _ in cases:
        engine = ms.parallelize(
            _llama(kv_heads), plan, optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy()
        )
        losses = [engine.train_step(x, y) for x, y in _batches()]
        local = engine.runner.local_state_dict()
        results.append(
            {
                "losses": losses,
                "state": engine.full_state_dict(),
                # shapes on this tp rank (a ZeRO shard's DTensor has its shape before dp)
                "local": {k: v.shape for k, v in local.items() if k.startswith(ATTENTION)},
                "held": engine.memory_report().parameter_bytes,
            }
        )
        engine.close()
    return results


def _expected(kv_heads: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    model = _llama(kv_heads)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    losses, state = train_plainly(
        model, _sgd(model.parameters()), ms.models.TokenCrossEntropy(), _batches()
    )
    return losses, state, whole


def _check(cases: list[tuple[int, ms.Plan, float]], per_rank: list[list[dict[str, Any]]]) -> None:
    for index, (kv_heads, plan, share) in enumerate(cases):
        want_losses, want_state, whole = _expected(kv_heads)
        got = [results[index] for results in per_rank]
        case = f"{kv_heads} kv heads, {plan.describe()}"
        runs = [(run["losses"], run["state"]) for run in got]
        assert_matches(runs, (want_losses, want_state), rtol=RTOL, atol=ATOL, case=case)
        for rank, run in enumerate(got):
            where = f"{case}, rank {rank}"
            if run["local"]:  # a rank of the stage holding the first block
                q = run["local"][f"{ATTENTION}.q_proj.weight"]
                k = run["local"][f"{ATTENTION}.k_proj.weight"]
                assert q[0] * plan.tp == 32, where  # its query heads only
                assert k[0] == 8 * kv_heads, where  # the kv heads whole, shared
            assert run["held"] < share * whole, (where, run["held"] / whole)


@pytest.mark.timeout(600)
def test_kv_heads_fewer_than_tp_ranks_are_shared_and_training_matches_one_process() -> None:
    for workers, cases in LAUNCHES.items():
        _check(cases, ms.launch(_run, workers, args=(cases,), timeout_s=300))
