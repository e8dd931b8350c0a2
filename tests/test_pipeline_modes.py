"""Layer split of a model whose blocks pass other values when evaluating than when training.

RWKV's blocks hand each other a recurrent state only when evaluating (its forward caches by
default then): the block front end checked its cuts evaluating with what the pieces returned
training, so every cut between blocks failed and one stage held all of them. Cuts now count
when they keep the output in either mode, and a stubbed piece answers as it did in the mode
it runs in. A stand-in with the same pattern and, where transformers is installed, RWKV itself
are cut between their blocks, train equal to one process and predict what the model does.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit.pipeline.cuts import find_cuts

from reference import train_plainly

VOCAB, DIM, DEPTH, SEQ = 32, 16, 4, 6
RTOL, ATOL = 1e-4, 1e-5


class StateBlock(nn.Module):
    """Adds its mix to the stream; records its output's mean in the state when given one."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm, self.mix = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = x + torch.tanh(self.mix(self.norm(x)))
        if state is not None:
            state = state.clone()
            state[:, self.index] = out.mean(dim=1)
        return out, state


class CachesWhenEvaluating(nn.Module):
    """RWKV's pattern: a state passes from block to block only when evaluating."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(StateBlock(k) for k in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        state = None if self.training else x.new_zeros(ids.shape[0], DEPTH, DIM)
        for block in self.blocks:
            x, state = block(x, state)
        return self.head(x)


def _rwkv() -> nn.Module:
    import transformers

    from hf_models import Wrap  # (imports transformers: only where it is installed)

    config = transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=DEPTH, intermediate_size=2 * DIM
    )
    return Wrap(transformers.RwkvForCausalLM(config))


MODELS = {"stand-in": CachesWhenEvaluating, "rwkv": _rwkv}
INSTALLED = [n for n in MODELS if n != "rwkv" or importlib.util.find_spec("transformers")]


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (24, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (24, SEQ), generator=g)
    return list(zip(x.split(8), y.split(8), strict=True))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("name", INSTALLED)
def test_cuts_fall_between_blocks_that_pass_a_state_only_when_evaluating(name: str) -> None:
    cuts = find_cuts(_build(name), _batches()[0][0], ms.Plan(pp=4), agree=list)
    blocks = [n for n in cuts.names if ".blocks." in n or n.startswith("blocks.")]
    starts = [cuts.names[sum(cuts.sizes[:k])] for k in range(1, 4)]
    assert len(blocks) == DEPTH and all(s in blocks for s in starts[1:]), (starts, cuts.sizes)


def _parallel(names: list[str]) -> list[dict[str, Any]]:
    results = []
    for name in names:
        engine = ms.parallelize(
            _build(name),
            ms.Plan(pp=2, micro_batches=2),
            optimizer=_sgd,
            loss_fn=ms.models.TokenCrossEntropy(),
        )
        losses = [engine.train_step(x, y) for x, y in _batches()]
        stages = [stage["layers"] for stage in engine.describe()["stages"]]
        predicted = engine.predict(_batches()[0][0])
        results.append({"losses": losses, "state": engine.full_state_dict(), "stages": stages,
                        "predicted": predicted})  # fmt: skip
        engine.close()
    return results


@pytest.mark.timeout(300)
def test_trains_equal_to_one_process_and_predicts_under_pp2() -> None:
    per_rank = ms.launch(_parallel, 2, args=(INSTALLED,), timeout_s=200)
    for index, name in enumerate(INSTALLED):
        model = _build(name)
        want_losses, want_state = train_plainly(
            model, _sgd(model.parameters()), ms.models.TokenCrossEntropy(), _batches()
        )
        with torch.no_grad():
            want_output = model.eval()(_batches()[0][0])
        for rank, results in enumerate(per_rank):
            got, where = results[index], f"{name} rank {rank}"
            first, second = got["stages"]
            assert sum(".blocks." in n or n.startswith("blocks.") for n in first) >= 1, where
            assert sum(".blocks." in n or n.startswith("blocks.") for n in second) >= 1, where
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL
            )
            for key, value in want_state.items():
                torch.testing.assert_close(
                    got["state"][key], value, rtol=RTOL, atol=ATOL, msg=f"{where} {key}"
                )
            torch.testing.assert_close(got["predicted"], want_output, rtol=RTOL, atol=ATOL)
