"""Stop requests (`StopRequest`, used by `Engine.fit`): preemption or Ctrl-C stops every rank
after the same step, with a checkpoint, instead of killing them mid-step.

SIGTERM or SIGINT asks the loop to stop at the next step boundary; one all-reduce a step
tells every rank whether any was asked, so all stop after the same step, save and raise
`TrainingStopped`. The first signal puts the default handlers back, so a second one ends
the process at once, even inside a collective, before it can touch the last complete
checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TrainingStopped"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(RuntimeError):
    """Training stopped on request (SIGTERM, SIGINT) at a step boundary, after saving."""


class StopRequest:
    """While active (main thread only), SIGTERM and SIGINT ask to stop at a step boundary."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        """The signal that asked this process to stop (None: none did)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._asked)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _asked(self, number: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(number)
        for other in STOP_SIGNALS:  # a second signal: the default action, at once
            signal.signal(other, signal.SIG_DFL)
        self._previous = {}

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def agreed(
        self, device: torch.device, group: dist.ProcessGroup | None
    ) -> signal.Signals | None:
        """The signal any rank of `group` was asked to stop by, or None (a collective over
        `group`; None: this rank alone)."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], device=device)
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return signal.Signals(int(flag)) if int(flag) else None
