"""Expert split (Plan.ep): each experts module keeps 1/ep of its experts on each ep rank.

An experts module is one called as `experts(hidden_states, top_k_index, top_k_weights)`
(Hugging Face transformers v5's MoE families, GPT-OSS's spelling of the same call, or a
user's own with that call), or one that every token runs (Llama 4's, dense.py), whose experts
lie along dim 0 of its fused parameters. Its class becomes a subclass whose forward sends
each token to the ranks holding its experts (dispatch.py) and runs the module's own forward
there on the rows that arrived, each with its local expert and weight 1; the router's
weights are applied where the token lives. State-dict names stay the original's; only the
expert dimension shrinks, so the unsplit state gathers back along dim 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.experts.dense import dense_dispatch, is_dense
from meshsplit.experts.dispatch import dispatch
from meshsplit.gather import all_gather_flat
from meshsplit.mesh import Mesh
from meshsplit.plan_values import PlanError, divisors

__all__: list[str] = []

CALLS = (
    ("hidden_states", "top_k_index", "top_k_weights"),
    ("hidden_states", "router_indices", "routing_weights"),
)
"""How an experts module is called: the tokens, each one's top-k expert indices and their
weights (transformers v5's one shape for its MoE families; GPT-OSS names the same three
arguments the second way)."""


@dataclass(frozen=True)
class ExpertSplit:
    """One experts module as it was split."""

    path: str
    experts: int
    per_rank: int
    tensors: tuple[str, ...]
    """Its parameters split along dim 0 (names under the module)."""
    listed: str | None = None
    """The ModuleList child holding the experts, when they are modules (else fused)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.path,
            "experts": self.experts,
            "per_rank": self.per_rank,
            "tensors": list(self.tensors) or [f"{self.listed}.*"],
        }


def find_experts(model: nn.Module, named: Mapping[str, str] | None) -> list[str]:
    """The experts modules of `model`: those `named` (Plan.ep_plan), else every module
    called like one whose parameters hold the experts along dim 0."""
    modules = dict(model.named_modules())
    if named:
        missing = [path for path in named if path not in modules]
        if missing:
            raise PlanError(
                f"Plan.ep_plan names {missing}, which are not modules of "
                f"{type(model).__name__}; name experts modules such as "
                "'model.layers.0.mlp.experts'"
            )
        return list(named)
    found = list(experts_in(model))
    if not found:
        raise PlanError(
            f"Plan.ep > 1 but {type(model).__name__} has no experts module (one called as "
            "experts(hidden_states, top_k_index, top_k_weights) with the experts along dim 0 "
            "of its 3-D parameters; experts that take tokens sorted by expert, as JetMoE's, "
            "are not split); use ep=1, or name them in Plan.ep_plan"
        )
    return found


def experts_in(model: nn.Module) -> dict[str, int]:
    """Path -> number of experts of every experts module of `model` (empty: a dense model),
    found as `find_experts` finds them unnamed; for the planner, which asks of any model."""
    return {
        path: count
        for path, module in model.named_modules()
        if _experts_call(module) and (count := _count(module))
    }


def call_names(cls: type[nn.Module]) -> tuple[str, ...] | None:
    """The names an experts class's forward takes (tokens, indices, weights) by, if it is
    called like one (see CALLS)."""
    try:
        names = tuple(list(inspect.signature(cls.forward).parameters)[1:4])
    except (TypeError, ValueError):
        return None
    return names if names in CALLS else None


def routing_arguments(
    names: tuple[str, ...] | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, Any, Any]:
    """(tokens, top-k indices, top-k weights) of one call of an experts module, passed by
    position or by the module's own names."""
    passed = [*args[:3], *(kwargs[n] for n in (names or ())[len(args) : 3] if n in kwargs)]
    if len(passed) != 3:
        raise TypeError(
            f"an experts module takes (tokens, top-k indices, top-k weights); got "
            f"{len(args)} positional arguments and {sorted(kwargs)}"
        )
    return passed[0], passed[1], passed[2]


def dispatched_bytes(experts: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Bytes of the rows ep sends for one call of an experts module: tokens x top-k rows
    (the rows that are not zero, for experts that every token runs)."""
    if is_dense(type(experts)):
        routed = args[0] if args else next(iter(kwargs.values()))
        rows = int(routed.ne(0).any(-1).sum())
        return rows * routed.shape[-1] * routed.element_size()
    hidden, index, _ = routing_arguments(call_names(type(experts)), args, kwargs)
    return hidden.numel() * hidden.element_size() * index.shape[-1]


def _experts_call(module: nn.Module) -> bool:
    return is_dense(type(module)) or call_names(type(module)) is not None


def _count(module: nn.Module) -> int | None:
    """The number of experts: the shared dim 0 of the module's 3-D parameters, or the length
    of its one ModuleList (None: neither)."""
    counts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if len(counts) == 1:
        return counts.pop()
    listed = _listed(module)
    return len(getattr(module, listed)) if listed is not None else None


def _listed(module: nn.Module) -> str | None:
    """The name of the module's one ModuleList child (experts as modules), if it has one."""
    lists = [name for name, child in module.named_children() if isinstance(child, nn.ModuleList)]
    return lists[0] if len(lists) == 1 else None


def split_experts(
    model: nn.Module,
    paths: list[str],
    group: dist.ProcessGroup,
    capacity_factor: float | None,
    realize: Callable[[nn.Module], AbstractContextManager[None]] = lambda _: nullcontext(),
) -> list[ExpertSplit]:
    """Keep this ep rank's experts of each module in `paths`, in place (every ep rank calls).

    `realize(module)` holds a module's own weights while its experts are cut from them (a
    model each rank builds in parts keeps them on the meta device otherwise)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    splits = []
    for path in paths:
        module = model.get_submodule(path)
        experts = _count(module)
        if experts is None:
            raise PlanError(
                f"{path} ({type(module).__name__}) holds neither 3-D parameters with the "
                "experts along dim 0 nor one ModuleList of experts; name only experts modules "
                "in Plan.ep_plan"
            )
        if experts % ranks:
            raise PlanError(
                f"Plan.ep={ranks} does not divide the {experts} experts of {path}; use ep in "
                f"{divisors(experts)}"
            )
        per_rank = experts // ranks
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        names = []
        listed = None if any(p.dim() == 3 for p in module.parameters(False)) else _listed(module)
        if listed is not None:  # others' experts become empty places: names stay global
            whole = getattr(module, listed)
            setattr(module, listed, nn.ModuleList(_mine_or_empty(whole, mine)))
        with realize(module):
            kept = {
                name: nn.Parameter(param.detach()[mine].clone(), param.requires_grad)
                for name, param in module.named_parameters(recurse=False)
                if param.dim() >= 1 and param.shape[0] == experts
            }
        for name, param in kept.items():  # after: what realize gives back goes to meta again
            setattr(module, name, param)
            names.append(name)
        if listed is None and getattr(module, "num_experts", None) == experts:
            setattr(module, "num_experts", per_rank)  # noqa: B010 (the module's own forward reads it)
        for name, value in (
            ("ep_group", group),
            ("ep_experts", experts),
            ("ep_capacity", capacity_factor),
            ("ep_first", 0 if listed is None else mine.start),
            ("dropped_tokens", 0),
        ):
            setattr(module, name, value)
        module.__class__ = _expert_parallel_class(type(module))
        splits.append(ExpertSplit(path, experts, per_rank, tuple(names), listed))
    return splits


def _mine_or_empty(experts: nn.ModuleList, mine: slice) -> list[nn.Module]:
    """This rank's experts in their places, an empty module in every other's."""
    return [e if mine.start <= i < mine.stop else nn.Identity() for i, e in enumerate(experts)]


class ExpertParallel:
    """Mixed in first: tokens go to their experts' ranks and come back weighted."""

    ep_group: dist.ProcessGroup
    ep_experts: int
    ep_capacity: float | None
    ep_first: int
    """What the module's forward calls this rank's first expert: 0 when fused (the local
    slice), its global index when the experts are a ModuleList (their places are kept)."""
    dropped_tokens: int
    ep_call: tuple[str, ...] | None
    """The names the experts class takes its three arguments by (None: by position only)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden_states, top_k_index, top_k_weights = routing_arguments(self.ep_call, args, kwargs)
        local_forward = super().forward  # type: ignore[misc]

        def run_local(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(len(rows), 1, dtype=top_k_weights.dtype, device=rows.device)
            return local_forward(rows, (local + self.ep_first).unsqueeze(-1), ones)

        output, dropped = dispatch(
            hidden_states, top_k_index, top_k_weights, self.ep_experts, self.ep_group,
            run_local, self.ep_capacity,
        )  # fmt: skip
        self.dropped_tokens += dropped
        return output


class DenseExpertParallel(ExpertParallel):
    """Mixed in first for experts that every token runs: the rows that are not zero go to
    their experts' ranks and come back in their places (dense.py)."""

    def forward(self, routed: torch.Tensor) -> torch.Tensor:
        own_forward = super(ExpertParallel, self).forward  # type: ignore[misc]
        output, dropped = dense_dispatch(
            routed, self.ep_experts, self.ep_group, own_forward, self.ep_capacity
        )
        self.dropped_tokens += dropped
        return output


_CLASSES: dict[type, type] = {}
"""One expert-parallel subclass per experts class."""


def _expert_parallel_class(cls: type[nn.Module]) -> type:
    if cls not in _CLASSES:
        mixin = DenseExpertParallel if is_dense(cls) else ExpertParallel
        _CLASSES[cls] = type(
            f"ExpertParallel{cls.__name__}", (mixin, cls), {"ep_call": call_names(cls)}
        )
    return _CLASSES[cls]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's two expert groups: the ep ranks that divide the experts among them, and
    the dp ranks that hold the same experts (whose expert gradients are summed)."""

    ep: dist.ProcessGroup
    same_experts: dist.ProcessGroup | None
    """None when dp == ep: no other rank holds these experts."""


def expert_groups(mesh: Mesh, ep: int) -> ExpertGroups:
    """Carve ep out of dp (consecutive dp ranks share the experts out) on every stage and tp
    rank; every rank creates every group, in one order."""
    dp = mesh.size("dp")
    mine = mesh.rank("dp")
    ep_group = same_group = None
    for stage in range(mesh.size("pp")):
        for tp_rank in range(mesh.size("tp")):
            at = [mesh.global_rank(dp=d, pp=stage, tp=tp_rank) for d in range(dp)]
            here = stage == mesh.rank("pp") and tp_rank == mesh.rank("tp")
            for block in range(dp // ep):
                group = mesh.new_group(at[block * ep : (block + 1) * ep])
                if here and mine // ep == block:
                    ep_group = group
            if dp == ep:
                continue
            for offset in range(ep):
                group = mesh.new_group(at[offset::ep])
                if here and mine % ep == offset:
                    same_group = group
    assert ep_group is not None
    return ExpertGroups(ep_group, same_group)


def expert_layouts(splits: list[ExpertSplit]) -> set[str]:
    """The state-dict names (from the model's root) split along dim 0 over ep (experts held
    as modules keep their names, each on the ranks that hold it)."""
    return {f"{s.path}.{name}" if s.path else name for s in splits for name in s.tensors}


def unshard_experts(
    state: Mapping[str, torch.Tensor], splits: list[ExpertSplit], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """`state` with every expert tensor gathered whole along dim 0 (every ep rank calls,
    in key order)."""
    split = expert_layouts(splits)
    ranks = dist.get_world_size(group)
    whole = {}
    for key, value in state.items():
        if key in split:
            gathered = value.new_empty((ranks * value.shape[0], *value.shape[1:]))
            all_gather_flat(gathered, value.contiguous(), group=group)
            value = gathered
        whole[key] = value
    prefixes = tuple(f"{s.path}.{s.listed}." for s in splits if s.listed is not None)
    if prefixes:  # experts as modules: each rank holds its own names; all take all
        mine = {k: v.cpu() for k, v in whole.items() if k.startswith(prefixes)}
        everyone: list[Any] = [None] * ranks
        dist.all_gather_object(everyone, mine, group=group)
        for held in everyone:
            whole.update({k: v.to(next(iter(state.values())).device) for k, v in held.items()})
    return whole


def dropped_tokens(model: nn.Module, splits: list[ExpertSplit]) -> int:
    """Token slots the split experts modules dropped so far (Plan.capacity_factor)."""
    modules = [model.get_submodule(split.path) for split in splits]
    return sum(m.dropped_tokens for m in modules if isinstance(m, ExpertParallel))


def parameters_of(model: nn.Module, splits: list[ExpertSplit]) -> list[nn.Parameter]:
    """The expert parameters this rank holds (reduced over the ranks holding the same)."""
    fused = [getattr(model.get_submodule(s.path), name) for s in splits for name in s.tensors]
    listed = [
        p
        for s in splits
        if s.listed is not None
        for p in model.get_submodule(f"{s.path}.{s.listed}").parameters()
    ]
    return fused + listed
