"""BatchNorm whose batch is the global one: statistics gathered over dp, running ones per step.

Per channel, the replicas' counts, means and sums of squared deviations combine by Chan's rule:

    n = Σ n_r,   μ = Σ n_r·μ_r / n,   M2 = Σ (M2_r + n_r·(μ_r − μ)²)
    y = (x − μ)·σ⁻¹·w + b,   σ = sqrt(M2 / n + eps)

forward: all-gather of (n, μ, M2) over dp; backward: all-reduce over dp of Σ dy and Σ dy·x̂;
PyTorch's kernels do the arithmetic. With micro_batches=1 and any dp, training equals one
process on the global batch. Rationale: docs/internals.md#batchnormpy
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from meshsplit.gather import all_gather_flat

__all__ = ["BatchNorm", "commit_batchnorm", "convert_batchnorm", "describe_batchnorm"]

_INPUT_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}
"""Ranks each BatchNorm accepts: (N, C) or (N, C, L); (N, C, H, W); (N, C, D, H, W)."""


def convert_batchnorm(
    model: nn.Module, dp_group: dist.ProcessGroup | None, micro_batches: int
) -> list[str]:
    """Replace, in place, each nn.BatchNorm1d/2d/3d in `model` by a BatchNorm holding its tensors.

    Always converts, even at dp=1 and micro_batches=1: nn.BatchNorm under activation
    recomputation updates its running statistics twice per step, and one kind of layer
    keeps one rule (call `commit_batchnorm` after every step). A subclass with its own
    forward is left as it is (see `batchnorm_subclasses.py`). Returns the names converted.
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive integer")
    if _convertible(model):
        raise TypeError(
            f"the model itself is a {type(model).__name__}, which cannot be replaced in place; "
            "wrap it in nn.Sequential"
        )
    replacements: dict[int, tuple[str, BatchNorm]] = {}  # a shared module stays shared
    for name, module in model.named_modules():
        if _convertible(module):
            new = BatchNorm.from_module(module, dp_group, micro_batches)
            replacements[id(module)] = (name, new)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)][1])
    return [name for name, _ in replacements.values()]


def batchnorm_state(model: nn.Module) -> list[str]:
    """State names of the BatchNorm layers `convert_batchnorm` will rebuild."""
    return [
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if _convertible(module)
        for key in module.state_dict()
    ]


def _convertible(module: nn.Module) -> bool:
    """A PyTorch BatchNorm whose forward is still _BatchNorm's: its rule is known."""
    return isinstance(module, tuple(_INPUT_DIMS)) and type(module).forward is _BatchNorm.forward


def commit_batchnorm(model: nn.Module) -> None:
    """Apply each BatchNorm's statistics accumulated this step to its running statistics.

    Call once per step on every rank, after the backward of the last micro-batch (explicit
    rather than counted: a counter breaks on a short last batch or an extra forward).
    """
    for module in model.modules():
        if isinstance(module, BatchNorm):
            module.commit()


def discard_batchnorm(model: nn.Module) -> None:
    """Forget the statistics accumulated this step (a step dropped as non-finite)."""
    for module in model.modules():
        if isinstance(module, BatchNorm):
            module.discard()


def describe_batchnorm(layers: list[str], dp: int, micro_batches: int) -> dict[str, Any]:
    """The converted `layers` and, in one sentence per axis, their rule ({} if none)."""
    if not layers:
        return {}
    where = f"gathered over dp={dp}" if dp > 1 else "of this process (dp=1)"
    over = f"all {micro_batches} micro-batches" if micro_batches > 1 else "the batch"
    return {
        "layers": list(layers),
        "dp": f"BatchNorm: statistics of each micro-batch {where}",
        "pp": f"BatchNorm: running statistics updated once per step over {over} of all "
        "replicas (as torchgpipe's DeferredBatchNorm)",
    }


class BatchNorm(_BatchNorm):
    """nn.BatchNorm1d/2d/3d over the global batch: same parameters, buffers and state dict.

    Training (or track_running_stats=False): each micro-batch is normalised with its
    statistics over the dp group, and running statistics wait for `commit`. Eval with
    running statistics: nn.BatchNorm's computation, no communication.
    """

    pending_count: torch.Tensor
    """This step's values per channel so far (n), not yet in the running statistics."""
    pending_mean: torch.Tensor
    """Their mean per channel (μ)."""
    pending_m2: torch.Tensor
    """Their sum of squared deviations from μ per channel (M2)."""

    def __init__(
        self,
        num_features: int,
        *,
        input_dims: tuple[int, ...],
        dp_group: dist.ProcessGroup | None,
        micro_batches: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.input_dims = input_dims
        self.dp_group = dp_group
        self.micro_batches = micro_batches
        # buffers, so what saves and restores buffers (the pipeline profiler) restores these;
        # not persistent, so the state dict stays nn.BatchNorm's
        if track_running_stats:
            for name in ("pending_count", "pending_mean", "pending_m2"):
                size = () if name == "pending_count" else (num_features,)
                empty = torch.zeros(size, device=device, dtype=dtype)
                self.register_buffer(name, empty, persistent=False)

    @classmethod
    def from_module(
        cls, module: _BatchNorm, dp_group: dist.ProcessGroup | None, micro_batches: int
    ) -> BatchNorm:
        """A BatchNorm sharing `module`'s parameter and buffer tensors (the same objects)."""
        like = next(iter((*module.parameters(), *module.buffers())), None)
        new = cls(
            module.num_features,
            input_dims=next(d for t, d in _INPUT_DIMS.items() if isinstance(module, t)),
            dp_group=dp_group,
            micro_batches=micro_batches,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            device=like.device if like is not None else None,
            dtype=like.dtype if like is not None else None,
        )
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            setattr(new, name, tensor)
        new.train(module.training)
        return new

    @property
    def dp(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dp={self.dp}, micro_batches={self.micro_batches}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self.input_dims:
            wanted = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(f"expected {wanted} input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        if self.dp == 1:
            return self._local(input)
        count, mean, m2 = moments(input.detach(), self.dp_group)
        # only a replica with <= 1 value per channel reads the count back (a device sync)
        if input.numel() <= input.size(1) and count.item() <= 1:
            raise ValueError(
                f"expected more than 1 value per channel when training, got input size "
                f"{tuple(input.shape)} (dp={self.dp})"
            )
        if self.training and self.track_running_stats and not recomputing():
            self._accumulate(count, mean, m2)
        return Normalize.apply(
            input, mean, m2 / count, self.eps, self.weight, self.bias, count, self.dp_group
        )

    def _local(self, input: torch.Tensor) -> torch.Tensor:
        """Statistics of this process's rows alone: PyTorch's own kernel, forward and
        backward, bit for bit a plain BatchNorm's (a value an ulp from zero before a ReLU
        keeps its side); the running statistics still wait."""
        if not (self.training and self.track_running_stats and not recomputing()):
            return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        # the kernel's own mean and 1/σ feed the running statistics (no second pass)
        if input.numel() <= input.size(1):  # as F.batch_norm checks
            raise ValueError(
                f"expected more than 1 value per channel when training, got input size "
                f"{tuple(input.shape)}"
            )
        output, mean, invstd = torch.native_batch_norm(
            input, self.weight, self.bias, None, None, True, 0.0, self.eps
        )
        with torch.no_grad():
            count = input.new_tensor(float(input.numel() // input.size(1)), dtype=mean.dtype)
            var = (invstd.pow(-2) - self.eps).clamp(min=0)
            self._accumulate(count, mean, var * count)
        return output

    @torch.no_grad()
    def _accumulate(self, count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Fold one micro-batch's (n, μ, M2) into this step's."""
        total = _combine(
            torch.stack([self.pending_count, count]).unsqueeze(1),
            torch.stack([self.pending_mean, mean]),
            torch.stack([self.pending_m2, m2]),
        )
        pending = (self.pending_count, self.pending_mean, self.pending_m2)
        for buffer, value in zip(pending, total, strict=True):
            buffer.copy_(value)

    @torch.no_grad()
    def commit(self) -> None:
        """One nn.BatchNorm running-statistics update with this step's (n, μ, M2); then reset.

        factor = momentum, or 1 / num_batches_tracked when momentum is None (cumulative mean).
        """
        mean, var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        if mean is None or var is None or tracked is None or self.pending_count.item() == 0:
            return  # no running statistics, or this layer did not run this step
        tracked.add_(1)
        factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        unbiased = self.pending_m2 / (self.pending_count - 1)
        mean.mul_(1 - factor).add_(self.pending_mean, alpha=factor)
        var.mul_(1 - factor).add_(unbiased, alpha=factor)
        self.discard()

    @torch.no_grad()
    def discard(self) -> None:
        for buffer in (self.pending_count, self.pending_mean, self.pending_m2):
            buffer.zero_()


def recomputing() -> bool:
    """Whether autograd is running a backward pass now.

    A forward inside backward is activation recomputation (torch.utils.checkpoint redoes
    the forward there, and uses this same test): its statistics were counted already.
    """
    return torch._C._current_graph_task_id() != -1


def moments(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per channel (n, μ, M2) of `x` over all replicas of `group` (one all-gather).

    The local pass is PyTorch's own (what its BatchNorm runs; 2-3x faster on a CPU than
    var_mean over an NCHW input), in float32 for a half-precision input as its kernel keeps
    them, not rounded to the input's dtype.
    """
    local = x.numel() // x.size(1)
    stats = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if local > 0:
        scratch = None if stats == x.dtype else x.new_zeros((2, x.size(1)), dtype=stats)
        mean, var = torch.batch_norm_update_stats(
            x,
            None if scratch is None else scratch[0],
            None if scratch is None else scratch[1],
            0.0,
        )
    else:  # an empty replica (fewer rows than dp) adds nothing
        var = mean = x.new_zeros(x.size(1), dtype=stats)
    count, m2 = mean.new_tensor(float(local)), var * local
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return count, mean, m2
    mine = torch.cat([count.view(1), mean, m2])
    gathered = mine.new_empty(world * mine.numel())
    all_gather_flat(gathered, mine, group=group)
    parts = gathered.view(world, -1)
    channels = x.size(1)
    return _combine(parts[:, :1], parts[:, 1 : 1 + channels], parts[:, 1 + channels :])


def _combine(
    counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, μ, M2) of the union of k parts given as (k, 1) counts and (k, C) means and M2s.

    μ is taken as a correction to the first non-empty part's mean, so parts with equal means
    give that mean exactly: a channel constant on every replica (a dead ReLU channel before
    a biased convolution) normalises to exactly zero, as PyTorch's kernel makes it, instead of
    to an ulp-sized value on either side of the ReLU after it.
    """
    count = counts.sum()
    first = means.index_select(0, torch.argmax((counts.view(-1) > 0).to(torch.int8)).view(1))
    mean = first[0] + (counts * (means - first)).sum(0) / count.clamp(min=1)
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return count, mean, m2


class Normalize(torch.autograd.Function):
    """y = x̂·w + b, x̂ = (x − μ)·σ⁻¹ with μ, σ of the micro-batch over all of dp.

    forward: PyTorch's eval kernel given σ⁻¹·w as weight and a variance of 1 computes what its
    training kernel does with these statistics (x·a + (b − μ·a) fused, σ⁻¹ from float64), so
    a constant channel (a dead ReLU channel plus a bias) lands an ulp from b on the same side
    as in one process. backward: dx = σ⁻¹·(g − mean(g) − x̂·mean(g·x̂)), g = dy·w, means over
    every replica: the eval backward gives this replica's Σ dy and Σ dy·(x − μ) (db, and dw
    after σ⁻¹; the gradient sync sums those over dp), one all-reduce makes them global.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        eps: float,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        count: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        invstd = torch.sqrt(var.double() + eps).reciprocal().to(var.dtype)
        scale = invstd if weight is None else invstd * weight
        ctx.save_for_backward(x, mean, invstd, scale)
        ctx.count, ctx.group = count, group
        return _normalised(x, mean, torch.ones_like(var), scale, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, invstd, scale = ctx.saved_tensors
        ones = torch.ones_like(invstd)
        dy = dy.contiguous()
        _, sum_dy_centred, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, ones, mean, ones, None, None, False, 0.0, [False, True, True]
        )  # eval mode with variance 1: Σ dy·(x − μ) and Σ dy over this replica's rows
        sum_dy_xhat = sum_dy_centred * invstd
        needs = ctx.needs_input_grad
        grad_x = None
        if needs[0]:
            sums = torch.stack([sum_dy, sum_dy_xhat])
            if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
                dist.all_reduce(sums, group=ctx.group)  # a copy: dw and db stay this replica's
            mean_dy, mean_dy_xhat = (sums / ctx.count).unbind()
            slope = -mean_dy_xhat * invstd * scale  # dx's term in (x − μ)
            # (dy − mean_dy)·a − μ·k in the kernel (bias −μ·k), then + x·k
            grad_x = _normalised(dy, mean_dy, ones, scale, -mean * slope).addcmul_(
                x, slope.view(_channel_shape(x))
            )
        return (
            grad_x,
            None,
            None,
            None,
            sum_dy_xhat if needs[4] else None,
            sum_dy if needs[5] else None,
            None,
            None,
        )


def _normalised(x: Any, mean: Any, var: Any, weight: Any, bias: Any) -> torch.Tensor:
    """PyTorch's eval-mode kernel with eps 0 (the op: torch 2.11's F.batch_norm refuses 0)."""
    return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, 0.0, True)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against `x`: (1, C, 1, ...)."""
    return (1, x.size(1), *([1] * (x.dim() - 2)))
