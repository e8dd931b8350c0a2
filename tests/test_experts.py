"""Expert parallelism (Plan.ep) equals one process, and each rank holds 1/ep of the experts.

Mixtral, Qwen2-MoE (with its shared expert) and a mixture-of-experts model written here, with
fused 3-D experts called as experts(hidden_states, top_k_index, top_k_weights), train 3 SGD
steps under each plan against plain PyTorch on the global batch. Tokens go to their experts
by all-to-all (dropless), so the result is one process's up to summation order.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms

from cli_runner import run_meshsplit
from reference import OPTIMIZERS, train_plainly

transformers = pytest.importorskip("transformers")

from hf_models import MOE, Wrap  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
BATCH, STEPS, VOCAB = 8, 3, 64


class FusedExperts(nn.Module):
    """E two-layer experts as two 3-D parameters, called as transformers v5 calls its own."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.up.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            h = torch.relu(hidden_states[token] @ self.up[expert].T) @ self.down[expert].T
            out = out.index_add(0, token, h * top_k_weights[token, slot, None])
        return out


class ListedExperts(nn.Module):
    """E experts as a ModuleList of small MLPs, with the same call."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
            for _ in range(experts)
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for number, expert in enumerate(self.experts):
            token, slot = torch.where(top_k_index == number)
            if len(token):
                h = expert(hidden_states[token])
                out = out.index_add(0, token, h * top_k_weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    """LayerNorm, a top-2 router over 4 experts, and the residual."""

    def __init__(self, listed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.router = nn.Linear(16, 4)
        self.experts = ListedExperts(4, 16, 32) if listed else FusedExperts(4, 16, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h).reshape(-1, 16)
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return h + self.experts(x, index, weights).view_as(h)


class OwnMoE(nn.Module):
    """Embedding, two mixture-of-experts blocks, head."""

    def __init__(self, listed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.Sequential(MoEBlock(listed), MoEBlock(listed))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _hf(model_class: str, config_class: str, **config: Any) -> nn.Module:
    settings = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, **config,
    )  # fmt: skip
    return Wrap(getattr(transformers, model_class)(settings))


BUILDERS = {
    "own": OwnMoE,
    "own_listed": lambda: OwnMoE(listed=True),
    "mixtral": lambda: _hf(
        "MixtralForCausalLM", "MixtralConfig", intermediate_size=32, num_local_experts=4
    ),
    "qwen2_moe": lambda: _hf(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        intermediate_size=32,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts_per_tok=2,
    ),  # fmt: skip
    # GPT-OSS: experts(hidden_states, router_indices, routing_weights), biases per expert
    "gpt_oss": lambda: _hf(
        "GptOssForCausalLM", "GptOssConfig", intermediate_size=16, num_local_experts=4, head_dim=8
    ),
    # Llama 4: every token runs every expert, its input scaled by the router (zero if unchosen)
    "llama4": lambda: _hf(
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        intermediate_size=16,
        intermediate_size_mlp=32,
        num_local_experts=4,
        head_dim=8,
    ),  # fmt: skip
}


def _build(model: str) -> nn.Module:
    torch.manual_seed(0)
    return (BUILDERS | MOE)[model]()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = ms.data.synthetic_tokens(BATCH * STEPS, seq_len=8, vocab_size=VOCAB, seed=1)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _expert_bytes(net: nn.Module) -> int:
    return sum(p.nbytes for name, p in net.named_parameters() if _is_expert(name))


def _is_expert(name: str) -> bool:
    return ".experts." in name  # not every 3-D parameter: Qwen3-Next's and Jamba's conv1d


def _single(model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = _build(model)
    return train_plainly(
        net, OPTIMIZERS["sgd"](net.parameters()), ms.models.TokenCrossEntropy(), _batches()
    )


Case = tuple[str, dict[str, int]]


def train_cases(cases: list[Case]) -> list[dict[str, Any]]:
    results = []
    for model, fields in cases:
        engine = ms.parallelize(
            _build(model), ms.Plan(**fields), optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
        losses = [engine.train_step(x, y) for x, y in _batches()]
        held = _expert_bytes(engine.module)
        described = engine.describe()
        results.append(
            {
                "losses": losses,
                "state": engine.full_state_dict(),
                "expert_bytes": held,
                "split": described["expert_split"],
                "split_over_tp": [
                    d["name"] for d in described["operator_split"] if d["split"] == "experts"
                ],
                "peak": engine.memory_report().tensor_peak_bytes,
            }
        )
        engine.close()
    return results


def assert_exact(got: dict[str, Any], want: tuple[list[float], dict[str, Any]], where: str) -> None:
    """One rank's losses and whole state equal one process's."""
    want_losses, want_state = want
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL,
        msg=lambda m: f"{where} losses: {m}",
    )  # fmt: skip
    assert got["state"].keys() == want_state.keys(), where
    for key, value in want_state.items():
        torch.testing.assert_close(
            got["state"][key], value, rtol=RTOL, atol=ATOL,
            msg=lambda m, key=key: f"{where} {key}: {m}",
        )  # fmt: skip


def _check(cases: list[Case], per_rank: list[list[dict[str, Any]]]) -> None:
    for index, (model, fields) in enumerate(cases):
        want = _single(model)
        whole = _expert_bytes(_build(model))
        for rank, results in enumerate(per_rank):
            got = results[index]
            where = f"{model} {ms.Plan(**fields).describe()} rank {rank}"
            assert_exact(got, want, where)
            share = whole / fields["ep"] / fields.get("pp", 1)
            assert got["expert_bytes"] <= 1.05 * share, f"{where}: {got['expert_bytes']} > {share}"
            assert got["split"] and all(
                s["per_rank"] * fields["ep"] == s["experts"] for s in got["split"]
            )


TWO: list[Case] = [(m, {"dp": 2, "ep": 2}) for m in BUILDERS]
FOUR: list[Case] = [
    *[(m, {"dp": 4, "ep": 4}) for m in BUILDERS],
    *[(m, {"dp": 4, "ep": 2}) for m in BUILDERS],
    *[(m, {"dp": 2, "ep": 2, "tp": 2}) for m in ("own", "mixtral")],
    *[(m, {"dp": 2, "ep": 2, "pp": 2, "micro_batches": 2}) for m in BUILDERS],
    *[(m, {"dp": 4, "ep": 2, "zero": 3}) for m in ("own", "own_listed", "mixtral")],
    ("qwen2_moe", {"dp": 4, "ep": 4, "zero": 2}),
    *[(m, {"dp": 4, "ep": 2, "zero": 1}) for m in ("own", "mixtral")],
]


@pytest.mark.timeout(600)
def test_two_ranks_dividing_the_experts_match_one_process_and_the_estimate() -> None:
    per_rank = ms.launch(train_cases, 2, args=(TWO,), timeout_s=300)
    _check(TWO, per_rank)
    for index, (model, fields) in enumerate(TWO):
        estimate = ms.estimate_memory(
            _build(model), ms.Plan(**fields), _batches()[0], optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip
        for rank, results in enumerate(per_rank):
            predicted, measured = estimate.ranks[rank].peak_bytes, results[index]["peak"]
            assert abs(predicted - measured) <= 0.1 * measured, (model, rank, predicted, measured)


@pytest.mark.timeout(600)
def test_every_other_moe_family_splits_its_experts_and_matches_one_process() -> None:
    cases: list[Case] = [(name, {"dp": 2, "ep": 2}) for name in MOE]
    _check(cases, ms.launch(train_cases, 2, args=(cases,), timeout_s=400))


@pytest.mark.timeout(900)
def test_ep_inside_dp_with_tp_and_pp_matches_one_process() -> None:
    _check(FOUR, ms.launch(train_cases, 4, args=(FOUR,), timeout_s=600))


def test_plans_that_cannot_divide_the_experts_are_plan_errors() -> None:
    with pytest.raises(ms.PlanError, match=r"Plan.ep=3 .* divides dp=4"):
        ms.Plan(dp=4, ep=3)
    with pytest.raises(ms.PlanError, match=r"capacity_factor=-1"):
        ms.Plan(dp=2, ep=2, capacity_factor=-1)


def _capped_and_refused() -> dict[str, Any]:
    """A capacity that drops tokens, and ep on a model without experts."""
    engine = ms.parallelize(
        _build("own"), ms.Plan(dp=2, ep=2, capacity_factor=0.5), optimizer=OPTIMIZERS["sgd"],
        loss_fn=ms.models.TokenCrossEntropy(),
    )  # fmt: skip
    losses = [engine.train_step(x, y) for x, y in _batches()]
    dropped = engine.dropped_tokens
    engine.close()
    try:
        ms.parallelize(ms.models.mlp((784, 16, 10)), ms.Plan(dp=2, ep=2)).prepare(
            torch.zeros(4, 784)
        )
    except ms.PlanError as error:
        return {"losses": losses, "dropped": dropped, "refused": str(error)}
    return {"losses": losses, "dropped": dropped, "refused": ""}


def test_a_capacity_drops_and_counts_tokens_and_ep_without_experts_is_refused() -> None:
    first, second = ms.launch(_capped_and_refused, 2, timeout_s=300)
    assert first["losses"] == second["losses"]
    # 8 x 8 tokens x top-2 over 4 experts: 32 slots per expert from each rank, capped at 16
    assert first["dropped"] > 0 and second["dropped"] > 0
    assert "has no experts module" in first["refused"] and "ep=1" in first["refused"]


def _resumed(directory: str, model: str) -> list[dict[str, Any]]:
    """Two steps under dp2 ep2, saved; the third after loading under dp2 (ep1) and again
    under dp2 ep2."""
    batches = _batches()

    def engine(fields: dict[str, int]) -> ms.Engine:
        return ms.parallelize(
            _build(model), ms.Plan(**fields), optimizer=OPTIMIZERS["sgd"],
            loss_fn=ms.models.TokenCrossEntropy(),
        )  # fmt: skip

    first = engine({"dp": 2, "ep": 2})
    for x, y in batches[:2]:
        first.train_step(x, y)
    first.save(directory)
    first.close()
    results = []
    for fields in ({"dp": 2}, {"dp": 2, "ep": 2}):
        resumed = engine(fields)
        resumed.load(directory)
        loss = resumed.train_step(*batches[2])
        results.append({"loss": loss, "state": resumed.full_state_dict()})
        resumed.close()
    return results


@pytest.mark.parametrize("model", ["own", "own_listed", "mixtral"])
def test_a_checkpoint_under_ep_resumes_under_any_ep(tmp_path: Any, model: str) -> None:
    want_losses, want_state = _single(model)
    for per_plan in ms.launch(_resumed, 2, args=(str(tmp_path), model), timeout_s=300):
        for got in per_plan:
            assert got["loss"] == pytest.approx(want_losses[2], rel=RTOL)
            for key, value in want_state.items():
                torch.testing.assert_close(got["state"][key], value, rtol=RTOL, atol=ATOL)


def test_the_trainer_and_the_command_line_take_the_expert_split(tmp_path: Any) -> None:
    x, y = ms.data.synthetic_tokens(64, seq_len=8, vocab_size=VOCAB, seed=1)
    model = _build("own")
    trainer = ms.Trainer(
        model, ms.Plan(dp=2, ep=2), optimizer=OPTIMIZERS["sgd"],
        loss_fn=ms.models.TokenCrossEntropy(),
    )  # fmt: skip
    trainer.fit((x, y), epochs=1, batch_size=16, verbose=0, shuffle=False)
    alone = _build("own")
    optimizer = OPTIMIZERS["sgd"](alone.parameters())
    for rows in range(0, 64, 16):
        optimizer.zero_grad()
        ms.models.TokenCrossEntropy()(alone(x[rows : rows + 16]), y[rows : rows + 16]).backward()
        optimizer.step()
    for (key, got), want in zip(
        model.state_dict().items(), alone.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=key)
    out = tmp_path / "metrics.json"
    done = run_meshsplit(
        "train", "--model", "moe", "--dp", "2", "--ep", "2", "--epochs", "1", "--metrics-out",
        str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.read_text())["plan"]["ep"] == 2


def test_an_experts_call_is_read_by_position_or_by_either_spelling_of_its_names() -> None:
    from meshsplit.experts.split import call_names, routing_arguments

    class GptOssStyle(nn.Module):
        def forward(self, hidden_states: Any, router_indices: Any, routing_weights: Any) -> Any:
            return hidden_states

    class Other(nn.Module):
        def forward(self, hidden_states: Any, mask: Any) -> Any:
            return hidden_states

    names = call_names(GptOssStyle)
    assert names == ("hidden_states", "router_indices", "routing_weights")
    assert call_names(Other) is None
    assert routing_arguments(names, (1, 2, 3), {}) == (1, 2, 3)
    assert routing_arguments(names, (1,), {"routing_weights": 3, "router_indices": 2}) == (1, 2, 3)
    with pytest.raises(TypeError, match="top-k indices"):
        routing_arguments(names, (1,), {"top_k_index": 2})


def test_rows_for_experts_that_every_token_runs_are_laid_out_expert_major() -> None:
    from meshsplit.experts.dense import _expert_major, live_rows

    def scaled_by_expert(grid: torch.Tensor) -> torch.Tensor:  # expert e multiplies by e + 1
        return grid.view(2, -1, grid.shape[-1]) * torch.tensor([1.0, 2.0]).view(2, 1, 1)

    rows = torch.arange(12.0).view(4, 3)
    local = torch.tensor([1, 0, 1, 1])  # arrival order: runs from two sources
    got = _expert_major(rows, local, 2, lambda g: scaled_by_expert(g).reshape(-1, 3))
    torch.testing.assert_close(got, rows * (local + 1).unsqueeze(-1).float())
    none = _expert_major(rows[:0], local[:0], 2, lambda g: g)
    assert none.shape == (0, 3)
    routed = torch.zeros(2 * 3, 4)  # 2 experts x 3 tokens, expert-major
    routed[1], routed[3] = 1.0, 2.0  # token 1 chose expert 0, token 0 chose expert 1
    experts, tokens = live_rows(routed, 2)
    assert experts.tolist() == [0, 1] and tokens.tolist() == [1, 0]


def _llama4_experts_when_one_rank_gets_nothing() -> list[bool]:
    """Llama 4's experts split over 2 ranks, every token choosing rank 0's experts: rank 1
    runs on no rows, and both ranks' outputs and gradients equal the unsplit module's."""
    import copy

    from meshsplit.experts.split import split_experts

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(hidden_size=8, intermediate_size=4, num_local_experts=4)
    holder = nn.Module()
    holder.experts = transformers.models.llama4.modeling_llama4.Llama4TextExperts(config)
    for param in holder.experts.parameters():  # made with torch.empty: the model inits them
        nn.init.normal_(param, std=0.2)
    whole = copy.deepcopy(holder.experts)
    routed = torch.zeros(4, 3, 8)
    routed[:2] = torch.randn(2, 3, 8)  # experts 0 and 1 only: rank 0's
    routed = routed.view(12, 8).requires_grad_()
    want = whole(routed)
    want.square().sum().backward()
    expected = (routed.grad.clone(), whole.gate_up_proj.grad)
    routed.grad = None
    split_experts(holder, ["experts"], torch.distributed.group.WORLD, None)
    got = holder.experts(routed)
    got.square().sum().backward()
    rank = torch.distributed.get_rank()
    mine = 2 * expected[1][2 * rank : 2 * rank + 2]  # both ranks' rows reach rank 0's experts
    return [
        torch.allclose(got, want, rtol=1e-5, atol=1e-6),
        torch.allclose(routed.grad, expected[0], rtol=1e-5, atol=1e-6),
        torch.allclose(holder.experts.gate_up_proj.grad, mine, rtol=1e-5, atol=1e-6),
    ]


def test_experts_that_every_token_runs_are_exact_when_a_rank_gets_no_rows() -> None:
    # CPU tensors on the world group: gloo, whatever GPUs the machine has
    runs = ms.launch(_llama4_experts_when_one_rank_gets_nothing, 2, backend="gloo")
    for rank, checks in enumerate(runs):
        assert all(checks), (rank, checks)
