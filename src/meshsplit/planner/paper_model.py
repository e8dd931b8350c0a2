"""What paper mode prices: a GPT decoder's shape and a Megatron layout of it over GPUs.

Apart from the time model (paper.py) and the memory model (paper_memory.py), which both read
them, so neither of those needs the other's types.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshsplit.plan import PlanError

__all__ = ["GPTModel", "Layout"]


@dataclass(frozen=True, kw_only=True)
class GPTModel:
    """A GPT-style decoder: l layers of attention + 4h MLP, tied embedding and logit layer."""

    layers: int
    """Transformer layers l."""
    hidden: int
    """Hidden size h (a multiple of heads)."""
    heads: int
    """Attention heads a."""
    seq_len: int = 2048
    """Sequence length s."""
    vocab: int = 51200
    """Vocabulary size V."""
    dtype: str = "fp16"
    """Compute dtype, a key of Cluster.flops."""
    name: str = ""
    """Label for tables."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"GPTModel.{key}={value!r} must be a positive integer")
        if self.hidden % self.heads:
            raise PlanError(
                f"GPTModel.hidden={self.hidden} is not a multiple of heads="
                f"{self.heads}; use hidden = heads * head size"
            )

    @property
    def parameters(self) -> float:
        """P = 12lh²(1 + 13/(12h) + (V+s)/(12lh)), the paper's Eq. 2."""
        n, h = self.layers, self.hidden
        return 12 * n * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq_len) / (12 * n * h))

    def flops(self, batch: int) -> float:
        """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) per iteration, recomputation included."""
        s, n, h = self.seq_len, self.layers, self.hidden
        return 96 * batch * s * n * h * h * (1 + s / (6 * h) + self.vocab / (16 * n * h))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How n = tp * pp * dp GPUs split the model, and the pipeline's unit of work."""

    tp: int
    """Tensor-parallel size t."""
    pp: int
    """Pipeline stages p."""
    dp: int
    """Data-parallel replicas d."""
    micro_batch: int
    """Sequences per micro-batch b."""
    interleave: int = 1
    """Model chunks per stage v (1: plain 1F1B; more: interleaved 1F1B)."""

    @property
    def gpus(self) -> int:
        """n = t * p * d."""
        return self.tp * self.pp * self.dp

    @property
    def mesh(self) -> tuple[int, int, int]:
        """(t, p, d)."""
        return (self.tp, self.pp, self.dp)

    def describe(self) -> str:
        """A label such as 't8 p64 d6 b1 v2'."""
        text = f"t{self.tp} p{self.pp} d{self.dp} b{self.micro_batch}"
        return text + (f" v{self.interleave}" if self.interleave > 1 else "")
