"""A checkpoint saved under any plan loads under any other, and into one process.

The whole cross product of eight plans (1, dp2, tp2, pp2, dp2 x pp2, dp2 x tp2, pp2 x tp2,
dp2 x pp2 x tp2) for checkpoints written after the first step, and checkpoints written
before it (by a plan that splits at parallelize and by one that waits for a batch) loaded
under all eight, on a model no other test uses (a GPT-style decoder whose blocks sit in an
nn.ModuleList, with a fused qkv projection, a learned position table on the root and the
head tied to the embedding, held by two stages under pp, whose momentum must survive). Every
load is followed by one step, whose loss and resulting state must equal one uninterrupted
process at that step. Loading comes right after parallelize, before any step: the natural
order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import meshsplit as ms

RTOL, ATOL = 1e-4, 1e-5
VOCAB, SEQ, WIDTH, HEADS = 32, 8, 32, 4
PLANS = {
    "1": (1, 1, 1),
    "dp2": (2, 1, 1),
    "tp2": (1, 1, 2),
    "pp2": (1, 2, 1),
    "dp2xpp2": (2, 2, 1),
    "dp2xtp2": (2, 1, 2),
    "pp2xtp2": (1, 2, 2),
    "dp2xpp2xtp2": (2, 2, 2),
}
SAVED = [(name, "after") for name in PLANS] + [("dp2", "before"), ("pp2xtp2", "before")]
"""(plan, moment): written after the first step, or right after parallelize."""


class FusedAttention(nn.Module):
    """Causal self-attention with one fused projection to q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = FusedAttention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.emb.weight  # tied: two names, one tensor and one state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return Decoder()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = ms.data.synthetic_tokens(2 * 8, seq_len=SEQ, vocab_size=VOCAB, seed=3)
    return list(zip(x.split(8), y.split(8), strict=True))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _plan(name: str) -> ms.Plan:
    dp, pp, tp = PLANS[name]
    return ms.Plan(dp=dp, pp=pp, tp=tp, micro_batches=2 if pp > 1 else 1)


def _engine(name: str) -> ms.Engine:
    return ms.parallelize(
        _build(), _plan(name), optimizer=_sgd, loss_fn=ms.models.TokenCrossEntropy()
    )


def _save_all(names: list[str], root: str) -> None:
    for name in names:
        engine = _engine(name)
        if (name, "before") in SAVED:
            engine.save(Path(root, name, "before"))
        engine.train_step(*_batches()[0])
        engine.save(Path(root, name, "after"))
        engine.close()


def _load_all(names: list[str], root: str) -> dict[tuple[str, str, str], Any]:
    results = {}
    for name in names:
        for saved, moment in SAVED:
            engine = _engine(name)
            engine.load(Path(root, saved, moment))
            loss = engine.train_step(*_batches()[1 if moment == "after" else 0])
            results[(saved, moment, name)] = (loss, engine.full_state_dict())
            engine.close()
    return results


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process: the loss of each step and the state after it."""
    model, loss_fn = _build(), ms.models.TokenCrossEntropy()
    optimizer, losses, states = _sgd(model.parameters()), [], []
    for x, y in _batches()[:2]:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, states


def _by_world() -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, (dp, pp, tp) in PLANS.items():
        groups.setdefault(dp * pp * tp, []).append(name)
    return groups


@pytest.mark.timeout(1200)
def test_checkpoints_load_under_every_plan(tmp_path: Path) -> None:
    root = str(tmp_path)
    groups = _by_world()
    for world, names in groups.items():
        ms.launch(_save_all, world, args=(names, root), timeout_s=300)
    losses, states = _reference()
    # the fused qkv goes as its three parts, each rank writing its own block of each: no
    # rank gathers the fused tensor (or its momentum) whole to save it
    folder = Path(root, "pp2xtp2", "after")
    metadata = FileSystemReader(folder / (folder / "latest").read_text()).read_metadata()
    fused = {k: v for k, v in metadata.state_dict_metadata.items() if ".qkv.weight" in k}
    assert fused and all("#part" in key for key in fused), sorted(fused)
    assert {len(item.chunks) for item in fused.values()} == {2}, sorted(fused)
    assert len(fused) == 4 * 2 * 3  # 4 blocks x (weight, momentum) x 3 parts
    for saved in PLANS:
        whole = ms.load_full_state_dict(Path(root, saved, "after"))
        for key, value in states[0].items():
            torch.testing.assert_close(whole[key], value, rtol=RTOL, atol=ATOL, msg=saved + key)
    for world, names in groups.items():
        per_rank = ms.launch(_load_all, world, args=(names, root), timeout_s=600)
        for rank, results in enumerate(per_rank):
            for (saved, moment, name), (loss, state) in results.items():
                case = f"{saved} {moment} the first step -> {name}, rank {rank}"
                step = 1 if moment == "after" else 0
                assert loss == pytest.approx(losses[step], rel=RTOL, abs=ATOL), case
                assert state.keys() == states[step].keys(), f"{case}: state keys differ"
                for key, value in states[step].items():
                    torch.testing.assert_close(
                        state[key], value, rtol=RTOL, atol=ATOL,
                        msg=lambda m, case=case, key=key: f"{case} {key}: {m}",
                    )  # fmt: skip


def _save_tie_under_last_name(root: str) -> None:
    """pp2, one step, saved as a layer split once named a tied parameter: by its last name."""
    from meshsplit.pipeline.runner import PipelineRunner

    def last_names(runner: PipelineRunner) -> dict[torch.Tensor, str]:
        return {t: n for n, t in runner._state.items() if isinstance(t, nn.Parameter)}

    PipelineRunner.parameter_names = last_names  # type: ignore[method-assign]
    engine = _engine("pp2")
    engine.train_step(*_batches()[0])
    engine.save(Path(root, "old"))
    engine.close()


def _resume(root: str) -> tuple[float, dict[str, torch.Tensor]]:
    engine = _engine("dp2")
    engine.load(Path(root, "old"))
    loss = engine.train_step(*_batches()[1])
    return loss, engine.full_state_dict()


def test_a_tied_parameters_state_saved_under_its_last_name_still_resumes(tmp_path: Path) -> None:
    ms.launch(_save_tie_under_last_name, 2, args=(str(tmp_path),), timeout_s=120)
    folder = tmp_path / "old" / (tmp_path / "old" / "latest").read_text()
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    assert "optim/head.weight/momentum_buffer" in saved
    assert "optim/emb.weight/momentum_buffer" not in saved
    losses, states = _reference()
    for loss, state in ms.launch(_resume, 2, args=(str(tmp_path),), timeout_s=120):
        assert loss == pytest.approx(losses[1], rel=RTOL, abs=ATOL)
        for key, value in states[1].items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=key)
