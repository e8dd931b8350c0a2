"""Each parallel layer equals its plain PyTorch layer: output, input gradient, weight gradients."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshsplit as ms
from meshsplit import tensor

from reference import ATOL, RTOL

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _pair(first: nn.Module, second: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """first as column (output left split), second as row (input taken split)."""
    if isinstance(first, CONVOLUTIONS):
        transposed = isinstance(second, TRANSPOSED)
        row = tensor.RowParallelConvTranspose if transposed else tensor.RowParallelConv
        return nn.Sequential(
            tensor.ColumnParallelConv.from_module(first, group),
            nn.ReLU(),
            row.from_module(second, group),
        )
    return nn.Sequential(
        tensor.ColumnParallelLinear.from_module(first, group),
        nn.ReLU(),
        tensor.RowParallelLinear.from_module(second, group),
    )


# name -> (plain layer, input, how to split a copy of it over a group)
Case = tuple[nn.Module, torch.Tensor, Callable[[nn.Module, dist.ProcessGroup], nn.Module]]


def _cases() -> dict[str, Callable[[], Case]]:
    def column_linear() -> Case:
        return (
            nn.Linear(12, 8),
            torch.randn(3, 5, 12),
            lambda m, g: tensor.ColumnParallelLinear.from_module(m, g, gather_output=True),
        )

    def row_linear() -> Case:
        return (
            nn.Linear(8, 6),
            torch.randn(4, 8),
            lambda m, g: tensor.RowParallelLinear.from_module(m, g, scatter_input=True),
        )

    def linear_pair() -> Case:
        plain = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 6))
        return plain, torch.randn(4, 10), lambda m, g: _pair(m[0], m[2], g)

    def column_conv() -> Case:
        return (
            nn.Conv2d(3, 8, 3, padding=1),
            torch.randn(2, 3, 6, 6),
            lambda m, g: tensor.ColumnParallelConv.from_module(m, g, gather_output=True),
        )

    def row_conv() -> Case:
        return (
            nn.Conv2d(8, 5, 3, stride=2),
            torch.randn(2, 8, 7, 7),
            lambda m, g: tensor.RowParallelConv.from_module(m, g, scatter_input=True),
        )

    def conv_pair() -> Case:
        plain = nn.Sequential(nn.Conv2d(2, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
        return plain, torch.randn(2, 2, 8, 8), lambda m, g: _pair(m[0], m[2], g)

    def column_conv_transpose() -> Case:
        return (
            nn.ConvTranspose2d(3, 8, 4, stride=2, padding=1),
            torch.randn(2, 3, 5, 5),
            lambda m, g: tensor.ColumnParallelConvTranspose.from_module(m, g, gather_output=True),
        )

    def row_conv_transpose() -> Case:
        return (
            nn.ConvTranspose2d(8, 5, 3, stride=2, output_padding=1, dilation=2),
            torch.randn(2, 8, 4, 4),
            lambda m, g: tensor.RowParallelConvTranspose.from_module(m, g, scatter_input=True),
        )

    def conv_then_transpose() -> Case:
        plain = nn.Sequential(
            nn.Conv2d(2, 8, 3, stride=2), nn.ReLU(), nn.ConvTranspose2d(8, 3, 2, 2)
        )
        return plain, torch.randn(2, 2, 9, 9), lambda m, g: _pair(m[0], m[2], g)

    def conv1d_pair() -> Case:
        plain = nn.Sequential(
            nn.Conv1d(3, 8, 5, padding=2), nn.ReLU(), nn.Conv1d(8, 6, 3, stride=2)
        )
        return plain, torch.randn(2, 3, 17), lambda m, g: _pair(m[0], m[2], g)

    def conv3d_pair() -> Case:
        plain = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 4, 2))
        return plain, torch.randn(2, 2, 5, 6, 4), lambda m, g: _pair(m[0], m[2], g)

    def conv1d_then_transpose() -> Case:
        plain = nn.Sequential(
            nn.Conv1d(3, 8, 3, stride=2),
            nn.ReLU(),
            nn.ConvTranspose1d(8, 5, 4, 2, output_padding=1),
        )
        return plain, torch.randn(2, 3, 11), lambda m, g: _pair(m[0], m[2], g)

    def column_conv_transpose3d() -> Case:
        return (
            nn.ConvTranspose3d(3, 8, 2, stride=2),
            torch.randn(2, 3, 3, 4, 2),
            lambda m, g: tensor.ColumnParallelConvTranspose.from_module(m, g, gather_output=True),
        )

    def vocab_embedding() -> Case:
        return (
            nn.Embedding(16, 6),
            torch.randint(0, 16, (3, 7)),
            lambda m, g: tensor.VocabParallelEmbedding.from_module(m, g),
        )

    def head_attention() -> Case:
        return ms.models.SelfAttention(16, 4), torch.randn(2, 5, 16), tensor.split_heads

    return {
        "column_linear": column_linear,
        "row_linear": row_linear,
        "linear_pair": linear_pair,
        "column_conv": column_conv,
        "row_conv": row_conv,
        "conv_pair": conv_pair,
        "column_conv_transpose": column_conv_transpose,
        "row_conv_transpose": row_conv_transpose,
        "conv_then_transpose": conv_then_transpose,
        "conv1d_pair": conv1d_pair,
        "conv3d_pair": conv3d_pair,
        "conv1d_then_transpose": conv1d_then_transpose,
        "column_conv_transpose3d": column_conv_transpose3d,
        "vocab_embedding": vocab_embedding,
        "head_attention": head_attention,
    }


def _run(module: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter's gradient of sum(output * weights)."""
    x = x.clone().requires_grad_(x.is_floating_point())
    output = module(x)
    (output * weights).sum().backward()
    result = {"output": output.detach()}
    if x.grad is not None:
        result["grad input"] = x.grad
    return result | {f"grad {name}": p.grad for name, p in module.named_parameters()}


def _check_layers() -> dict[str, str]:
    """Every case on this rank; an error message per failing case ('' when it matches)."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    failures = {}
    for name, make in _cases().items():
        torch.manual_seed(0)
        plain, x, split = make()
        split_module = split(copy.deepcopy(plain), group)
        weights = torch.randn_like(plain(x))
        want = _run(plain, x, weights)
        got = _run(split_module, x, weights)
        dims = tensor.shard_dims(split_module)
        try:
            assert got.keys() == want.keys(), f"{sorted(got)} != {sorted(want)}"
            if isinstance(plain, CONVOLUTIONS + TRANSPOSED):  # code outside reads them
                geometry = ("stride", "padding", "dilation", "kernel_size", "groups")
                geometry += ("in_channels", "out_channels")
                for attribute in geometry:
                    mine, theirs = getattr(split_module, attribute), getattr(plain, attribute)
                    assert mine == theirs, f"{attribute}: {mine} != {theirs}"
            for key, value in want.items():
                param = key.removeprefix("grad ")
                if param in dims:
                    value = value.chunk(tp, dim=dims[param])[rank]
                torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)
            failures[name] = ""
        except AssertionError as error:
            failures[name] = f"rank {rank}: {error}"
    return failures


def _check_split_logits_loss() -> str:
    """Cross-entropy on vocabulary-split logits equals F.cross_entropy on whole ones."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 16) * 4, torch.randint(0, 16, (3, 5))
    whole = logits.clone().requires_grad_()
    want = nn.functional.cross_entropy(whole.flatten(0, 1), targets.flatten())
    want.backward()
    split = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    got = tensor.vocab_parallel_cross_entropy(split, targets, group)
    got.backward()
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg="loss")
        want_grad = whole.grad.chunk(tp, dim=-1)[rank]  # type: ignore[union-attr]
        torch.testing.assert_close(split.grad, want_grad, rtol=RTOL, atol=ATOL, msg="grad")
    except AssertionError as error:
        return f"rank {rank}: {error}"
    return ""


def _check_all() -> dict[str, str]:
    return _check_layers() | {"split_logits_loss": _check_split_logits_loss()}


@functools.cache
def _results(tp: int) -> list[dict[str, str]]:
    return ms.launch(_check_all, tp)


@pytest.mark.parametrize("case", [*_cases(), "split_logits_loss"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layer_matches_plain_layer(tp: int, case: str) -> None:
    for rank_result in _results(tp):
        assert not rank_result[case], rank_result[case]
