"""Data parallel: gradient sync over dp while backward runs, and the replicas' outputs.

Every `.grad` is a view into a flat bucket: a step's first gradient is copied into it (the
gradients are dropped between steps), later ones accumulate straight into it, and a bucket's
all-reduce starts, asynchronously, as soon as its last gradient of the step arrives.
The loss is pre-scaled by each replica's share, so the sum over dp is the global-batch gradient.
Rationale: docs/internals.md#data_parallelallreducepy
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.gather import all_gather_flat
from meshsplit.phases import waiting

__all__: list[str] = []


@dataclass
class _Bucket:
    flat: torch.Tensor
    """What the all-reduce sums: the gradients, then (the first bucket) any riders."""
    grads: torch.Tensor
    """The gradients alone: a view of flat."""
    params: list[nn.Parameter]
    arrivals: int = 0
    expected: int | None = None
    """Gradient accumulations that complete it in a step: learnt in the first step (a
    parameter that two chunks of a pipeline rank use accumulates twice per micro-batch)."""
    counts: list[int] = field(default_factory=list)
    """Accumulations per parameter while `expected` is learnt."""
    work: Any = None
    wire: torch.Tensor | None = None
    """The bucket cast to the reduce dtype while its all-reduce runs (none in its own dtype)."""
    views: list[torch.Tensor] = field(default_factory=list)


class GradientSync:
    """Sum gradients over `group` in buckets of about `bucket_mb` MiB, overlapping backward."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        bucket_mb: float,
        scan: bool = False,
        reduce_dtype: torch.dtype | None = None,
        riders: int = 0,
    ) -> None:
        self.group = group
        self.riders = riders
        """Slots after the first bucket's gradients for numbers the step sums over dp anyway
        (its loss, its flags): they ride that bucket's all-reduce instead of one of their own."""
        self.carry: Callable[[], torch.Tensor] | None = None
        """What the riders are, asked for as the first bucket's all-reduce starts."""
        self.reduce_dtype = reduce_dtype
        """The dtype buckets are summed in (Plan.reduce_dtype; None: their own)."""
        self.scan = scan
        """Sum this replica's share of each bucket as its all-reduce completes, while later
        ones are in flight (the non-finite check reads the sums: see gradient_sums); the
        whole bucket when riders carry the check's flags (no exchange of its own after)."""
        self._sums: list[torch.Tensor] = []
        self._replica, self._replicas = dist.get_rank(group), dist.get_world_size(group)
        self.active = dist.get_world_size(group) > 1
        self.buckets: list[_Bucket] = []
        self._hooks: list[Any] = []
        self._expected = 1
        trainable = [p for p in params if p.requires_grad]
        for chunk in _chunks(list(reversed(trainable)), int(bucket_mb * 2**20)):
            self._add_bucket(chunk)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        first = params[0]
        size = sum(p.numel() for p in params)
        extra = self.riders if not self.buckets else 0
        flat = torch.zeros(size + extra, dtype=first.dtype, device=first.device)
        bucket = _Bucket(flat=flat, grads=flat[:size], params=params, counts=[0] * len(params))
        offset = 0
        for index, p in enumerate(params):
            view = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = view
            bucket.views.append(view)
            if self.active:  # the hook knows its bucket and view: no lookup per gradient
                arrived = functools.partial(self._arrived, bucket, index, view)
                self._hooks.append(p.register_post_accumulate_grad_hook(arrived))
        self.buckets.append(bucket)

    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) reach each parameter this step;
        a step with another number than the last learns its buckets' arrivals again."""
        if backward_passes != self._expected:
            for bucket in self.buckets:
                bucket.expected, bucket.counts = None, [0] * len(bucket.params)
        self._expected = backward_passes

    def _arrived(
        self, bucket: _Bucket, index: int, view: torch.Tensor, param: torch.Tensor
    ) -> None:
        if bucket.work is not None:
            raise RuntimeError(
                f"a gradient ({tuple(param.shape)}) accumulated after its bucket's all-reduce "
                f"had started: this step reached it more often than the first step did "
                f"({bucket.expected} accumulations complete its bucket); keep which layers "
                "run, and how often, the same from step to step"
            )
        _into_view(param, view)  # later accumulations of this step add to the view
        bucket.arrivals += 1
        if bucket.expected is None:  # the first step: counted, reduced in finish
            bucket.counts[index] += 1
        elif bucket.arrivals == bucket.expected:
            _fold(bucket)  # a weight that got nothing (another came more often) reads zeros
            self._load_riders(bucket)
            bucket.work = dist.all_reduce(self._on_wire(bucket), group=self.group, async_op=True)

    def _load_riders(self, bucket: _Bucket) -> None:
        """Write the riders into the first bucket, just before its all-reduce starts."""
        if self.riders and bucket is self.buckets[0]:
            assert self.carry is not None, "a step with riders sets what they carry first"
            bucket.flat[bucket.grads.numel() :].copy_(self.carry())

    def carried(self) -> torch.Tensor:
        """The riders summed over dp (after finish)."""
        first = self.buckets[0]
        return first.flat[first.grads.numel() :]

    def _on_wire(self, bucket: _Bucket) -> torch.Tensor:
        """What the bucket's all-reduce sums: the bucket, or a copy in the reduce dtype."""
        if self.reduce_dtype is None or self.reduce_dtype == bucket.flat.dtype:
            return bucket.flat
        bucket.wire = bucket.flat.to(self.reduce_dtype)
        return bucket.wire

    def finish(self) -> None:
        """Wait for every bucket's all-reduce; reduce now those a parameter never reached."""
        self._sums = []
        for index, bucket in enumerate(self.buckets):
            if bucket.work is None:  # not started in backward (or one replica: never)
                _fold(bucket)
                self._load_riders(bucket)
            if self.active:
                with waiting("all-reduce wait", functools.partial(_bucket_args, index, bucket)):
                    if bucket.work is None:
                        dist.all_reduce(self._on_wire(bucket), group=self.group)
                    else:
                        bucket.work.wait()
                if bucket.wire is not None:
                    bucket.flat.copy_(bucket.wire)
                    bucket.wire = None
            bucket.work = None
            bucket.arrivals = 0
            if bucket.expected is None:  # each parameter at least once per backward pass
                bucket.expected = sum(max(n, self._expected) for n in bucket.counts)
            if self.scan:  # reduced buckets are alike on every replica: each reads 1/dp of one
                # (all of it when the riders carry no gradient flag to sum over replicas)
                share = (
                    bucket.grads
                    if self.riders
                    else bucket.grads.tensor_split(self._replicas)[self._replica]
                )
                self._sums.append(share.sum(dtype=torch.float32))

    def zero_grad(self) -> None:
        """Drop the gradients: a step's first one lands in its view as a copy, not as an
        addition to zeros written for it (a pass over the buffers saved, as DDP's
        set_to_none does); a parameter no gradient reaches reads zeros (see _fold). Without
        peers there are no hooks to copy it in as it comes: the buffers are zeroed instead, so
        no gradient is held twice until the step ends."""
        for bucket in self.buckets:
            if not self.active:
                bucket.flat.zero_()
                continue
            for p in bucket.params:
                p.grad = None

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The buffers every gradient lives in."""
        return [bucket.grads for bucket in self.buckets]

    def gradient_sums(self) -> list[torch.Tensor]:
        """float32 sums of the buckets (a NaN or infinity anywhere shows in one). With `scan`
        they were taken in finish, this replica's 1/dp of each bucket: the replicas' shares
        cover every bucket once, and the check sums its flag over them all (with riders, the
        whole of each: every replica's answer is then the same without summing it)."""
        if self.scan and len(self._sums) == len(self.buckets):
            return self._sums
        return float32_sums(self.gradient_tensors())

    def newest_parameters(self) -> None:
        """Nothing to do: every replica applied the same summed gradients."""

    def gradient_bytes(self) -> int:
        return sum(b.grads.numel() * b.grads.element_size() for b in self.buckets)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def float32_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's float32 sum: a NaN or infinity anywhere shows in its sum (one
    `_foreach_norm(inf)` took 9.3 ms against 0.6 for these sums of the layer-split benchmark's
    gradients on a CPU; the 2-norm squares, overflowing on large finite values)."""
    return [t.sum(dtype=torch.float32) for t in tensors]


class LocalGradients:
    """One replica: nothing to sum, so no buckets. Autograd makes `.grad` in backward and the
    step drops it after the optimizer (zero_grad(set_to_none=True)), as plain PyTorch does:
    between steps no gradient memory is held."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]

    def begin_step(self, backward_passes: int) -> None:
        """Nothing to prepare."""

    def finish(self) -> None:
        """Nothing to wait for."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def gradient_sums(self) -> list[torch.Tensor]:
        return float32_sums(self.gradient_tensors())

    def newest_parameters(self) -> None:
        """Nothing to do: there is one replica."""

    def gradient_bytes(self) -> int:
        """What the gradients take while they exist (in backward and the optimizer step)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def close(self) -> None:
        self.params = []


def _fold(bucket: _Bucket) -> None:
    """Every gradient of a bucket in its view, before the bucket is reduced."""
    for p, view in zip(bucket.params, bucket.views, strict=True):
        _into_view(p, view)


def _into_view(param: torch.Tensor, view: torch.Tensor) -> None:
    """`param`'s gradient as its bucket view: copied in unless it is there already, zeros
    where no gradient came this step."""
    if param.grad is None:
        view.zero_()
    elif param.grad is not view:
        view.copy_(param.grad)
    param.grad = view


def _bucket_args(index: int, bucket: _Bucket) -> dict[str, Any]:
    """An all-reduce wait's args (built only for a clock): which bucket, its bytes, and
    whether its all-reduce started during backward (else it ran whole in the wait)."""
    return {
        "bucket": index,
        "bytes": bucket.flat.numel() * bucket.flat.element_size(),
        "overlapped": bucket.work is not None,
    }


def _chunks(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of parameters of one dtype and device, each at most cap_bytes (or one)."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device)
        if not same_kind or size + nbytes > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def gather_rows(mine: Any, replica_rows: list[int], group: dist.ProcessGroup) -> Any:
    """The dp replicas' row slices of one output tensor, concatenated on every rank (the
    replicas may hold different row counts: the first holds the most)."""
    if not isinstance(mine, torch.Tensor) or mine.dim() == 0:
        return mine
    longest = replica_rows[0]
    padded = mine.new_zeros((longest, *mine.shape[1:]))
    padded[: len(mine)] = mine
    gathered = mine.new_empty((len(replica_rows) * longest, *mine.shape[1:]))
    all_gather_flat(gathered, padded, group=group)
    pieces = gathered.split(longest)
    return torch.cat([p[:n] for p, n in zip(pieces, replica_rows, strict=True)])
