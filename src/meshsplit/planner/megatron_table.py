"""Table 1 of Narayanan et al. 2021, the published figures paper mode is checked against.

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(arXiv:2104.04473, SC'21): GPT models of 1.7B to 1008B parameters on Selene (DGX A100 80GB),
teraFLOP/s per GPU counted by the paper's Eq. 3. The rows were checked against public
transcriptions of the paper. Rationale: docs/internals.md#plannermegatron_tablepy
"""

from __future__ import annotations

from dataclasses import dataclass

from meshsplit.planner.paper_model import GPTModel

__all__ = ["MegatronRow", "SEQUENCE", "VOCAB", "megatron_table"]

SEQUENCE = 2048
"""Sequence length of every model in the table."""
VOCAB = 51200
"""Vocabulary size of every model in the table."""


@dataclass(frozen=True, kw_only=True)
class MegatronRow:
    """One published run: the model, its layout and the throughput it reached."""

    billions: float
    """Parameters in billions as the paper prints them (its Eq. 2)."""
    heads: int
    """Attention heads a."""
    hidden: int
    """Hidden size h."""
    layers: int
    """Transformer layers l."""
    tp: int
    """Tensor-parallel size t."""
    pp: int
    """Pipeline-parallel size p."""
    gpus: int
    """GPUs n = t * p * d."""
    batch: int
    """Global batch size B in sequences."""
    tflops: float
    """Achieved teraFLOP/s per GPU."""
    percent_of_peak: float
    """tflops as a percentage of the A100's 312 TFLOP/s."""

    @property
    def dp(self) -> int:
        """Data-parallel size d = n / (t * p)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        """A label such as 'GPT 145.6B'."""
        return f"GPT {self.billions:g}B"

    def model(self) -> GPTModel:
        """The row's model as paper mode takes it."""
        return GPTModel(
            name=self.name,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            seq_len=SEQUENCE,
            vocab=VOCAB,
            dtype="fp16",
        )


_ROWS = (
    # billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU, % of peak
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


def megatron_table() -> list[MegatronRow]:
    """The ten rows of Table 1, smallest model first."""
    return [
        MegatronRow(
            billions=billions,
            heads=heads,
            hidden=hidden,
            layers=layers,
            tp=tp,
            pp=pp,
            gpus=gpus,
            batch=batch,
            tflops=tflops,
            percent_of_peak=percent,
        )
        for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops, percent in _ROWS
    ]
