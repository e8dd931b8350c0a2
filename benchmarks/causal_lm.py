"""A Hugging Face LLaMA from a config (random weights, no cache), wrapped as a user wraps it:
token ids -> logits. Shared by the benchmarks that split one."""

from __future__ import annotations

import torch
import transformers
from torch import nn


class LlamaLM(nn.Module):
    """`LlamaForCausalLM(LlamaConfig(**config))` as token ids -> logits (the model is `m`)."""

    def __init__(self, **config: int) -> None:
        super().__init__()
        self.m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, use_cache=False))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids).logits
