"""The layers an operator split can act on, found by walking the model once.

A *unit* is a layer meshsplit has a parallel form for: Linear, Hugging Face Conv1D, a plain
convolution (Conv1d, Conv2d, Conv3d and their transposed forms), Embedding, or an attention
module (Linear children q, k, v, out and an int `n_heads`; torch's nn.MultiheadAttention). A
subclass that brings its own forward (OPT's learned positional embedding offsets its ids) is
not a unit: a parallel layer would drop that behaviour, so it is kept whole; unless it holds
only the base's tensors and gives the base's output on a probe (Falcon's `FalconLinear`
spells out `x @ W.T + b`; an Embedding that multiplies its rows by an `embed_scale`, as
Gemma's and M2M100's do), then it is the base written another way. Layers that share
a parameter are units only as Embeddings tied to each other and to at most one output Linear
(GPT-2's wte/lm_head, T5's shared/encoder/decoder embeddings/lm_head), split once along the
vocabulary; any other sharing is kept whole.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshsplit.memory.lazy_model import LENDS_VALUES
from meshsplit.plan import PlanError
from meshsplit.tensor.attention import HeadParallelAttention
from meshsplit.tensor.conv import CONVOLUTIONS
from meshsplit.tensor.conv1d import is_conv1d
from meshsplit.tensor.conv_transpose import TRANSPOSED
from meshsplit.tensor.layers import embedding_scale
from meshsplit.tensor.multihead import multihead_refusal
from meshsplit.tensor.shards import ParallelLayer

__all__: list[str] = []

ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU)
ELEMENTWISE = (*ACTIVATIONS, nn.Mish, nn.Hardswish, nn.Dropout, nn.Identity)
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
CHANNELWISE = (*ELEMENTWISE, *POOLS, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
BASES: dict[type[nn.Module], str] = {
    nn.Linear: "out_features",
    nn.Embedding: "num_embeddings",
    **dict.fromkeys(CONVOLUTIONS, "out_channels"),
}
"""Classes whose own forward a parallel layer reproduces (a subclass must not override it),
each with the attribute that gives its weight's first dimension."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """How one layer is split over tp, and why."""

    name: str
    """The layer's module name in the model, e.g. 'block0.attn'."""
    layer: str
    """What the layer is, e.g. 'Linear(784->1024)'."""
    split: str
    """'column', 'row', 'vocab', 'heads', 'experts' or 'replicate'."""
    reason: str
    """One line of why."""
    gather_output: bool = False
    """Column split only: gather the split output, since no row layer consumes it."""
    scatter_input: bool = False
    """Row split only: slice a replicated input, since no column layer feeds it split."""
    parts: int = 1
    """Column split only: fused parts (3 for q|k|v in one weight), each split by heads."""
    per_rank: tuple[tuple[str, int], ...] = ()
    """Row split only: ('module.attribute', divisor) of the ints (head counts, split sizes)
    each rank divides (by tp; see dataflow.head_counts for kv heads ranks share)."""
    shared: int = 0
    """Column split only: the kv heads tp ranks share (fewer than tp): the weight stays
    whole, each rank computes its kv head's block, and the gradients are summed over tp."""
    tied: str = ""
    """Vocab/column split only: the layers whose weight this one shares, comma-separated
    (one shared shard)."""
    layouts: tuple[tuple[str, tuple[int, int] | None], ...] = ()
    """Experts only: each of the module's tensors and its (dim, parts) over tp (None: whole,
    counted on tp rank 0)."""
    summed: tuple[str, ...] = ()
    """Parameters (names in the model) whose gradients are summed over tp: a layer kept whole
    that runs inside a split pair on each rank's slice of the activations, a column whose
    kv heads ranks share, or an experts module's whole bias counted on tp rank 0."""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layer": self.layer, "split": self.split, "reason": self.reason}


@dataclass(eq=False)
class Unit:
    """A layer the rule can split, with its partners."""

    name: str
    module: nn.Module
    kind: str
    after: Unit | None = None
    """The row layer this column layer feeds (its output stays split)."""
    feeders: list[Unit] = field(default_factory=list)
    """The column layers that feed this row layer split."""
    split: str = ""
    reason: str = ""
    required: tuple[str, int] | None = None
    """(what, size) that tp must divide, for a split that must happen."""
    parts: int = 1
    per_rank: tuple[tuple[str, int], ...] = ()
    shared: int = 0
    tied: list[Unit] = field(default_factory=list)
    """The layers sharing this one's weight (one shared shard under a vocabulary split)."""
    wiring: dict[str, bool] = field(default_factory=dict)
    """gather_output / scatter_input, when a plan fixed them; otherwise the partners decide."""
    note: str = ""
    """Why a plan's or the data flow's split was not taken, shown before the fallback's reason."""


def is_attention(module: nn.Module) -> bool:
    """An attention module that splits by heads: Linear children q, k, v, out and an int
    `n_heads`, or torch's nn.MultiheadAttention in the forms `multihead.py` runs."""
    if isinstance(module, nn.MultiheadAttention):
        return multihead_refusal(module) is None
    children = dict(module.named_children())
    return isinstance(getattr(module, "n_heads", None), int) and all(
        isinstance(children.get(name), nn.Linear) for name in ("q", "k", "v", "out")
    )


def own_forward(module: nn.Module) -> str | None:
    """The subclass that overrides a base layer's forward with a behaviour of its own, if any."""
    for base in BASES:
        if isinstance(module, base) and type(module).forward is not base.forward:
            return None if _same_as_base(module, base) else type(module).__name__
    for transposed in TRANSPOSED:
        if isinstance(module, transposed) and type(module).forward is not transposed.forward:
            return type(module).__name__  # not probed: kept whole
    return None


def _same_as_base(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether `module` holds just what `base` holds and its forward gives the base's output
    on a random probe, in training and eval mode (random draws from a generator of its own:
    the user's random stream is left as it was)."""
    names = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    hooked = any(not getattr(hook, LENDS_VALUES, False) for hook in hooks)
    scale = {"embed_scale"} & module._non_persistent_buffers_set  # in no state dict
    if names - {"weight", "bias"} - scale or hooked:
        return False
    if not isinstance(getattr(module, "weight", None), torch.Tensor):
        return False
    if any(t.is_meta for t in module.parameters()):
        module = _stand_in(module)
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    device, dtype = weight.device, weight.dtype
    probe = torch.Generator(device=device).manual_seed(0)
    if isinstance(module, nn.Embedding):
        x = torch.randint(0, module.num_embeddings, (2, 3), generator=probe, device=device)
    elif isinstance(module, CONVOLUTIONS):
        size = (1, module.in_channels, *(2 * k + 1 for k in module.kernel_size))
        x = torch.randn(size, generator=probe, device=device, dtype=dtype)
    else:
        shape = (2, 3, int(getattr(module, "in_features")))  # noqa: B009
        x = torch.randn(shape, generator=probe, device=device, dtype=dtype)
    was_training = module.training
    try:
        with torch.no_grad():
            for mode in (True, False):
                module.train(mode)
                own, plain = module(x), base.forward(module, x)
                if isinstance(module, nn.Embedding):
                    plain = plain * embedding_scale(module, plain.dtype)
                if not (isinstance(own, torch.Tensor) and own.shape == plain.shape):
                    return False
                if not torch.allclose(own, plain, rtol=1e-5, atol=1e-6):
                    return False
    except Exception:  # a forward that wants other inputs is not the base's
        return False
    finally:
        module.train(was_training)
    return True


def _stand_in(module: nn.Module) -> nn.Module:
    """A copy of a meta `module` with random weights on the CPU, cut to a few outputs (a
    layer on the meta device has no values to probe; its full size may not fit anywhere)."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    rows = int(weight.shape[0])
    padding = getattr(module, "padding_idx", None)  # an Embedding's must stay a valid row
    outputs = min(rows, max(8, 0 if padding is None else padding % rows + 1))
    probe = torch.Generator().manual_seed(0)
    stand_in = copy.copy(module)
    stand_in._parameters = {
        name: nn.Parameter(
            torch.randn((outputs, *p.shape[1:]), generator=probe, dtype=p.dtype, device="cpu"),
            requires_grad=p.requires_grad,
        )
        for name, p in module._parameters.items()
        if p is not None
    }
    stand_in._buffers = {}
    stand_in._forward_hooks, stand_in._forward_pre_hooks = OrderedDict(), OrderedDict()
    base = next(b for b in BASES if isinstance(module, b))
    setattr(stand_in, BASES[base], outputs)
    return stand_in


def kind_of(module: nn.Module) -> str | None:
    """What parallel form a layer takes (None: none), its own forward aside (own_forward)."""
    if is_attention(module):
        return "attention"
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return "linear"
    convolution = isinstance(module, CONVOLUTIONS + TRANSPOSED)
    if convolution and module.groups == 1 and module.padding_mode == "zeros":
        return "conv"
    if isinstance(module, nn.Embedding) and not (module.max_norm is not None or module.sparse):
        return "embedding"
    return None


def _kept_whole(module: nn.Module) -> str:
    """Why a layer with parameters of its own stays whole on every tp rank."""
    if isinstance(module, CONVOLUTIONS + TRANSPOSED):
        return (
            f"{type(module).__name__} with groups={module.groups}, "
            f"padding_mode={module.padding_mode!r} kept whole: only plain convolutions split "
            "by channels"
        )
    if isinstance(module, nn.MultiheadAttention):
        return multihead_refusal(module) or "nn.MultiheadAttention kept whole"
    shapes = [tuple(p.shape) for p in module.parameters(recurse=False) if p.dim() == 3]
    if shapes:
        return (
            f"{type(module).__name__} holds a 3-D weight {shapes[0]}: kept whole on every tp "
            "rank (experts with one matrix each split when an example proves a split of each "
            "expert's inner width)"
        )
    if isinstance(module, NORMS):
        return "norm kept whole (one weight per feature)"
    return f"{type(module).__name__} has no operator split: kept whole on every tp rank"


NORMS = (
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm
)  # fmt: skip
"""Norms: each normalises over features, or holds one weight or statistic per feature."""


def features(module: Any) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D, or channels of a plain convolution."""
    if is_conv1d(module):
        return module.weight.shape[0], module.nf
    if isinstance(module, CONVOLUTIONS):
        return module.in_channels, module.out_channels
    return module.in_features, module.out_features


def feature_dim(module: nn.Module, value: torch.Tensor) -> int:
    """The dimension of `value` (the layer's input or output) that holds its features: a
    convolution's channels (dim 1), else the last."""
    return 1 if isinstance(module, CONVOLUTIONS) else value.dim() - 1


def describe(module: nn.Module) -> str:
    if is_conv1d(module):
        n_in, out = features(module)
        return f"Conv1D({n_in}->{out})"
    if isinstance(module, nn.Linear):
        return f"Linear({module.in_features}->{module.out_features})"
    if isinstance(module, CONVOLUTIONS + TRANSPOSED):
        kernel = "x".join(map(str, module.kernel_size))
        return f"{type(module).__name__}({module.in_channels}->{module.out_channels}, {kernel})"
    if isinstance(module, nn.Embedding):
        return f"Embedding({module.num_embeddings}x{module.embedding_dim})"
    if is_attention(module):
        return f"{type(module).__name__}({_heads(module)[1]} heads)"
    return type(module).__name__


def _heads(module: Any) -> tuple[str, int]:
    """The attribute holding an attention module's head count, and the count."""
    if isinstance(module, nn.MultiheadAttention):
        return "num_heads", module.num_heads
    return "n_heads", module.n_heads


def split_sizes(unit: Unit) -> dict[str, tuple[str, int]]:
    """For each split of this unit: the dimension it divides, as (name, size)."""
    m: Any = unit.module
    if unit.kind == "linear":
        n_in, out = features(m)
        return {"column": ("out_features", out), "row": ("in_features", n_in)}
    if unit.kind == "conv":
        return {"column": ("out_channels", m.out_channels), "row": ("in_channels", m.in_channels)}
    if unit.kind == "embedding":
        return {"vocab": ("num_embeddings", m.num_embeddings)}
    return {"heads": _heads(m)}


def replicated(name: str, module: nn.Module, why: str) -> Decision:
    return Decision(name=name, layer=describe(module), split="replicate", reason=why)


def walk(model: nn.Module) -> tuple[list[Unit], list[Decision]]:
    """Every splittable layer (Sequential neighbours and ties linked) and every other holder."""
    shared = _shared_parameters(model)
    units: list[Unit] = []
    sharing: list[Unit] = []
    others: list[Decision] = []

    def visit(module: nn.Module, prefix: str) -> None:
        chain = isinstance(module, nn.Sequential)
        previous: Unit | None = None  # the last Linear/convolution, with only elementwise since
        for child_name, child in module.named_children():
            name = prefix + child_name
            if isinstance(child, ParallelLayer | HeadParallelAttention):
                raise PlanError(f"'{name}' is already split over tp; split a model only once")
            subclass = own_forward(child)  # probed once: a subclass may run a probe input
            kind = None if subclass is not None else kind_of(child)
            if kind is not None and any(id(p) in shared for p in child.parameters()):
                sharing.append(Unit(name=name, module=child, kind=kind))
                kind = None
            elif kind is not None:
                unit = Unit(name=name, module=child, kind=kind)
                units.append(unit)
                if chain and previous is not None and previous.kind == kind:
                    previous.after = unit
                    unit.feeders = [previous]
                previous = unit if kind in ("linear", "conv") else None
                continue
            after_conv = previous is not None and previous.kind == "conv"
            if not isinstance(child, CHANNELWISE if after_conv else ELEMENTWISE):
                previous = None
            if subclass is not None:
                others.append(replicated(name, child, f"own forward: {subclass} kept whole"))
                continue
            sharer = any(unit.module is child for unit in sharing)
            if kind is None and not sharer and any(True for _ in child.parameters(recurse=False)):
                others.append(replicated(name, child, _kept_whole(child)))
            visit(child, name + ".")

    visit(model, "")
    tied, kept = _ties(sharing, shared)
    units.extend(tied)
    in_ties = {id(p) for unit in tied for p in unit.module.parameters()}
    others = [o for o in others if not _aliases_only(model.get_submodule(o.name), in_ties)]
    others.extend(kept)
    return units, others


def _aliases_only(module: nn.Module, in_ties: set[int]) -> bool:
    """Whether a module's own parameters are all a tied layer's under a second name (BERT's
    `predictions.bias`): it holds nothing of its own, the tie decides their split."""
    own = [id(p) for p in module.parameters(recurse=False)]
    return bool(own) and all(i in in_ties for i in own)


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _ties(sharing: list[Unit], shared: set[int]) -> tuple[list[Unit], list[Decision]]:
    """Embeddings, and at most one output Linear, sharing only their weight (vocab rows) are
    tied: GPT-2's wte and lm_head, or T5's and BART's shared, encoder and decoder embeddings
    and lm_head. Other sharing is kept whole."""
    by_weight: dict[int, list[Unit]] = {}
    for unit in sharing:
        by_weight.setdefault(id(getattr(unit.module, "weight", None)), []).append(unit)
    tied: list[Unit] = []
    for group in by_weight.values():
        kinds = [unit.kind for unit in group]
        if len(group) < 2 or kinds.count("linear") > 1 or "embedding" not in kinds:
            continue
        if any(kind not in ("embedding", "linear") for kind in kinds):
            continue
        only_weight = all(  # a bias may have an alias outside the layers (BERT's)
            not any(
                p is q for other in sharing if other is not unit for q in other.module.parameters()
            )
            for unit in group
            for name, p in unit.module.named_parameters()
            if name != "weight" and id(p) in shared
        )
        if only_weight and not any(is_conv1d(unit.module) for unit in group):
            for unit in group:
                unit.tied = [other for other in group if other is not unit]
            tied.extend(group)
    kept = [
        replicated(unit.name, unit.module, "shares a parameter with another layer")
        for unit in sharing
        if not unit.tied
    ]
    return tied, kept
