"""The named phases of a training step ("forward, micro-batch 3", "optimizer step").

Runners and the engine say which phase they are in; whoever watches memory labels peaks and
checks budgets by phase, and a clock (see timeline.py) hears every phase and wait. It sits
below every axis so each can name its phases without knowing who listens.
Rationale: docs/internals.md#phasespy
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__: list[str] = []


@dataclass(frozen=True)
class Span:
    """One phase or wait as a clock hears it: its times in the clock's seconds, and how many
    phases enclosed it."""

    name: str
    start: float
    end: float
    depth: int
    wait: bool = False
    args: dict[str, Any] = field(default_factory=dict)


class Clock(Protocol):
    """Tells the time (it may first let a device finish its queued work) and hears spans."""

    def now(self) -> float: ...

    def hear(self, span: Span) -> None: ...


_stack: list[str] = []
_waits: list[tuple[str, Callable[[], dict[str, Any]] | None, float]] = []
"""The waits for other ranks running now: (name, details, monotonic start), innermost last."""
_broken: list[tuple[str, Callable[[], dict[str, Any]] | None, float]] = []
"""The last wait an error escaped from (a timeout, a peer gone)."""
_listeners: list[Callable[[str], None]] = []
_clocks: list[Clock] = []
_failed: list[str] = []
_waited = [0.0]
"""Seconds this process has spent in outermost waits for other ranks, since it started."""


def current() -> str:
    """The innermost phase running now ('idle' outside a step)."""
    return _stack[-1] if _stack else "idle"


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Run the body as phase `name`; listeners hear its name when it ends without error."""
    start = _clocks[-1].now() if _clocks else None
    _stack.append(name)
    try:
        yield
    except BaseException:
        if not _failed:
            _failed.append(name)
        raise
    finally:
        _stack.pop()
    if start is not None and _clocks:
        _hear(Span(name, start, _clocks[-1].now(), len(_stack)))
    for listener in list(_listeners):
        listener(name)


@contextmanager
def waiting(name: str, details: Callable[[], dict[str, Any]] | None = None) -> Iterator[None]:
    """Mark the body as a wait for other ranks; clocks hear it with `details()` as its args
    (called only when a clock listens). The current phase stays the enclosing one."""
    start = _clocks[-1].now() if _clocks else None
    _waits.append((name, details, time.monotonic()))
    try:
        yield
    except BaseException:
        _broken[:] = [(f"{name} ({current()})", details, _waits[-1][2])]
        raise
    finally:
        _, _, began = _waits.pop()
        if not _waits:
            _waited[0] += time.monotonic() - began
    if start is not None and _clocks:
        args = details() if details is not None else {}
        _hear(Span(name, start, _clocks[-1].now(), len(_stack), wait=True, args=args))


def compute_clock() -> float:
    """Seconds on a clock that stands still while this process waits for other ranks: the
    time between two readings is compute, not communication."""
    return time.monotonic() - _waited[0]  # the clock the waits are summed on


def current_wait() -> tuple[str, dict[str, Any], float] | None:
    """The innermost wait for other ranks running now: its name, details and monotonic
    start (a watchdog thread reads it while the main thread waits), or None."""
    return _described(list(_waits))


def broken_wait() -> tuple[str, dict[str, Any], float] | None:
    """The last wait an error escaped from, as `current_wait` gives it, its name followed by
    the phase it broke in (then forgotten)."""
    waits, _broken[:] = list(_broken), []
    return _described(waits)


def _described(
    waits: list[tuple[str, Callable[[], dict[str, Any]] | None, float]],
) -> tuple[str, dict[str, Any], float] | None:
    if not waits:
        return None
    name, details, started = waits[-1]
    return name, details() if details is not None else {}, started


def _hear(span: Span) -> None:
    for clock in list(_clocks):
        clock.hear(span)


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


@contextmanager
def clocked(clock: Clock) -> Iterator[None]:
    """Let `clock` hear every phase and wait that ends without error while the body runs."""
    _clocks.append(clock)
    try:
        yield
    finally:
        _clocks.remove(clock)
