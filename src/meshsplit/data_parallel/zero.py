"""Sharded training state over dp (ZeRO): stage 1 on ZeroRedundancyOptimizer, stages 2 and 3
on FSDP2's `fully_shard`.

Per rank, with Ψ parameters and K bytes of optimizer state per parameter byte (fp32 Adam:
K = 2): stage 1 holds Ψ + Ψ + KΨ/dp, stage 2 Ψ + (1 + K)Ψ/dp, stage 3 (2 + K)Ψ/dp plus a
block's gathered parameters (and the next one's, prefetched) at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from meshsplit.data_parallel.allreduce import GradientSync, float32_sums
from meshsplit.mesh import local_tensor
from meshsplit.plan import PlanError

__all__: list[str] = []


def shard_optimizer(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    params: list[nn.Parameter],
    group: dist.ProcessGroup,
) -> torch.optim.Optimizer:
    """ZeRO stage 1: each dp rank keeps and steps the state of ~1/dp of the parameters.

    Gradients are still all-reduced in full; after its step each rank broadcasts the
    parameters it owns, so every replica ends the step with the same weights. The user's
    factory is probed once on a dummy parameter to learn the optimizer class and settings.
    """
    probe = make_optimizer([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(probe)).parameters
    settings = {key: value for key, value in probe.defaults.items() if key in accepted}
    # parameters as views of one flat bucket per owner: a broadcast per rank after the step,
    # not one per parameter (38 -> 2 for the reference transformer at dp=2)
    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=type(probe),
        process_group=group,
        parameters_as_bucket_view=True,
        **settings,
    )


def shard_state(
    module: nn.Module,
    units: list[str],
    group: dist.ProcessGroup,
    *,
    stage: int,
    root_runs: bool,
    bucket_mb: float,
    reduce_dtype: torch.dtype | None = None,
    keep_whole: Iterable[nn.Parameter] = (),
    ignored: Iterable[nn.Parameter] = (),
) -> ShardedGradients:
    """ZeRO stages 2 and 3 on FSDP2: each unit of `module` (a block, a pipeline item) is
    `fully_shard`ed over the dp `group`, so each rank holds 1/dp of its parameters, gradients
    and (through the sharded parameters) optimizer state.

    Forward all-gathers a unit's parameters before it runs; backward reduce-scatters its
    gradients after. Stage 3 frees the gathered parameters after each unit's forward and
    gathers them again for its backward; stage 2 keeps them from forward to backward (less
    traffic, more memory). Gradients are summed, not averaged, over dp: the loss is already
    weighted by each replica's share of the batch. A unit that shares a parameter with code
    outside it (a tied embedding) or holds one of `keep_whole` (shared with another stage)
    is not a unit; when `module` itself runs forward (`root_runs`) it is sharded too and
    takes the parameters no unit took, else they stay whole and all-reduce in buckets.
    Gradients are reduced in `reduce_dtype` (None: their own); parameters are gathered in
    theirs (fp32 master weights: mixed precision is the autocast's, as without sharding).
    `ignored` parameters (experts split over ep, synced over their own group) stay as they
    are, inside units or not, and out of the buckets.
    """
    mesh = DeviceMesh.from_group(group, _device_type(module))
    reshard = stage == 3
    kept_whole = {id(p) for p in keep_whole}
    left_alone = set(ignored)
    wrapped = _exclusive(module, _runnable(module, units), kept_whole)
    if root_runs:  # small units ride with the root: a gather each costs more than it saves
        wrapped = [*_large(module, wrapped), ""]
    taken: set[int] = set()
    for name in wrapped:  # all checked before any is sharded: a refusal leaves the model as it was
        unit = [
            p
            for p in module.get_submodule(name).parameters()
            if id(p) not in taken and p not in left_alone
        ]
        _check_gatherable(unit, name, stage)
        taken |= {id(p) for p in unit}
    # the whole model's last block runs backward right after its forward, and the root (the
    # small pieces) first and last: gathering them again would repeat the gather just done
    # (FSDP2 keeps its root gathered by default, torchtitan its last block too)
    kept_gathered = {"", wrapped[-2]} if root_runs and len(wrapped) > 1 else {""}
    for name in wrapped:
        fully_shard(
            module.get_submodule(name),
            mesh=mesh,
            reshard_after_forward=reshard and name not in kept_gathered,
            mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
            ignored_params=left_alone or None,
        )
    reduction = _ExchangeReduceScatter(overlaps=reduce_dtype is None)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    if root_runs:  # one FSDP root runs every unit in this order: each prefetches the next
        in_order = [
            cast(FSDPModule, module.get_submodule(name)) for name in wrapped[-1:] + wrapped[:-1]
        ]
        for block, after in zip(in_order, in_order[1:], strict=False):
            block.set_modules_to_forward_prefetch([after])
    if mesh.device_type == "cpu":  # gloo blocks the caller: overlap by hand
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_all_gather(_AsyncAllGather())
                sub.set_custom_reduce_scatter(reduction)
    whole = [p for p in module.parameters() if not isinstance(p, DTensor) and p not in left_alone]
    return ShardedGradients(
        module, GradientSync(whole, group, bucket_mb, reduce_dtype=reduce_dtype), reduction
    )


def _check_gatherable(params: list[nn.Parameter], name: str, stage: int) -> None:
    """FSDP2 gathers a unit's parameters (those no inner unit took) as one flat buffer: one
    dtype, dense."""
    dtypes = sorted({str(p.dtype) for p in params})
    where = f"{name!r}" if name else "the model"
    if len(dtypes) > 1:
        raise PlanError(
            f"Plan.zero={stage} cannot shard {where}: its parameters mix {', '.join(dtypes)} "
            "and a sharded unit is gathered as one buffer of one dtype; cast the model to "
            "one dtype, or use zero=1 (optimizer state only) or zero=0"
        )
    odd = [p for p in params if p.layout != torch.strided or p.is_meta]
    if odd:
        raise PlanError(
            f"Plan.zero={stage} cannot shard {where}: it holds {odd[0].layout} or meta "
            "parameters, which cannot be gathered; materialize them as dense tensors, or use "
            "zero=1 or zero=0"
        )


UNIT_FLOOR_BYTES = 2**20
"""A unit's parameters below this ride with the root: each unit costs a gather and a
reduction of fixed cost (about a millisecond on gloo, with FSDP2's hooks) that saves less
memory than it costs time; between steps they are sharded all the same."""


def _runnable(module: nn.Module, units: list[str]) -> list[str]:
    """The units FSDP2 can wrap: a container the model walks itself (a ModuleList of a
    stage's blocks, as Twins keeps them; a ModuleDict) has no forward to hook, so its
    children with parameters stand for it."""
    found: list[str] = []
    for name in units:
        unit = module.get_submodule(name)
        if isinstance(unit, nn.ModuleList | nn.ModuleDict):
            holders = [n for n, c in unit.named_children() if any(True for _ in c.parameters())]
            found += _runnable(module, [f"{name}.{child}" for child in holders])
        else:
            found.append(name)
    return found


def _large(module: nn.Module, units: list[str]) -> list[str]:
    """The units holding at least 1/(2n) of the parameters of all n units, and at least
    UNIT_FLOOR_BYTES."""
    sizes = {
        u: sum(p.numel() * p.element_size() for p in module.get_submodule(u).parameters())
        for u in units
    }
    total = sum(sizes.values())
    return [u for u in units if sizes[u] * 2 * len(units) >= total and sizes[u] >= UNIT_FLOOR_BYTES]


def _exclusive(module: nn.Module, units: list[str], whole: set[int]) -> list[str]:
    """The units with trainable parameters that nothing outside them also holds."""
    holders: dict[int, set[str | None]] = {}
    for path, p in module.named_parameters(remove_duplicate=False):
        unit = next((u for u in units if path.startswith(u + ".")), None)
        holders.setdefault(id(p), set()).add(unit)
    kept = []
    for name in units:
        params = list(module.get_submodule(name).parameters())
        alone = all(holders[id(p)] == {name} and id(p) not in whole for p in params)
        if alone and any(p.requires_grad for p in params):
            kept.append(name)
    return kept


class _PlainBuffers:
    """FSDP2's custom collectives allocate their flat buffers here: plain empty tensors."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _AsyncAllGather(_PlainBuffers, AllGather):
    """FSDP2's all-gather on gloo as sends and receives between each pair of ranks, always
    started asynchronously. gloo's all-gather took 2-3x as long as the pairs exchanging their
    shards directly (CNN's fc1, 18 MiB, dp=2: 22-37 ms against 11-13 ms here), and it blocks
    the caller, so a gather prefetched for the next block would not overlap this block's
    compute (FSDP2 waits for the returned work before it copies the parameters out)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        size, me = group.size(), group.rank()
        pieces = output_tensor.chunk(size)
        if pieces[me].data_ptr() != input_tensor.data_ptr():  # FSDP2 gathers in place
            pieces[me].copy_(input_tensor)
        others = [r for r in range(size) if r != me]
        if dist.get_backend(group) == "fake":  # the estimate's group sends nothing: the same
            for r in others:  # zeros each gather, so a recompute reads what its forward read
                pieces[r].zero_()
            # a work, as a worker's gather returns: FSDP2 keeps the gathered buffer until the
            # next unit's gather only after a synchronous one, which workers never run
            return _AllOf([])
        works = _swap(group, {r: input_tensor for r in others}, {r: pieces[r] for r in others})
        return _AllOf(works) if works else None


def _swap(
    group: dist.ProcessGroup, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]
) -> list[dist.Work]:
    """Start sending sends[r] to, and receiving receives[r] from, each rank r of `group`."""
    ops = []
    for other in sends:
        peer = dist.get_global_rank(group, other)
        ops.append(dist.P2POp(dist.isend, sends[other], peer, group))
        ops.append(dist.P2POp(dist.irecv, receives[other], peer, group))
    return dist.batch_isend_irecv(ops) if ops else []


class _AllOf(dist.Work):
    """One work that is done when all of `works` are: FSDP2 waits on a single one."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True


class _ExchangeReduceScatter(_PlainBuffers, ReduceScatter):
    """FSDP2's reduce-scatter on gloo as each pair of ranks exchanging the slices the other
    owns, then summing what arrived into this rank's own: (dp-1)/dp of the buffer sent per
    rank, half of what an all-reduce moves (gloo's reduce-scatter clones and all-reduces the
    whole buffer: 32 ms for the CNN's 19 MB here, its all-reduce 20 ms). While `overlapping`,
    the exchange runs on as backward goes on, one at a time: the slice lands when the next
    unit reduces, or at `settle`."""

    def __init__(self, overlaps: bool) -> None:
        self.overlaps = overlaps
        """Whether a step may overlap at all: not when FSDP2 casts the reduced gradient at once
        (a reduce dtype of its own)."""
        self.overlapping = False
        self._pending: tuple[list[dist.Work], torch.Tensor, list[torch.Tensor]] | None = None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.settle()
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the sharded gradients are summed, not reduced with {op}")
        size, me = group.size(), group.rank()
        slices = input_tensor.chunk(size)
        if size == 1:
            output_tensor.copy_(slices[me])
            return None
        first, *rest = [r for r in range(size) if r != me]
        # the first peer's slice arrives in the output itself: no buffer at dp=2
        arriving = {first: output_tensor} | {r: torch.empty_like(output_tensor) for r in rest}
        works = _swap(group, {r: slices[r] for r in arriving}, arriving)
        # the input stays alive (its slice) until settled
        self._pending = (works, output_tensor, [slices[me], *(arriving[r] for r in rest)])
        if not self.overlapping:
            self.settle()
        return None

    def settle(self) -> None:
        """Wait for the exchange in flight, if any, and add this rank's own slice."""
        if self._pending is None:
            return
        works, output, addends = self._pending
        self._pending = None
        for work in works:
            work.wait()
        for addend in addends:
            output.add_(addend)


class ShardedGradients:
    """The gradient sync of a module FSDP2 shards: it reduce-scatters during backward, so a
    step only waits for the last reduction and the buckets of the parameters left whole, and
    drops the gradients after the optimizer used them."""

    def __init__(
        self, module: nn.Module, whole: GradientSync, reduction: _ExchangeReduceScatter
    ) -> None:
        self.sharded = [p for p in module.parameters() if isinstance(p, DTensor)]
        self.whole = whole
        self.reduction = reduction

    def begin_step(self, backward_passes: int) -> None:
        """Every micro-batch's backward reduce-scatters and adds to the sharded gradient (then
        at once: FSDP2 adds the reduced slice to the last micro-batch's as it arrives)."""
        self.reduction.overlapping = self.reduction.overlaps and backward_passes == 1
        self.whole.begin_step(backward_passes)

    def finish(self) -> None:
        """Land the reduction still in flight; FSDP2 waited for the others during backward."""
        self.reduction.settle()
        self.whole.finish()

    def zero_grad(self) -> None:
        self.whole.zero_grad()
        for p in self.sharded:
            p.grad = None

    def gradient_tensors(self) -> list[torch.Tensor]:
        """This rank's gradient shards (after backward; none between steps), and the buckets."""
        return [*self._shards(), *self.whole.gradient_tensors()]

    def gradient_sums(self) -> list[torch.Tensor]:
        return [*float32_sums(self._shards()), *self.whole.gradient_sums()]

    def _shards(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self.sharded if p.grad is not None]

    def gradient_bytes(self) -> int:
        """What this rank's gradients take while they exist."""
        shards = sum(local_tensor(p).numel() * p.element_size() for p in self.sharded)
        return shards + self.whole.gradient_bytes()

    def newest_parameters(self) -> None:
        """Nothing to do: every replica's shards took the same summed gradients."""

    def close(self) -> None:
        self.whole.close()
        self.sharded = []


def gather_shards(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every FSDP2 shard gathered whole (a collective over dp: every rank calls)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _device_type(module: nn.Module) -> str:
    first = next(module.parameters(), None)
    return first.device.type if first is not None else "cpu"
