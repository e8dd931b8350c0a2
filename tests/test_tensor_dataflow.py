"""The data-flow pair search in one process: which pairs it takes, which it refuses and why,
and how many forwards it runs to decide (all pairs are checked at once when they pass)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from meshsplit.tensor import dataflow, probe

WIDTH = 16


class Block(nn.Module):
    """x + fc2(relu(fc1(x))): fc1|fc2 is a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class NormedBlock(Block):
    """A LayerNorm over fc1's whole output: fc1 reaches the output only through fc2, but a
    split fc1 feeds the norm half its features, so the simulated split fails."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.norm(self.fc1(x)))


class LeakyBlock(Block):
    """Its pair sums right, but the block reads its head count after fc2, where a rank
    would hold 1/tp of it: splitting it changes the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x))) * self.num_heads


def _model(*blocks: type[Block]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(block() for block in blocks))


def _found(model: nn.Module, tp: int = 2) -> tuple[list[str], dict[str, str]]:
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    pairs, refused, _ = dataflow.find_pairs(model, torch.randn(4, WIDTH), layers, tp)
    return [p.row for p in pairs], {r.names[-1]: r.reason for r in refused}


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of model forwards the search runs, counted as it goes."""
    count = [0]
    original = probe.outputs

    def counted(*args: Any) -> list[torch.Tensor]:
        count[0] += 1
        return original(*args)

    monkeypatch.setattr(probe, "outputs", counted)
    monkeypatch.setattr(dataflow, "outputs", counted)
    return count


@pytest.mark.parametrize("tp", [2, 4])
def test_pairs_that_pass_together_take_a_forward_per_layer_and_one_per_rank(
    tp: int, forwards: list[int]
) -> None:
    rows, refused = _found(_model(Block, Block, Block, Block), tp)
    assert rows == ["0.fc2", "1.fc2", "2.fc2", "3.fc2"] and refused == {}
    # the clean trace, one perturbed forward per layer, then one simulated forward per rank
    # (one pair at a time took 28 forwards at tp=2 and 36 at tp=4 here)
    assert forwards[0] == 1 + 8 + tp


def test_a_pair_that_fails_in_the_middle_is_refused_and_the_others_taken(
    forwards: list[int],
) -> None:
    rows, refused = _found(_model(Block, NormedBlock, Block, NormedBlock, Block))
    assert rows == ["0.fc2", "2.fc2", "4.fc2"]
    assert list(refused) == ["1.fc2", "3.fc2"]
    assert all(reason.startswith("split check failed (RuntimeError") for reason in refused.values())
    # trace and 10 perturbed; all at once (2), block 1 alone (fails in its first forward);
    # blocks 0, 2, 3, 4 at once (2), block 3 alone (1); block 4 alone (2 ranks, 1 leak check).
    # One pair at a time took 31; counting the one at fault from the wrong end, 29.
    assert forwards[0] == 11 + 2 + 1 + 2 + 1 + 3


@pytest.mark.parametrize("blocks", [(Block, LeakyBlock, Block), (LeakyBlock, Block, Block)])
def test_a_pair_that_changes_the_output_is_refused_wherever_it_is(
    blocks: tuple[type[Block], ...],
) -> None:
    leaky = blocks.index(LeakyBlock)
    rows, refused = _found(_model(*blocks))
    assert rows == [f"{i}.fc2" for i in range(3) if i != leaky]
    assert refused == {
        f"{leaky}.fc2": "split together with the others: it changes values outside the pair"
    }
