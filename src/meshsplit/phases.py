"""The named phases of a training step ("forward, micro-batch 3", "optimizer step").

Runners and the engine say which phase they are in; whoever watches memory reads the
current phase to label a peak and hears when a phase ends to check a budget there. It sits
below every axis so each can name its phases without knowing who listens; with nobody
listening a phase costs two list operations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__: list[str] = []

_stack: list[str] = []
_listeners: list[Callable[[str], None]] = []
_failed: list[str] = []


def current() -> str:
    """The innermost phase running now ('idle' outside a step)."""
    return _stack[-1] if _stack else "idle"


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Run the body as phase `name`; listeners hear its name when it ends without error."""
    _stack.append(name)
    try:
        yield
    except BaseException:
        if not _failed:
            _failed.append(name)
        raise
    finally:
        _stack.pop()
    for listener in list(_listeners):
        listener(name)


def failed_in() -> str:
    """The innermost phase the last error escaped from (then forgotten), or 'idle'."""
    name = _failed[0] if _failed else "idle"
    _failed.clear()
    return name


@contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Call `listener(name)` at the end of every phase while the body runs."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
