"""One interceptor of torch.distributed: each operation a rank starts, heard by listeners.

Counting traffic (traffic.py) and checking that ranks agree (desync.py, MESHSPLIT_DEBUG=1)
both need every collective with its arguments; one table of the operations and one set of
wrappers serve both, and either can be on alone or both at once. The wrappers replace the
module-level functions of `torch.distributed` while any listener listens, so every caller
that looks them up as `dist.<name>` (meshsplit, user code, FSDP2's gathers) is heard.
Unheard: calls inside torch itself (DTensor's and the functional collectives, DDP's reducer,
DeviceMesh set-up, what all_gather_object does inside). `isend`/`irecv` stay unwrapped
(`P2POp` checks their identity); they are heard inside `batch_isend_irecv`.

A listener is called before the operation runs, with its name and its bound arguments (those
the caller passed, by parameter name). It may raise, and the operation does not run; it may
return a function, called with the operation's result once it ran (a `recv` from any rank
says whom it heard from only then). The listener added last hears first.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__: list[str] = []


@dataclass(frozen=True)
class Operation:
    """What the listeners read in one torch.distributed operation's arguments."""

    payload: str | None
    """The argument holding the tensors this rank contributes, as count_traffic counts
    them (None: no bytes counted)."""
    counted: bool
    """Whether count_traffic counts the operation's calls (batch_isend_irecv's are counted
    as the isend and irecv they batch)."""
    agree: tuple[str, ...]
    """The arguments every rank of the group must pass alike (shapes and dtypes, the reduce
    op, the root); desync.py checks them."""


OPERATIONS: dict[str, Operation] = {
    "all_reduce": Operation("tensor", True, ("tensor", "op")),
    "broadcast": Operation("tensor", True, ("tensor", "src")),
    "reduce": Operation(None, False, ("tensor", "dst", "op")),
    "all_gather": Operation("tensor", True, ("tensor_list", "tensor")),
    "all_gather_into_tensor": Operation("input_tensor", True, ("output_tensor", "input_tensor")),
    "all_gather_single": Operation("input_tensor", True, ("output_tensor", "input_tensor")),
    "reduce_scatter": Operation(None, False, ("output", "input_list", "op")),
    "reduce_scatter_tensor": Operation("input", True, ("output", "input", "op")),
    "all_to_all_single": Operation("input", True, ("output", "input")),
    "gather": Operation(None, False, ("tensor", "dst")),
    "scatter": Operation(None, False, ("tensor", "src")),
    "barrier": Operation(None, True, ()),
    "all_gather_object": Operation(None, False, ()),
    "broadcast_object_list": Operation(None, False, ("object_list", "src")),
    "send": Operation("tensor", True, ("tensor",)),
    "recv": Operation(None, True, ("tensor",)),
    "batch_isend_irecv": Operation(None, False, ()),
}
"""The operations heard, by name; those this torch lacks are left out (torch 2.13 renames
all_gather_into_tensor to all_gather_single, which torch 2.11 lacks)."""

Listener = Callable[[str, dict[str, Any]], Callable[[Any], None] | None]

_listeners: list[Listener] = []
_originals: dict[str, Callable[..., Any]] = {}
"""The functions of torch.distributed the wrappers replaced, while any listener listens."""


def listen(listener: Listener) -> None:
    """Call `listener` for every operation from now on (the first one installs the wrappers)."""
    if not _listeners:
        for name in OPERATIONS:
            original = getattr(dist, name, None)
            if original is not None:
                _originals[name] = original
                setattr(dist, name, _heard(name, original))
    _listeners.append(listener)


def stop_listening(listener: Listener) -> None:
    """Stop calling `listener` (the last one puts torch.distributed's functions back)."""
    _listeners.remove(listener)
    if not _listeners:
        for name, original in _originals.items():
            setattr(dist, name, original)
        _originals.clear()


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Within the block, call `listener` for every operation."""
    listen(listener)
    try:
        yield
    finally:
        stop_listening(listener)


def _heard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        then = [hear(name, bound) for hear in reversed(tuple(_listeners))]
        result = original(*args, **kwargs)
        for after in then:
            if after is not None:
                after(result)
        return result

    return wrapper
