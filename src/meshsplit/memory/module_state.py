"""The parameters and buffers a module holds itself, not through its children.

A model built rank by rank gets its values one module at a time: the recording (deferred)
and the lazy model (lazy_model) both give real values to, or take them from, one module's
own tensors, so both walk them with this one helper.
"""

from __future__ import annotations

import torch
from torch import nn


def own_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module`'s own parameters, then buffers, by name, in registration order; unset ones
    (None) left out, a tensor registered under two names listed under both."""
    named = [*module._parameters.items(), *module._buffers.items()]
    return [(name, tensor) for name, tensor in named if tensor is not None]
