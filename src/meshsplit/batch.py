"""Batches as pytrees: a tensor, or a dict / tuple / list of tensors, split along rows.

A model's input may be one tensor (`model(x)`), a tuple or list (`model(*x)`), or a dict of
keyword arguments (`model(**x)`, as Hugging Face models take `input_ids`, `attention_mask`);
every tensor leaf has the batch in dimension 0. Its output may be any pytree the loss takes.
Both the axes and the engine split batches through these helpers, so one rule holds
everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__: list[str] = []

LossFn = Callable[[Any, Any], torch.Tensor]


def loss_weight(loss_fn: LossFn, rows: int, global_rows: int) -> float:
    """Factor that turns a micro-batch loss into its share of the global-batch loss.

    A mean-reduced loss over `rows` of `global_rows` samples weighs rows / global_rows;
    a sum-reduced loss is already additive.
    """
    if getattr(loss_fn, "reduction", "mean") == "sum":
        return 1.0
    return rows / global_rows


def call_model(model: nn.Module, inputs: Any) -> Any:
    """model(inputs): a dict is keyword arguments, a tuple or list positional ones."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of a pytree, in pytree order."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def shapes(tree: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The shapes and dtypes of a batch's tensors: what makes two steps allocate alike."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors(tree))


def rows(tree: Any) -> int:
    """The batch size: dimension 0 of the first tensor leaf (every leaf must agree)."""
    leaves = tensors(tree)
    if not leaves:
        raise ValueError(f"a batch needs at least one tensor; got {type(tree).__name__}")
    sizes = {len(leaf) if leaf.dim() else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every tensor of a batch needs the batch in dimension 0 with one size; "
            f"got sizes {sorted(str(s) for s in sizes)}"
        )
    return int(next(iter(sizes)))  # type: ignore[arg-type]


def split_rows(tree: Any, parts: int) -> list[Any]:
    """`tree` as `parts` contiguous row slices (torch.tensor_split on every tensor leaf)."""
    if isinstance(tree, torch.Tensor):  # the common case, without a walk of the tree
        return list(tree.tensor_split(parts))
    pieces = [
        leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) else [leaf] * parts
        for leaf in pytree.tree_leaves(tree)
    ]
    spec = pytree.tree_structure(tree)
    return [pytree.tree_unflatten([p[k] for p in pieces], spec) for k in range(parts)]


def take_rows(tree: Any, index: torch.Tensor | slice) -> Any:
    """The rows `index` of every tensor leaf (for shuffled batches and slicing)."""
    return pytree.tree_map(lambda t: t[index] if isinstance(t, torch.Tensor) else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def cat_rows(trees: list[Any]) -> Any:
    """Inverse of `split_rows`: concatenate the pieces' tensor leaves along dimension 0."""
    leaves = [pytree.tree_leaves(tree) for tree in trees]
    spec = pytree.tree_structure(trees[0])
    joined = [
        torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0]
        for column in zip(*leaves, strict=True)
    ]
    return pytree.tree_unflatten(joined, spec)


def scores(
    outputs_of: Callable[[Any], Any], loss_fn: LossFn, inputs: Any, targets: Any, batch_size: int
) -> dict[str, float]:
    """Mean loss over `inputs` taken `batch_size` rows at a time, and accuracy (argmax of the
    last dimension) where the outputs are class scores for integer targets."""
    total, correct, positions, count = 0.0, 0, 0, rows(inputs)
    for start in range(0, count, batch_size):
        x = take_rows(inputs, slice(start, start + batch_size))
        y = take_rows(targets, slice(start, start + batch_size))
        output = outputs_of(x)
        total += float(loss_fn(output, y)) * rows(y)
        if _holds_classes(output, y):
            correct += int((output.argmax(-1) == y).sum())
            positions += y.numel()
    result = {"loss": total / count}
    if positions:
        result["accuracy"] = correct / positions
    return result


def _holds_classes(output: Any, targets: Any) -> bool:
    """Whether `output` holds class scores for integer `targets` (last dimension: classes)."""
    return (
        isinstance(output, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and not targets.is_floating_point()
        and output.shape[:-1] == targets.shape
    )
