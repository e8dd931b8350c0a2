"""Paper mode: Megatron-style training of a GPT decoder on a GPU cluster, priced on paper.

Pure arithmetic, so it predicts layouts this machine cannot run: tensor split t, p pipeline
stages (1F1B; v chunks per stage when interleaved), d replicas on n = t*p*d GPUs of a
`Cluster`, full recomputation, as in Narayanan et al. 2021 (arXiv:2104.04473). The work per
iteration is the paper's Eq. 3, F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)); `megatron_table.py`
holds what to check it on, `paper_memory.py` the memory per GPU.
Rationale: docs/internals.md#plannerpaperpy
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from meshsplit.plan import PlanError, divisors
from meshsplit.planner.cluster import Cluster
from meshsplit.planner.machine import Link
from meshsplit.planner.paper_memory import layout_memory
from meshsplit.planner.paper_model import GPTModel, Layout

__all__ = ["Prediction", "Ranking", "best_layout", "predict"]

KERNEL_EFFICIENCY = 0.79
"""The one calibrated constant: the fraction of a device's best large-GEMM FLOP/s that the
training GEMMs sustain (smaller, transposed and batched shapes, launch gaps, and whatever else
the terms below leave out). Fitted once to all ten rows of Megatron Table 1 at the same time by
`benchmarks/bench_paper.py --calibrate` (0.786, rounded), never per row: with A100's measured
86.9% it makes training GEMMs run at 0.69 of peak, 214 TFLOP/s."""
OPTIMIZER_BYTES = 32
"""HBM traffic per parameter of one Adam step: read and write master, m and v (24), read the
gradient, write the fp16 weight, plus the norm for gradient clipping."""

TERMS = {
    "compute": "matrix multiplies",
    "elementwise": "memory-bound elementwise work",
    "recompute": "recomputed forward pass",
    "tp_comm": "tensor-parallel all-reduces",
    "pp_comm": "pipeline sends",
    "bubble": "pipeline bubble",
    "dp_comm": "exposed data-parallel gradient all-reduce",
    "optimizer": "optimizer step",
}
"""Iteration-time terms and how a sentence names them."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One layout's predicted iteration: time by term, throughput and memory per GPU."""

    layout: Layout
    """The layout priced."""
    seconds: float
    """Predicted iteration time, the sum of `terms`."""
    terms: Mapping[str, float]
    """Seconds per iteration by term (keys of TERMS), on the slowest stage's critical path."""
    model_flops: float
    """F of the iteration (Eq. 3, recomputation included)."""
    tflops_per_gpu: float
    """F / seconds / n, in TFLOP/s."""
    memory_bytes: float
    """Peak bytes per GPU on the fullest stage."""
    memory_terms: Mapping[str, float]
    """Peak bytes by kind: 'states' (weights, gradients, Adam) and 'activations'."""
    reason: str = ""
    """Why the layout cannot run ('' when it fits)."""

    @property
    def feasible(self) -> bool:
        """Whether the layout fits in device memory."""
        return not self.reason


def _all_reduce(link: Link, efficiency: float, nbytes: float, ranks: int) -> float:
    """Ring all-reduce: 2(n-1) steps, each sends nbytes/n one way while receiving another."""
    if ranks <= 1:
        return 0.0
    step = link.alpha_s + nbytes / ranks / (link.bytes_per_s * efficiency)
    return 2 * (ranks - 1) * step


def _send(link: Link, efficiency: float, nbytes: float) -> float:
    return link.alpha_s + nbytes / (link.bytes_per_s * efficiency)


def _check(model: GPTModel, layout: Layout, batch: int) -> None:
    t, p, d, b, v = (layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.interleave)
    for key, value in (("tp", t), ("pp", p), ("dp", d), ("micro_batch", b), ("interleave", v)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"Layout.{key}={value!r} must be a positive integer")
    problem = ""
    if model.heads % t:
        problem = f"tp={t} does not divide heads={model.heads}; use tp in {divisors(model.heads)}"
    elif model.layers % (p * v):
        problem = (
            f"pp*interleave={p}*{v} does not divide layers={model.layers}; "
            f"use pp*interleave in {divisors(model.layers)}"
        )
    elif batch % (d * b):
        problem = f"dp*micro_batch={d}*{b} does not split batch {batch}; use a divisor of it"
    elif v > 1 and (p == 1 or (batch // (d * b)) % p):
        problem = (
            f"interleave={v} needs pp > 1 and the {batch // (d * b)} micro-batches a "
            f"multiple of pp={p}; use interleave=1"
        )
    if problem:
        raise PlanError(f"Layout {layout.describe()}: {problem}")


def predict(model: GPTModel, cluster: Cluster, layout: Layout, batch: int) -> Prediction:
    """Iteration time, TFLOP/s per GPU and memory of `model` on `cluster` under `layout`."""
    _check(model, layout, batch)
    t, p, d, b, v = (layout.tp, layout.pp, layout.dp, layout.micro_batch, layout.interleave)
    s, h, a, V = model.seq_len, model.hidden, model.heads, model.vocab
    m, per_stage, eff = batch // (d * b), model.layers // p, cluster.link_efficiency
    flop_rate = cluster.peak_flops(model.dtype) * cluster.matmul_efficiency * KERNEL_EFFICIENCY
    byte_rate = cluster.memory_bytes_per_s * cluster.memory_efficiency
    bsh = b * s * h
    gemm = (24 * bsh * h + 4 * b * s * s * h) / t / flop_rate
    elem = (bsh * (22 + 16 / t) + 13 * b * (a / t) * s * s) / byte_rate
    logit_gemm, logit_elem = 6 * bsh * V / t / flop_rate, 16 * b * s * V / t / byte_rate
    tp_one = _all_reduce(cluster.link(t), eff, 2 * bsh, t)
    tp_count = 6 * per_stage + 1 + (p == 1)
    per_mb = {
        "compute": 3 * per_stage * gemm + logit_gemm,
        "elementwise": 3 * per_stage * elem + logit_elem,
        "recompute": per_stage * (gemm + elem),
        "tp_comm": tp_count * tp_one,
    }
    stage = sum(per_mb.values())
    terms = {key: m * value for key, value in per_mb.items()}
    terms["bubble"] = (p - 1) / v * stage
    terms["pp_comm"] = 0.0
    if p > 1:
        if t * d * p <= cluster.devices_per_node:
            hop = _send(cluster.intra_node, eff, 2 * bsh)
        elif t > 1:
            gather = (t - 1) * _send(cluster.intra_node, eff, 2 * bsh / t)
            hop = _send(cluster.inter_node, eff, 2 * bsh / t) + gather
        else:
            hop = _send(cluster.inter_node, eff, 2 * bsh)
        terms["pp_comm"] = 2 * (v * m + p - 1) * hop
    layer_params = 12 * h * h * (1 + 13 / (12 * h))
    stage_params = per_stage * layer_params + V * h + (s * h if p == 1 else 0)
    local = stage_params / t
    grads = _all_reduce(cluster.link(t * d), eff, 2 * local, d)
    terms["dp_comm"] = max(0.0, grads - per_stage * 2 * (gemm + elem))
    terms["optimizer"] = OPTIMIZER_BYTES * local / byte_rate
    seconds = sum(terms.values())
    flops = model.flops(batch)

    memory = layout_memory(model, cluster, layout, batch, local)
    return Prediction(
        layout=layout,
        seconds=seconds,
        terms=terms,
        model_flops=flops,
        tflops_per_gpu=flops / seconds / layout.gpus / 1e12,
        memory_bytes=memory.total,
        memory_terms={"states": memory.states, "activations": memory.activations},
        reason=memory.reason(layout.describe(), cluster.memory_bytes),
    )


@dataclass(frozen=True, kw_only=True)
class Ranking:
    """Every candidate layout for one model, cluster, GPU count and batch, fastest first."""

    ranked: tuple[Prediction, ...]
    """Layouts that fit, fastest first; ranked[0] is the choice."""
    infeasible: tuple[Prediction, ...]
    """Layouts that do not fit in memory, each with its reason."""

    @property
    def best(self) -> Prediction:
        """The fastest layout that fits."""
        return self.ranked[0]

    def best_for(self, tp: int, pp: int, dp: int) -> Prediction | None:
        """The fastest fitting layout with mesh (tp, pp, dp), any micro-batch and interleave."""
        return next((q for q in self.ranked if q.layout.mesh == (tp, pp, dp)), None)

    def why(self, prediction: Prediction) -> str:
        """One sentence: the term that made this layout lose to the best (or why it cannot run)."""
        if not prediction.feasible:
            return prediction.reason
        best = self.best
        if prediction.layout == best.layout:
            return f"{best.layout.describe()} is the fastest predicted layout"
        gaps = {key: prediction.terms[key] - best.terms[key] for key in TERMS}
        key = max(gaps, key=lambda name: gaps[name])
        slower = (prediction.seconds / best.seconds - 1) * 100
        return (
            f"{prediction.layout.describe()} is {slower:.1f}% slower than "
            f"{best.layout.describe()}: its {TERMS[key]} cost {gaps[key]:.2f} s more per "
            f"iteration ({prediction.terms[key]:.2f} s against {best.terms[key]:.2f} s)"
        )

    def reasons(self) -> list[tuple[Prediction, str]]:
        """Every loser, fitting or not, with its sentence."""
        return [(q, self.why(q)) for q in (*self.ranked[1:], *self.infeasible)]


def _candidates(
    model: GPTModel, gpus: int, batch: int, micro_batches: tuple[int, ...]
) -> Iterator[Layout]:
    """Every layout the model, GPU count and batch allow (t | heads, p*v | l, d*b | B)."""
    for t in divisors(model.heads):
        for p in (p for p in divisors(model.layers) if gpus % (t * p) == 0):
            d = gpus // (t * p)
            for b in (b for b in micro_batches if batch % (d * b) == 0):
                m = batch // (d * b)
                for v in divisors(model.layers // p):
                    if v == 1 or (p > 1 and m % p == 0):
                        yield Layout(tp=t, pp=p, dp=d, micro_batch=b, interleave=v)


def best_layout(
    model: GPTModel,
    cluster: Cluster,
    gpus: int,
    batch: int,
    *,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    max_tp: int | None = None,
    mesh: tuple[int, int, int] | None = None,
    max_interleave: int | None = None,
) -> Ranking:
    """Price every (t, p, d) with t*p*d = gpus, t | heads, t <= max_tp (default two nodes),
    p | layers, each micro-batch size and each interleave v | l/p, and rank them.

    `mesh=(t, p, d)` prices only that mesh (over micro-batch and interleave);
    `max_interleave` caps v (None: any divisor of l/p; 1: plain 1F1B only).
    """
    limit = max_tp if max_tp is not None else 2 * cluster.devices_per_node
    chunks = max_interleave if max_interleave is not None else model.layers
    layouts = [
        layout
        for layout in _candidates(model, gpus, batch, micro_batches)
        if layout.tp <= limit
        and layout.interleave <= chunks
        and (mesh is None or layout.mesh == mesh)
    ]
    if not layouts:
        raise PlanError(
            f"no layout of {gpus} GPUs splits {model.name or 'the model'} (heads={model.heads}, "
            f"layers={model.layers}) and batch {batch}; use a GPU count that is a product of "
            "a divisor of heads and a divisor of layers, and a batch divisible by dp"
        )
    predictions = [predict(model, cluster, layout, batch) for layout in layouts]
    fits = sorted((q for q in predictions if q.feasible), key=lambda q: q.seconds)
    if not fits:
        least = min(predictions, key=lambda q: q.memory_bytes)
        raise PlanError(
            f"no layout of {gpus} GPUs fits in memory; the smallest: {least.reason}; "
            "use more GPUs or a cluster with more memory per GPU"
        )
    return Ranking(ranked=tuple(fits), infeasible=tuple(q for q in predictions if not q.feasible))
