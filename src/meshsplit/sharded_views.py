"""The check that replaces FSDP2's view warning: an in-place change of a view a sharded module
returned drops the hook that gathers and reduces its parameters' gradients. FSDP2 warns of
every such view, changed or not (T5's blocks return one on every step); meshsplit watches
the views instead and refuses the change where one happens."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

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


class ViewWatch:
    """The views the sharded units of `root` return while training, with their versions:
    FSDP2's warning about them is silenced (`watching`), and `check`, after the loss, raises
    where one was changed in place, naming the unit."""

    def __init__(self, root: nn.Module) -> None:
        # (a pipeline chunk holds its layers under their model names, '/' for '.')
        names = {id(m): name.replace("/", ".") for name, m in root.named_modules()}
        self.units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self._seen: list[tuple[torch.Tensor, int, str]] = []
        self._watching = False
        """Whether a forward `watching` runs now (a recomputation in backward is not)."""
        for unit in self.units:
            name = names[id(unit)]

            def record(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                if self._watching and torch.is_grad_enabled():
                    self._seen += [(t, t._version, name) for t in tensors(output) if t._is_view()]

            unit.register_forward_hook(record)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """A forward whose units' views are recorded instead of warned about."""
        self._seen, self._watching = [], True
        try:
            with quiet_view_warning(self.units):
                yield
        finally:
            self._watching = False

    def recomputing(self) -> AbstractContextManager[None]:
        """A backward that may run the forward again (recompute): its units' views feed only
        the recomputed graph, and the forward that made them was checked, so FSDP2's warning
        about them is silenced too."""
        return quiet_view_warning(self.units)

    def check(self) -> None:
        """Raise when a recorded view was changed in place since its unit returned it."""
        changed = sorted({name for t, version, name in self._seen if t._version != version})
        self._seen = []
        if changed:
            what = [f"the output of {name!r}" if name else "the model's output" for name in changed]
            raise RuntimeError(
                f"changed in place after it was returned: {', '.join(what)}; under "
                "Plan.zero=2/3 such an output is a view carrying the hook that gathers and "
                "reduces the module's sharded parameters' gradients, and the change drops it: "
                "change it out of place (out = out * t, not out *= t), or .clone() it first"
            )
