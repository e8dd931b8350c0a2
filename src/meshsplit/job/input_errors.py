"""Bad input: an exception raised inside the model's forward (or the loss) is traced back to
the layer that raised it, so the user reads which layer refused which shape, not torch's
bare message from deep inside a split model.

`explain_input_error` finds the innermost module whose `forward` was running; the error is
re-raised as an `InputError` naming that module (its path in this rank's part of the
model), what its weight expects and the shape it received, with the rank, stage and tp
index.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["InputError"]


class InputError(ValueError):
    """A batch a layer cannot take (wrong shape, dtype or class range)."""


def explain_input_error(
    error: BaseException,
    model: nn.Module,
    inputs: Any,
    where: str,
    others: dict[str, Any] | None = None,
) -> InputError | None:
    """An InputError naming the layer (of `model`, or one of `others` such as the loss)
    `error` was raised in, or None if it came from elsewhere: a collective, an error of our
    own, a module that holds other modules (then the original error stands)."""
    if isinstance(error, (InputError, dist.DistError)) or not isinstance(
        error, (RuntimeError, ValueError, IndexError, TypeError)
    ):
        return None
    functions = {
        fn.__code__: name for name, fn in (others or {}).items() if hasattr(fn, "__code__")
    }
    function = _innermost_function(error.__traceback__, functions)
    if function is not None:
        called, args = function
        return InputError(
            f"{where}: {called} received {_describe(tuple(args))} and failed: {error}. The "
            f"global batch was {_describe(inputs)}; check its targets (shape, dtype, class "
            "range) against the model's output"
        )
    module, received = _innermost_module(error.__traceback__)
    if module is None or next(module.children(), None) is not None:
        return None
    names = {id(m): name for name, m in model.named_modules()}
    names |= {id(m): name for name, m in (others or {}).items() if isinstance(m, nn.Module)}
    layer = names.get(id(module))
    if layer is None:
        return None
    expects = _expectation(module)
    got = _describe(received)
    sent = _describe(inputs)
    return InputError(
        f"{where}: layer {layer or '(the model)'!r} ({type(module).__name__}"
        f"{', ' + expects if expects else ''}) received {got} and failed: {error}. "
        f"The global batch was {sent}; check its shape, dtype and class range "
        "against the model"
    )


def _innermost_function(
    trace: TracebackType | None, functions: dict[Any, str]
) -> tuple[str, list[Any]] | None:
    """The last of `functions` (code object -> name) the exception passed through, with
    its first two arguments; None if it passed through none."""
    found = None
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code in functions:
            names = frame.f_code.co_varnames[: min(2, frame.f_code.co_argcount)]
            found = (functions[frame.f_code], [frame.f_locals.get(n) for n in names])
        trace = trace.tb_next
    return found


def _innermost_module(
    trace: TracebackType | None,
) -> tuple[nn.Module | None, Any]:
    """The module whose forward the exception left last, and that forward's first input."""
    found: tuple[nn.Module | None, Any] = (None, None)
    while trace is not None:
        frame = trace.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and frame.f_code.co_name == "forward":
            args = [frame.f_locals[n] for n in frame.f_code.co_varnames[1:2] if n in frame.f_locals]
            found = (owner, args[0] if args else None)
        trace = trace.tb_next
    return found


def _expectation(module: nn.Module) -> str:
    """What a layer's weights say it takes, in words ('' when they say nothing)."""
    for attribute, words in (
        ("in_features", "expects {} input features (the last dim)"),
        ("in_channels", "expects {} input channels (dim 1)"),
        ("num_embeddings", "expects indices below {}"),
        ("normalized_shape", "expects trailing dims {}"),
        ("num_features", "expects {} features (dim 1)"),
    ):
        value = getattr(module, attribute, None)
        if value is not None:
            return words.format(tuple(value) if isinstance(value, (list, tuple)) else value)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return ""
    if weight.dim() == 2 and type(module).__name__.endswith("Linear"):  # a split Linear
        shard = tuple(weight.shape)
        return f"expects {shard[1]} input features (the last dim; weight shard {shard})"
    return f"weight {tuple(weight.shape)}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__
