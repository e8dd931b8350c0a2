"""The check that replaces FSDP2's view warning where only the loss reads a sharded module's
output: an in-place change of that view would drop the hook that gathers and reduces the
sharded parameters' gradients, so it is refused instead of warned about on every step."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from meshsplit.batch import tensors

__all__: list[str] = []


@contextmanager
def quiet_view_warning(units: Iterable[Any]) -> Iterator[None]:
    """Silence FSDP2's warning that a sharded module returned a view (torch 2.13; older ones
    say nothing) for `units` only, those whose output only the loss reads: every other
    unit's view, read by the model's own code, still warns."""
    names = sorted({re.escape(type(unit).__name__) for unit in units})
    if not names:
        yield
        return
    pattern = rf"FSDP2-wrapped module \(({'|'.join(names)})\) returned a view tensor"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        yield


def views_of(output: Any) -> list[tuple[torch.Tensor, int]]:
    """Each view among `output`'s tensors with its version, to compare after the loss."""
    return [(t, t._version) for t in tensors(output) if t._is_view()]


def check_unchanged(views: list[tuple[torch.Tensor, int]]) -> None:
    """Raise when the loss changed one of `views` in place: backward would run without
    FSDP2's hooks, and no gradient would reach the shards."""
    if any(t._version != version for t, version in views):
        raise RuntimeError(
            "loss_fn changed the model's output in place; under Plan.zero=2/3 that "
            "output is a view carrying the hook that gathers and reduces the sharded "
            "parameters' gradients, and the change drops it: compute the loss out of "
            "place (out = out * t, not out *= t)"
        )
