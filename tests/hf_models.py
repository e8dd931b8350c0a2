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
    model = (FACTORIES | MORE | MASKED_LM)[name]()
    generator = torch.Generator().manual_seed(seed + 1)
    if name == "resnet":
        return model, torch.randn(4, 3, 32, 32, generator=generator)
    return model, torch.randint(0, VOCAB, (4, 8), generator=generator)


class Seq2Seq(nn.Module):
    """An encoder-decoder as tokens -> logits, the decoder reading the same tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, decoder_input_ids=ids).logits


def _from_config(
    wrap: Callable[[nn.Module], nn.Module], model_class: str, config_class: str, **config: object
) -> Callable[[], nn.Module]:
    """A factory of `model_class` from `config_class(vocab_size=VOCAB, **config)`, wrapped."""

    def build() -> nn.Module:
        settings = getattr(transformers, config_class)(vocab_size=VOCAB, **config)
        return wrap(getattr(transformers, model_class)(settings))

    return build


def _causal(model_class: str, config_class: str, **config: object) -> Callable[[], nn.Module]:
    return _from_config(Wrap, model_class, config_class, **config)


def _seq2seq(model_class: str, config_class: str, **config: object) -> Callable[[], nn.Module]:
    return _from_config(Seq2Seq, model_class, config_class, **config)


_LM = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4}
_GQA = {**_LM, "intermediate_size": 64, "num_key_value_heads": 2, "max_position_embeddings": 16}
_ENCODER = {
    **_LM,
    "intermediate_size": 64,
    "max_position_embeddings": 20,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
MORE: dict[str, Callable[[], nn.Module]] = {
    "mistral": _causal("MistralForCausalLM", "MistralConfig", **_GQA),
    "qwen2": _causal("Qwen2ForCausalLM", "Qwen2Config", **_GQA),
    "mixtral": _causal("MixtralForCausalLM", "MixtralConfig", **_GQA, num_local_experts=4),
    "phi": _causal("PhiForCausalLM", "PhiConfig", **_LM, intermediate_size=64),
    "gpt_neox": _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", **_LM, intermediate_size=64),
    "gptj": _causal("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=4, n_head=4, rotary_dim=4),
    "bloom": _causal("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=4, n_head=4),
    "opt": _causal(
        "OPTForCausalLM", "OPTConfig", **_LM, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0
    ),
    "distilbert": _causal(
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        dim=32,
        n_layers=4,
        n_heads=4,
        hidden_dim=64,
        num_labels=3,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
    ),  # fmt: skip
    # FalconLinear: Linear's forward spelled out; the MLP's output added to in place; one
    # key/value head (kept whole under tp)
    "falcon": _causal(
        "FalconForCausalLM", "FalconConfig", **_LM, hidden_dropout=0.0, attention_dropout=0.0
    ),
    "gemma": _causal("GemmaForCausalLM", "GemmaConfig", **_GQA, head_dim=8),
    # Gemma 3: per-head q_norm/k_norm between q_proj and o_proj, on each rank's heads only
    "gemma3": _causal("Gemma3ForCausalLM", "Gemma3TextConfig", **_GQA, head_dim=8),
    "qwen3": _causal("Qwen3ForCausalLM", "Qwen3Config", **_GQA, head_dim=8),
    # Gemma 2: attention logits soft-capped, every other layer a sliding window
    "gemma2": _causal("Gemma2ForCausalLM", "Gemma2Config", **_GQA, head_dim=8, sliding_window=8),
    # Mamba: no attention; a selective state-space scan between in_proj and out_proj
    "mamba": _causal(
        "MambaForCausalLM",
        "MambaConfig",
        hidden_size=32,
        num_hidden_layers=4,
        state_size=8,
        expand=2,
        conv_kernel=4,
    ),  # fmt: skip
    # FNet: its own forward reads the embeddings' token_type_ids buffer on every stage
    "fnet": _causal(
        "FNetForMaskedLM",
        "FNetConfig",
        **_LM,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        max_position_embeddings=16,
    ),  # fmt: skip
    # Llama 4: complex rotary frequencies cross the stage boundaries
    "llama4": _causal(
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        **_GQA,
        head_dim=8,
        num_local_experts=2,
        intermediate_size_mlp=64,
    ),  # fmt: skip
    # DeepSeek V3: one rotary key, made outside q_b/kv_b -> o, read by every head (kept whole)
    "deepseek_v3": _causal(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        **_GQA,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
    ),  # fmt: skip
    "roberta": _causal(
        "RobertaForSequenceClassification",
        "RobertaConfig",
        **_LM,
        intermediate_size=64,
        max_position_embeddings=20,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),  # fmt: skip
    "vit": lambda: WrapPixels(
        transformers.ViTForImageClassification(
            transformers.ViTConfig(
                image_size=32, patch_size=8, **_LM, intermediate_size=64, num_labels=10
            )
        )
    ),
    "convnext": lambda: WrapPixels(
        transformers.ConvNextForImageClassification(
            transformers.ConvNextConfig(
                hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], num_labels=10
            )
        )
    ),
    "t5": _seq2seq(
        "T5ForConditionalGeneration",
        "T5Config",
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
    # BERT's masked-LM head: the decoder tied to the word embeddings, its bias also held by
    # the head as `predictions.bias` (an alias that must follow the split)
    "bert_mlm": _causal("BertForMaskedLM", "BertConfig", **_ENCODER),
    # M2M100 (NLLB's layout): one weight shared four ways (shared, both embed_tokens with
    # an embed_scale, lm_head), sinusoidal positions
    "m2m100": _seq2seq(
        "M2M100ForConditionalGeneration",
        "M2M100Config",
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        max_position_embeddings=32,
        pad_token_id=1,
        decoder_start_token_id=2,
    ),
}
"""More architectures the README names, each tried under one hybrid plan."""
MASKED_LM: dict[str, Callable[[], nn.Module]] = {
    "roberta_mlm": _causal("RobertaForMaskedLM", "RobertaConfig", **_ENCODER),
    # ALBERT runs one shared layer at every depth: no layer split, tried under tp only
    "albert_mlm": _causal("AlbertForMaskedLM", "AlbertConfig", **_ENCODER, embedding_size=16),
}
"""Masked-LM heads whose decoder bias has a second name, tried under tp."""
KINDS = {"bert": "classify", "distilbert": "classify", "roberta": "classify"} | {
    name: "pixels" for name in ("resnet", "vit", "convnext")
}
"""What a model reads and predicts: 'pixels' (images -> 10 classes), 'classify' (tokens -> 3
classes); every other model maps tokens to next-token logits."""


_MOE = {
    **_GQA,
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "qk_nope_head_dim": 4,
}
MOE: dict[str, Callable[[], nn.Module]] = {
    name: _causal(f"{name}ForCausalLM", f"{name}Config", **{**_MOE, **extra})
    for name, extra in (
        ("Qwen3Moe", {"head_dim": 8, "decoder_sparse_step": 1, "mlp_only_layers": []}),
        ("Olmoe", {}),
        ("Cohere2Moe", {}),
        ("DeepseekV2", _MLA),
        ("DeepseekV3", _MLA),
        ("Dots1", {"n_shared_experts": 1}),
        ("Ernie4_5_Moe", {}),
        ("ExaoneMoe", {"head_dim": 8}),
        ("FlexOlmo", {}),
        ("Glm4Moe", {"head_dim": 8}),
        ("Glm4MoeLite", _MLA),
        ("GraniteMoe", {}),
        ("GraniteMoeShared", {"shared_intermediate_size": 16}),
        ("HunYuanMoEV1", {"head_dim": 8}),
        ("Jamba", {"attn_layer_offset": 1, "attn_layer_period": 2,
                         "expert_layer_period": 1, "expert_layer_offset": 0}),
        ("Lfm2Moe", {"num_dense_layers": 0, "layer_types": ["conv", "full_attention"]}),
        ("MiniMax", {"head_dim": 8}),
        ("Phimoe", {"router_jitter_noise": 0.0}),  # it draws noise in training otherwise
        ("Qwen3Next", {"num_hidden_layers": 4, "head_dim": 8}),
    )
}  # fmt: skip
"""Mixture-of-experts families beyond those tests/test_experts.py trains under every ep plan,
each tried under dp2 ep2 (random weights; router jitter and dropout off)."""
