"""record()/materialize() rebuild a model's initial values exactly, part by part, from a
recording made on the meta device."""

import copy
import functools
import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from torch import nn

from meshsplit.memory.deferred import DeferredInitError, is_recorded, materialize, record


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())


def embedding() -> nn.Module:
    return nn.Sequential(nn.Embedding(50, 8, padding_idx=0), nn.Linear(8, 4))


def encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


# name: (factory, example input, a submodule to materialise alone)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], str]] = {
    "mlp": (mlp, lambda: torch.randn(4, 16), "3"),
    "cnn": (cnn, lambda: torch.randn(2, 3, 8, 8), "1"),
    "embedding": (embedding, lambda: torch.randint(0, 50, (4, 6)), "0"),
    "encoder_layer": (encoder_layer, lambda: torch.randn(2, 5, 16), "self_attn"),
    "gpt2": (gpt2, lambda: torch.randint(0, 97, (2, 8)), "transformer.h.1"),
    "llama": (llama, lambda: torch.randint(0, 97, (2, 8)), "model.layers.1"),
    "bert": (bert, lambda: torch.randint(0, 97, (2, 8)), "bert.encoder.layer.1"),
}


def _output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model.eval()(x)
    return out.logits if hasattr(out, "logits") else out


@functools.cache
def _expected(name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """State dict, RNG state after construction and output of a plain factory() call."""
    factory, example, _ = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    rng = torch.get_rng_state()
    with torch.no_grad():
        out = _output(model, example())
    return {k: v.clone() for k, v in model.state_dict().items()}, rng, out


def _recorded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return record(factory)


def _assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].dtype == value.dtype, key
        assert torch.equal(state[key], value), key


def _all_meta(tensors: dict[str, torch.Tensor]) -> bool:
    return all(t.is_meta for t in tensors.values())


@pytest.mark.parametrize("name", MODELS)
def test_materialize_reproduces_factory_bit_for_bit(name: str) -> None:
    expected, rng_after_factory, _ = _expected(name)
    model = _recorded(MODELS[name][0])
    assert torch.equal(torch.get_rng_state(), rng_after_factory)
    assert _all_meta(model.state_dict()) and is_recorded(model)
    materialize(model)
    _assert_same_state(model, expected)
    assert not is_recorded(model)


@pytest.mark.parametrize("name", MODELS)
def test_materialize_leaves_rng_state_alone(name: str) -> None:
    model = _recorded(MODELS[name][0])
    torch.manual_seed(123)
    before = torch.get_rng_state()
    materialize(model)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", MODELS)
def test_materialize_one_submodule(name: str) -> None:
    expected, _, _ = _expected(name)
    model = _recorded(MODELS[name][0])
    part = MODELS[name][2]
    materialize(model.get_submodule(part))
    inside = {f"{part}.{key}" for key in model.get_submodule(part).state_dict()}
    for key, value in model.state_dict().items():
        if key in inside:
            assert torch.equal(value, expected[key]), key
        elif not (name == "gpt2" and key == "lm_head.weight"):  # tied to wte, not in part
            assert value.is_meta, key
    assert is_recorded(model) and not is_recorded(model.get_submodule(part))


def test_materialize_by_names_relative_to_the_module() -> None:
    expected, _, _ = _expected("llama")
    model = _recorded(llama)
    layer = model.get_submodule("model.layers.0")
    materialize(layer, names=["self_attn.q_proj.weight", "mlp.up_proj.weight"])
    assert torch.equal(
        layer.self_attn.q_proj.weight, expected["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(layer.mlp.up_proj.weight, expected["model.layers.0.mlp.up_proj.weight"])
    assert layer.self_attn.k_proj.weight.is_meta and layer.mlp.down_proj.weight.is_meta
    with pytest.raises(KeyError, match="nonexistent"):
        materialize(layer, names=["nonexistent.weight"])


def test_gpt2_tie_survives() -> None:
    expected, _, _ = _expected("gpt2")
    model = _recorded(gpt2)
    assert model.lm_head.weight is model.transformer.wte.weight
    materialize(model, names=["lm_head.weight"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.is_meta
    assert torch.equal(model.lm_head.weight, expected["transformer.wte.weight"])
    materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_parameters_keep_identity_and_requires_grad() -> None:
    def factory() -> nn.Module:
        model = mlp()
        model[0].bias.requires_grad_(False)
        return model

    model = _recorded(factory)
    params = dict(model.named_parameters())
    materialize(model)
    assert all(params[name] is p for name, p in model.named_parameters())
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    assert not model[0].bias.requires_grad
    materialize(model)  # nothing left to do: a no-op
    assert all(params[name] is p for name, p in model.named_parameters())


@pytest.mark.parametrize("name", MODELS)
def test_materialized_model_computes_what_factory_computes(name: str) -> None:
    _, rng_after_factory, expected = _expected(name)
    model = _recorded(MODELS[name][0])
    materialize(model)
    torch.set_rng_state(rng_after_factory)  # the same example input as _expected drew
    with torch.no_grad():
        assert torch.equal(_output(model, MODELS[name][1]()), expected)


def test_deep_copy_of_a_recording_materialises_alike() -> None:
    expected, _, _ = _expected("bert")
    model = _recorded(bert)
    twin = copy.deepcopy(model)
    materialize(twin)
    _assert_same_state(twin, expected)
    assert _all_meta(model.state_dict())


def _real_bytes_alive() -> dict[int, int]:
    storages = {}
    with warnings.catch_warnings():  # isinstance() wakes deprecated lazy attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return storages


def test_recording_keeps_no_real_tensors() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 1 MiB weights

    before = _real_bytes_alive()
    model = _recorded(factory)
    gc.collect()
    kept = sum(n for ptr, n in _real_bytes_alive().items() if ptr not in before)
    assert _all_meta(model.state_dict())
    assert kept < 512 * 512 * 4 // 4  # a few saved RNG states, far below one weight


def test_record_memory_stays_near_one_tensor() -> None:
    script = textwrap.dedent(
        """
        import json, re, torch
        from torch import nn
        from meshsplit.memory.deferred import materialize, record

        def peak():
            status = open("/proc/self/status").read()
            return int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1)) * 1024

        record(lambda: nn.Linear(1024, 1024))  # first calls load code and fill caches
        base = peak()
        model = record(lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)]))
        recorded = peak() - base
        materialize(model[5])
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        real = not model[5].weight.is_meta and model[4].weight.is_meta
        print(json.dumps({"recorded": recorded, "total": total, "layer": real}))
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["total"] > 200e6  # the whole model would be ~200 MB
    assert report["recorded"] < 40e6, report  # one 16 MiB weight at a time, plus slack
    assert report["layer"]


def test_reads_of_values_while_recording_are_served() -> None:
    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            scale = self.proj.weight.abs().max().item()
            with torch.no_grad():
                if bool((self.proj.bias > 0).any()):
                    self.proj.weight.div_(scale)
            steps = torch.linspace(0, 0.5, 4).tolist()  # a drop-path style schedule
            self.register_buffer("steps", torch.tensor(steps) * self.proj.bias[:4])

    torch.manual_seed(0)
    expected = Normalised().state_dict()
    model = _recorded(Normalised)
    materialize(model)
    _assert_same_state(model, expected)


def test_factory_that_cannot_be_deferred_raises() -> None:
    outside = torch.ones(3)

    def writes_outside() -> nn.Module:
        outside.add_(1)
        return nn.Linear(3, 3)

    with pytest.raises(DeferredInitError, match="outside the factory"):
        record(writes_outside)

    def reads_raw_storage() -> nn.Module:
        layer = nn.Linear(3, 3)
        layer.weight.untyped_storage().tolist()
        return layer

    with pytest.raises(DeferredInitError, match="tensor data"):
        record(reads_raw_storage)

    def uses_outside() -> nn.Module:
        layer = nn.Linear(3, 3)
        with torch.no_grad():
            layer.weight.mul_(outside)
        return layer

    def moves_storage() -> nn.Module:
        layer = nn.Linear(3, 3)
        layer.register_buffer("moved", torch.empty(0))
        layer.moved.set_(torch.zeros(3))
        return layer

    with pytest.raises(DeferredInitError, match="another storage"):
        record(moves_storage)

    model = record(uses_outside)
    outside.add_(1)
    with pytest.raises(DeferredInitError, match="modified after"):
        materialize(model)


class _Patterns(nn.Module):
    """Initialisation idioms that go through views, reads, copies and generators."""

    def __init__(self) -> None:
        super().__init__()
        self.trunc = nn.Parameter(torch.empty(5, 7))
        nn.init.trunc_normal_(self.trunc, std=0.02)
        self.orth = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.orth)
        self.sparse = nn.Parameter(torch.empty(4, 6))
        nn.init.sparse_(self.sparse, 0.5)
        self.seeded = nn.Parameter(torch.randn(3, 3, generator=torch.Generator().manual_seed(3)))
        self.register_buffer("shuffled", torch.arange(10.0)[torch.randperm(10)])
        self.copied = nn.Parameter(torch.zeros(4, device=self.trunc.device))
        self.copied.data.copy_(torch.linspace(0, 1, 4))
        noise = torch.randn(8)
        self.register_buffer("before", noise * 1)  # reads `noise` before it changes
        noise.mul_(3)
        self.register_buffer("after", noise + 1)
        self.register_buffer("count", torch.tensor(0, dtype=torch.long))
        self.count.add_(5)
        self.register_buffer("bits", torch.randn(4).view(torch.int32))
        self.rows = nn.Parameter(torch.empty(4, 4))
        nn.init.kaiming_normal_(self.rows)
        self.rows.data[1:, :].mul_(0.5)
        self.like = nn.Parameter(torch.rand_like(self.rows))
        self.drawn = nn.Parameter(
            torch.multinomial(torch.tensor([0.1, 0.5, 0.4]), 6, True).double()
        )
        self.nonzero = nn.Parameter(torch.nonzero(self.count.expand(3) > 0).float())
        self.big = nn.Parameter(torch.randn(600, 600) * 0.02)  # big: drawn into an mmap
        self.big_normal = nn.Parameter(torch.normal(0.0, 1.0, size=(640, 512)))
        self.register_buffer("big_ints", torch.randint(0, 5, (400, 800)))
        self.register_buffer("grown", torch.empty(0))
        self.grown.resize_(3, 4).fill_(2.0)  # in-place changes of shape are followed
        self.register_buffer("column", torch.arange(6.0))
        self.column.unsqueeze_(1).t_()
        self.double = nn.Linear(3, 2).to(torch.float64)
        self.lstm = nn.LSTM(4, 4)
        self.stack = nn.TransformerEncoder(encoder_layer(), 2, enable_nested_tensor=False)


def test_initialisation_idioms() -> None:
    torch.manual_seed(0)
    reference = _Patterns()
    rng = torch.get_rng_state()
    model = _recorded(_Patterns)
    assert torch.equal(torch.get_rng_state(), rng)
    materialize(model)
    _assert_same_state(model, reference.state_dict())
    x = torch.randn(3, 2, 4)
    with torch.no_grad():  # the LSTM's cached flat weights are the real ones too
        assert torch.equal(model.lstm(x)[0], reference.lstm(x)[0])


def test_default_dtype_at_record_time_is_kept() -> None:
    def factory() -> nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return nn.Linear(3, 3)
        finally:
            torch.set_default_dtype(previous)

    torch.manual_seed(0)
    expected = factory().state_dict()
    model = _recorded(factory)
    materialize(model)
    _assert_same_state(model, expected)


def test_dtype_conversion_after_record_is_honoured() -> None:
    expected, _, _ = _expected("mlp")
    model = _recorded(mlp).to(torch.bfloat16)
    materialize(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key].to(torch.bfloat16)), key
