"""A user's dataset as (inputs, targets) tensors, and its labels checked against a model's output.

A dataset is a pair (tensors or NumPy arrays; inputs may be a dict or tuple of them) or a
torch Dataset of (input, target) pairs, gathered with default_collate. Floating inputs take
the model's floating dtype, as a Keras layer casts its inputs; integer labels become int64,
the dtype PyTorch's classification losses take.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from meshsplit.batch import LossFn
from meshsplit.job.input_errors import InputError

__all__: list[str] = []


def as_pair(dataset: Any, name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(inputs, targets) as tensors from a pair or a torch Dataset of pairs."""
    if isinstance(dataset, DataLoader):
        raise TypeError(
            f"{name} is a DataLoader: pass its dataset and batch size instead, "
            "fit(loader.dataset, batch_size=loader.batch_size)"
        )
    if isinstance(dataset, (Dataset, IterableDataset)):
        items = list(dataset) if isinstance(dataset, IterableDataset) else _items(dataset)
        if not items:
            raise InputError(f"{name} is empty")
        dataset = default_collate(items)
    if not isinstance(dataset, (tuple, list)) or len(dataset) != 2:
        raise TypeError(
            f"{name} must be (inputs, targets) or a torch Dataset of (input, target) pairs; "
            f"got {type(dataset).__name__}"
            + (f" of {len(dataset)} items" if isinstance(dataset, (tuple, list)) else "")
        )
    inputs, targets = (as_tensors(part, dtype) for part in dataset)
    targets = pytree.tree_map(_long_labels, targets)
    return inputs, targets


def _items(dataset: Dataset[Any]) -> list[Any]:
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"a map-style Dataset needs __len__; {type(dataset).__name__} has none")
    return [dataset[index] for index in range(len(dataset))]


def as_tensors(tree: Any, dtype: torch.dtype) -> Any:
    """NumPy arrays become tensors; floating tensors take the model's floating dtype (as a
    Keras layer casts its inputs to its own dtype)."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(leaf)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            leaf = leaf.to(dtype)
        return leaf

    return pytree.tree_map(one, tree)


def _long_labels(leaf: Any) -> Any:
    """Integer labels as int64, the dtype PyTorch's classification losses take."""
    if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and leaf.dtype != torch.bool:
        return leaf.long()
    return leaf


def float_dtype(model: nn.Module) -> torch.dtype:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.get_default_dtype()


def check_classes(loss_fn: LossFn, output: Any, targets: Any, name: str) -> None:
    """Class labels outside the model's classes, refused for the whole dataset at once."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return
    if not isinstance(output, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return
    if targets.is_floating_point() or output.dim() < 2:
        return  # class probabilities, or one unbatched row
    classes = output.shape[1]
    labels = targets[targets != loss_fn.ignore_index]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise InputError(
            f"{name} has class labels {int(labels.min())}..{int(labels.max())} but the model "
            f"gives {classes} classes (output {tuple(output.shape)}); labels must lie in "
            f"0..{classes - 1}"
        )
