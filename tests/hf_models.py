"""Small Hugging Face models built from configs (random weights, nothing downloaded)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from torch import nn

VOCAB = 64


class Wrap(nn.Module):
    """A causal LM or classifier as tokens -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids).logits


class WrapPixels(nn.Module):
    """An image classifier as pixels -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=pixels).logits


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Wrap(transformers.GPT2LMHeadModel(config))


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return Wrap(transformers.LlamaForCausalLM(config))


def bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return Wrap(transformers.BertForSequenceClassification(config))


def resnet() -> nn.Module:
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
        num_labels=10,
    )  # fmt: skip
    return WrapPixels(transformers.ResNetForImageClassification(config))


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "resnet": resnet,
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The model (seeded weights) and one example input of batch 4."""
    torch.manual_seed(seed)
    model = FACTORIES[name]()
    generator = torch.Generator().manual_seed(seed + 1)
    if name == "resnet":
        return model, torch.randn(4, 3, 32, 32, generator=generator)
    return model, torch.randint(0, VOCAB, (4, 8), generator=generator)
