"""Operator split of a fused experts module: every tp rank keeps every expert, with 1/tp of
each expert's inner width (Megatron's column/row pair, inside each expert).

A fused experts module holds its experts along dim 0 of two or more 3-D weights (Hugging Face
transformers v5's MoE families: gate|up fused into one, then down). Each weight splits along
its inner dimension (a fused gate|up as two halves split alike, or as adjacent gate/up pairs
split in blocks); each rank's experts then answer every token with a partial sum, summed over
tp after the module, and the gradients of the module's floating inputs (the tokens and their
routing weights) are summed over tp before it. Which dimension is the inner one and how a
fused one is laid out is read from the shapes and proved on the module's own input from the
example: the tp shards' answers must add up to the module's, or it stays whole. A bias added
after the projection out (GPT-OSS's) stays whole, counts on tp rank 0 only (zero elsewhere)
and has its gradient summed over tp.
Rationale: docs/internals.md#tensorexpertspy
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import call_model
from meshsplit.tensor.collectives import copy_all_to_tp, reduce_from_tp
from meshsplit.tensor.dataflow import Realize
from meshsplit.tensor.probe import hooked, quietly
from meshsplit.tensor.shards import ParallelLayer, local_shard
from meshsplit.tensor.units import Decision

__all__: list[str] = []

Layout = tuple[int, int] | None
"""(dim, parts) of a split tensor (see shards.py); None: whole, counted on tp rank 0 only."""
Call = tuple[tuple[Any, ...], dict[str, Any]]
"""The positional and keyword arguments of one call of a module."""
MAX_LAYOUTS = 64
"""Candidate layouts proved per module at most (the shapes leave one or two in practice)."""


@dataclass(frozen=True)
class ExpertLayouts:
    """How one experts module splits: every direct tensor's layout."""

    layouts: dict[str, Layout]
    inner: int
    """The inner width of each expert, before the split."""

    def described(self) -> str:
        split = ", ".join(
            f"{name} dim {layout[0]}" + (f" in {layout[1]} parts" if layout[1] > 1 else "")
            for name, layout in self.layouts.items()
            if layout is not None
        )
        once = [name for name, layout in self.layouts.items() if layout is None]
        rank0 = f"; {', '.join(once)} whole, added on tp rank 0" if once else ""
        return f"each expert's inner width {self.inner} split ({split}){rank0}: one all-reduce"


def fused_experts(module: nn.Module) -> dict[str, nn.Parameter] | None:
    """The module's own tensors if it is a fused experts module: two or more 3-D weights and
    any 2-D biases, all sharing dim 0 (the experts); else None."""
    own = {name: p for name, p in module.named_parameters(recurse=False)}
    weights = [p for p in own.values() if p.dim() == 3]
    if len(weights) < 2 or any(p.dim() not in (2, 3) for p in own.values()):
        return None
    experts = {int(p.shape[0]) for p in own.values()}
    return own if len(experts) == 1 else None


def calls_of(model: nn.Module, example: Any, modules: Mapping[str, nn.Module]) -> dict[str, Call]:
    """Each module's first call's arguments on one forward of `example` (detached copies)."""
    calls: dict[str, Call] = {}

    def keep(name: str) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in calls:
                detach = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
                calls[name] = pytree.tree_map(detach, (args, kwargs))

        return hook

    register: list[Callable[[], Any]] = [
        functools.partial(m.register_forward_pre_hook, keep(name), with_kwargs=True)
        for name, m in modules.items()
    ]
    with quietly(model), hooked(register):
        call_model(model, example)
    return calls


def prove(module: nn.Module, call: Call, tp: int, realize: Realize) -> ExpertLayouts | str:
    """The first candidate layout whose tp shards' answers add up to the module's on `call`,
    or why none does."""
    with realize(module), torch.no_grad():
        own = dict(module.named_parameters(recurse=False))
        args, kwargs = call
        whole = type(module).forward(module, *args, **kwargs)  # hooks (lent weights) aside
        if not isinstance(whole, torch.Tensor) or not whole.abs().max() > 0:
            return "its output on the example is not a tensor with a value to check"
        tried = 0
        for layouts, inner in _candidates(own, _hidden(call), tp):
            tried += 1
            answers = [_shard_answer(module, own, layouts, rank, tp, call) for rank in range(tp)]
            if _adds_up(answers, whole):
                return ExpertLayouts(layouts, inner)
            if tried == MAX_LAYOUTS:
                break
    shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own.items())
    return (
        f"no split of its inner width adds up to its output ({tried} layouts of {shapes} "
        f"tried for tp={tp})"
    )


def _adds_up(answers: list[torch.Tensor | None], whole: torch.Tensor) -> bool:
    """Whether every shard answered, in the whole's shape, and the answers sum to it."""
    if any(a is None or a.shape != whole.shape for a in answers):
        return False
    total = torch.stack(answers).sum(0)  # type: ignore[arg-type]
    return torch.allclose(total, whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))


def _hidden(call: Call) -> int | None:
    """The width of the tokens the module is called with (its first tensor argument)."""
    first = next((t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)), None)
    return None if first is None or first.dim() == 0 else int(first.shape[-1])


def _candidates(
    own: Mapping[str, torch.Tensor], hidden: int | None, tp: int
) -> Iterator[tuple[dict[str, Layout], int]]:
    """Layouts the shapes allow: each 3-D weight along a dimension that is not the tokens'
    width (either, when both are), in one block or two halves; each 2-D bias alike, or whole
    when it has the tokens' width."""
    options: list[list[Layout]] = []
    for p in own.values():
        dims = [d for d in range(1, p.dim()) if p.shape[d] != hidden] or list(range(1, p.dim()))
        choices: list[Layout] = [
            (d, parts) for d in dims for parts in (1, 2) if p.shape[d] % (parts * tp) == 0
        ]
        if p.dim() == 2 and p.shape[1] == hidden:
            choices.append(None)
        options.append(choices)
    for combination in itertools.product(*options):
        layouts = dict(zip(own, combination, strict=True))
        widths = {own[n].shape[lay[0]] // lay[1] for n, lay in layouts.items() if lay is not None}
        if widths:
            yield layouts, min(widths)


def _shard_answer(
    module: nn.Module,
    own: Mapping[str, torch.Tensor],
    layouts: Mapping[str, Layout],
    rank: int,
    tp: int,
    call: Call,
) -> torch.Tensor | None:
    """What tp rank `rank` of the split would answer (None if its forward cannot run)."""
    shard = copy.copy(module)
    shard._parameters = {n: _local(own[n], lay, rank, tp) for n, lay in layouts.items()}  # type: ignore[misc]
    args, kwargs = call
    try:
        answer = type(module).forward(shard, *args, **kwargs)
    except Exception:  # a layout the forward cannot run on is not the module's
        return None
    return answer if isinstance(answer, torch.Tensor) else None


def _local(tensor: torch.Tensor, layout: Layout, rank: int, tp: int) -> torch.Tensor:
    if layout is None:
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return local_shard(tensor, *layout, rank, tp)


class ExpertTensorParallel(ParallelLayer):
    """Mixed into an experts module's own class: its forward on this rank's shards, the
    floating inputs entering the tp region and the partial answers summed over tp."""

    layouts: dict[str, Layout]

    def shard_layouts(self) -> dict[str, tuple[int, int]]:
        return {name: lay for name, lay in self.layouts.items() if lay is not None}

    def split_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        floating = [k for k, leaf in enumerate(leaves) if _floating(leaf)]
        entered = copy_all_to_tp([leaves[k] for k in floating], self.group)
        for k, value in zip(floating, entered, strict=True):
            leaves[k] = value
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        saved: dict[str, Any] = {}
        if dist.get_rank(self.group) != 0:  # whole biases count once: zero here, in the graph
            for name in (n for n, lay in self.layouts.items() if lay is None):
                saved[name] = self._parameters[name]
                self._parameters[name] = saved[name] * 0.0
        try:
            answer = super().forward(*args, **kwargs)
        finally:
            self._parameters.update(saved)
        return reduce_from_tp(answer, self.group)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def split_experts_module(
    module: nn.Module, layouts: Mapping[str, Layout], group: dist.ProcessGroup
) -> nn.Module:
    """`module` split over the tp `group` as `layouts` says (every tp rank calls): a new
    module object of a subclass of its class, holding this rank's shards (the original is left
    as it was: a lazily built model's goes back to meta when the split has read it)."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    cls = type(module)
    module = copy.copy(module)  # hooks stay shared: the lazy split's lending ones go from both
    module._parameters = dict(module._parameters)
    for name, layout in layouts.items():
        if layout is not None:
            whole = module._parameters[name]
            assert whole is not None
            shard = local_shard(whole.detach(), *layout, rank, tp).clone()
            module._parameters[name] = nn.Parameter(shard, requires_grad=whole.requires_grad)

    @functools.wraps(cls.forward)  # its signature too: the expert split reads the call's names
    def forward(self: ExpertTensorParallel, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.split_forward(*args, **kwargs)

    module.__class__ = type(
        f"TensorParallel{cls.__name__}", (ExpertTensorParallel, cls), {"forward": forward}
    )
    split = cast(ExpertTensorParallel, module)
    split.group, split.parts, split.layouts = group, 1, dict(layouts)
    return split


def experts_decisions(
    model: nn.Module,
    example: Any,
    others: list[Decision],
    tp: int,
    realize: Realize,
    inside: set[str],
) -> list[Decision]:
    """`others` with each fused experts module among them split by its inner width where a
    layout is proved on its input from `example`, or kept whole saying why; one `inside` a
    split pair (reading split values) stays as it is."""
    candidates = {
        d.name: module
        for d in others
        if d.split == "replicate" and d.name not in inside
        if fused_experts(module := model.get_submodule(d.name)) is not None
    }
    if not candidates:
        return others
    calls = calls_of(model, example, candidates)
    decided = []
    for decision in others:
        if decision.name not in candidates:
            decided.append(decision)
            continue
        call = calls.get(decision.name)
        module = candidates[decision.name]
        proof = prove(module, call, tp, realize) if call else "not called on the example"
        if isinstance(proof, str):
            why = f"mixture-of-experts weights kept whole on every tp rank: {proof}"
            decided.append(replace(decision, reason=why))
            continue
        once = tuple(f"{decision.name}.{n}" for n, lay in proof.layouts.items() if lay is None)
        decided.append(
            replace(
                decision,
                split="experts",
                reason=proof.described(),
                layouts=tuple(proof.layouts.items()),
                summed=once,
            )
        )
    return decided
