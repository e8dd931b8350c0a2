"""Single-process PyTorch training: the ground truth every strategy must match."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import meshsplit as ms

RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    # Adam divides by sqrt(v) + eps, so a gradient that cancels to ~0 turns float summation-order
    # noise (any split of the batch has it) into a visible update; eps=1e-6 bounds that gain.
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01),
}


class HeadNormAttention(nn.Module):
    """Qwen3's attention in small: each head's query normalised by a norm kept whole, between
    q and o (the tp split sums that norm's gradients over tp)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o, self.q_norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.q(x).unflatten(-1, (-1, 4))
        return x + self.o(self.q_norm(heads).flatten(-2))


class SkipMLP(nn.Module):
    """Not an nn.Sequential: the first layer's output skips three layers to the head's input."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.inp = nn.Linear(784, 32)
        self.b1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.b2 = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.b3 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.flatten(x))
        return self.head(torch.relu(self.b3(self.b2(self.b1(h))) + h))


class TokenMixing(nn.Module):
    """LayerNorm, Linear 128->512, GELU, Linear 512->128, with a residual: under tp a column
    and a row split with one all-reduce each way, under pp a stage holding whole blocks."""

    def __init__(self, width: int = 128, hidden: int = 512) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LoopsOverBlocks(nn.Module):
    """A recurrent-depth model (as Hugging Face's Dory): blocks 1 and 2 run twice in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](self.emb(ids)))
        for _ in range(2):
            for block in self.blocks[1:3]:
                x = torch.tanh(block(x))
        return self.head(torch.tanh(self.blocks[3](x)))


def token_mixing() -> nn.Sequential:
    """The token mixer of the memory checks: embedding 256 x 128, four blocks, a head."""
    blocks = [(f"block{i}", TokenMixing()) for i in range(4)]
    layers = [("embed", nn.Embedding(256, 128)), *blocks, ("head", nn.Linear(128, 256))]
    return nn.Sequential(OrderedDict(layers))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": ms.models.mlp,
    "cnn": ms.models.cnn,
    "small_mlp": lambda: ms.models.mlp((784, 64, 32, 16, 10)),
    "skip_mlp": SkipMLP,
    "transformer": lambda: ms.models.transformer(
        vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=8
    ),
}


def build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model_name]()


def loss_for(model_name: str) -> nn.Module:
    return ms.models.TokenCrossEntropy() if model_name == "transformer" else nn.CrossEntropyLoss()


def batches(model_name: str, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed global batches, the same in every process."""
    if model_name == "transformer":
        x, y = ms.data.synthetic_tokens(batch * steps, seq_len=8, vocab_size=64, seed=1)
    else:
        x, y = ms.data.synthetic_images(batch * steps, seed=1)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def train_plainly(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    steps: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A plain PyTorch loop over `steps` (global batches) in this process: the losses and a
    copy of the final state."""
    losses = []
    for x, y in steps:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_single(
    model_name: str, optimizer: str, batch: int = 16, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final state of plain training in this process."""
    model = build(model_name)
    return train_plainly(
        model,
        OPTIMIZERS[optimizer](model.parameters()),
        loss_for(model_name),
        batches(model_name, batch, steps),
    )


def train_parallel(
    model_name: str, optimizer: str, plan: ms.Plan, batch: int = 16, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training through meshsplit; runs inside every worker."""
    engine = ms.parallelize(
        build(model_name), plan, optimizer=OPTIMIZERS[optimizer], loss_fn=loss_for(model_name)
    )
    losses = [engine.train_step(x, y) for x, y in batches(model_name, batch, steps)]
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def _gpt2_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (24, 8), generator=g)
    y = torch.randint(0, 64, (24, 8), generator=g)
    return list(zip(x.split(8), y.split(8), strict=True))


def train_gpt2(plan: ms.Plan | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A Hugging Face GPT-2 (tied embedding and head) trained 3 SGD steps, under `plan`
    (inside a worker) or in this process (None)."""
    from hf_models import gpt2

    torch.manual_seed(0)
    model, loss_fn = gpt2(), ms.models.TokenCrossEntropy()
    if plan is None:
        return train_plainly(model, OPTIMIZERS["sgd"](model.parameters()), loss_fn, _gpt2_batches())
    engine = ms.parallelize(model, plan, optimizer=OPTIMIZERS["sgd"], loss_fn=loss_fn)
    losses = [engine.train_step(x, y) for x, y in _gpt2_batches()]
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def assert_each_case(
    per_rank: list[list[tuple[list[float], dict[str, torch.Tensor]]]],
    cases: list[dict[str, Any]],
    expected: tuple[list[float], dict[str, torch.Tensor]],
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    label: str = "",
) -> None:
    """Every rank's run of each case (its results in `cases`' order) equals the
    single-process run; a failure names the case."""
    for index, options in enumerate(cases):
        got = [results[index] for results in per_rank]
        assert_matches(got, expected, rtol=rtol, atol=atol, case=f"{label} {options}".strip())


def assert_matches(
    results: list[tuple[list[float], dict[str, torch.Tensor]]],
    expected: tuple[list[float], dict[str, torch.Tensor]],
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    case: str = "",
) -> None:
    """Every rank's losses and full state equal the single-process run (`case` names the
    run in the messages)."""
    want_losses, want_state = expected
    for rank, (losses, state) in enumerate(results):
        where = f"{case} rank {rank}".lstrip()
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(want_losses),
            rtol=rtol,
            atol=atol,
            msg=lambda m, where=where: f"{where} losses: {m}",
        )
        assert state.keys() == want_state.keys(), f"{where} state keys differ"
        for key, value in want_state.items():
            torch.testing.assert_close(
                state[key],
                value,
                rtol=rtol,
                atol=atol,
                msg=lambda m, where=where, key=key: f"{where} {key}: {m}",
            )
