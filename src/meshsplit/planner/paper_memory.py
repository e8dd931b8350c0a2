"""Peak bytes per GPU of a Megatron-style layout with full recomputation, for paper mode.

On the fullest stage: model states of 16 bytes per parameter over t, each layer's fp16 input
per micro-batch in flight, one layer's full activations while it is recomputed (Korthikanti
et al. 2022) and, on the last stage, the logits. Each term and the micro-batches in flight:
docs/internals.md#plannerpaper_memorypy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshsplit.planner.cluster import Cluster
    from meshsplit.planner.paper_model import GPTModel, Layout

__all__ = ["Memory", "layout_memory"]

USABLE_MEMORY = 0.9
"""Fraction of HBM a run can fill: CUDA context, NCCL buffers, cuBLAS workspace and allocator
fragmentation take the rest (assumption)."""
STATE_BYTES = 16
"""Bytes per parameter for mixed-precision Adam: fp16 weight and gradient, fp32 master, m, v."""


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Peak bytes per GPU on the fullest stage, and what the device offers."""

    states: float
    """Weights, gradients and Adam state."""
    activations: float
    """Checkpointed layer inputs, one layer's working set and the logits."""
    usable: float
    """Bytes of the device a run may fill."""
    local_params: float
    """Parameters on one GPU (P_stage / t)."""

    @property
    def total(self) -> float:
        """states + activations."""
        return self.states + self.activations

    def reason(self, label: str, device_bytes: float) -> str:
        """Why a layout labelled `label` does not fit ('' when it does)."""
        if self.total <= self.usable:
            return ""
        return (
            f"{label} needs {self.total / 1e9:.1f} GB per GPU but {self.usable / 1e9:.1f} GB of "
            f"the {device_bytes / 1e9:.0f} GB is usable: weights, gradients and Adam state "
            f"{self.states / 1e9:.1f} GB ({STATE_BYTES} bytes x {self.local_params / 1e9:.2f}B "
            f"parameters), activations {self.activations / 1e9:.1f} GB; raise tp*pp or lower "
            "micro_batch"
        )


def layout_memory(
    model: GPTModel, cluster: Cluster, layout: Layout, batch: int, local_params: float
) -> Memory:
    """Peak bytes per GPU of `layout` (each term: docs/internals.md#plannerpaper_memorypy)."""
    t, p, v, b = layout.tp, layout.pp, layout.interleave, layout.micro_batch
    s, h, a, vocab = model.seq_len, model.hidden, model.heads, model.vocab
    m, per_stage = batch // (layout.dp * b), model.layers // p
    checkpoint = 2 * b * s * h
    working = b * s * h * (10 + 24 / t + 5 * a * s / (h * t))
    logits = 10 * b * s * vocab / t
    first_layers: float
    last_layers: float
    if v == 1:
        first_layers, last_layers = min(p, m) * per_stage, per_stage
    else:
        chunk = per_stage / v
        first_layers = min(2 * (p - 1) + (v - 1) * p + 1, m * v) * chunk
        last_layers = min((v - 1) * p + 1, m * v) * chunk
    first = first_layers * checkpoint + working + (logits if p == 1 else 0)
    last = last_layers * checkpoint + working + logits
    return Memory(
        states=STATE_BYTES * local_params,
        activations=max(first, last),
        usable=cluster.memory_bytes * USABLE_MEMORY,
        local_params=local_params,
    )
