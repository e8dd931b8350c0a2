"""Stalls in any code of a launched job, the user's own collectives included, named.

Every worker posts once a second where the thread running the job is: the collective it is
in, or none, and the line of the job's code that led there, read from that thread's stack
(nothing runs per collective). When a collective ends on the process group's timeout, the
error names the operation, where it was called, and where each other rank was last seen:
the ranks not in it are the ones that never joined.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.job.watchdog import CollectiveTimeout

__all__: list[str] = []

_TORCH = str(Path(torch.__file__).parent)
_PACKAGE = str(Path(__file__).parent.parent)
_COLLECTIVES = "distributed_c10d.py"


class StackWatch:
    """Posts every `beat_s` the collective this rank's job thread is in, and its line."""

    def __init__(self, store: dist.Store, beat_s: float = 1.0) -> None:
        self.store, self.beat_s = store, beat_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._job = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshsplit-stacks", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _run(self) -> None:
        while not self._done.wait(self.beat_s):
            where = _place_of(self._job)
            if where is None:
                return
            try:
                self.store.set(f"stacks/{self.rank}", json.dumps(where))
            except Exception:  # noqa: BLE001 - the store went with the job: nothing to post
                return

    def explain(self, error: BaseException) -> BaseException:
        """A CollectiveTimeout naming the operation and the ranks not in it, for an error
        that ended a collective on the process group's timeout; else `error` itself."""
        if "timed out" not in str(error).lower() or isinstance(error, CollectiveTimeout):
            return error
        mine = _place(list(traceback.walk_tb(error.__traceback__)))
        if mine["collective"] is None:
            return error
        parts, missing = [], []
        now = time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                seen = json.loads(self.store.get(f"stacks/{rank}"))
            except Exception:  # noqa: BLE001 - never posted, or the store is gone
                parts.append(f"rank {rank}: never heard from")
                missing.append(rank)
                continue
            state = f"in {seen['collective']}" if seen["collective"] else "not in a collective"
            parts.append(f"rank {rank}: {state}, at {seen['site']} ({now - seen['at']:.0f} s ago)")
            if seen["collective"] != mine["collective"]:
                missing.append(rank)
        never = f"; rank(s) {missing} never joined it" if missing else ""
        return CollectiveTimeout(
            f"rank {self.rank} timed out in {mine['collective']} called at {mine['site']}{never}"
            f" — " + "; ".join(parts) + f". The wait ended on the process group's timeout "
            f"(ms.launch(timeout_s=...)): {str(error).splitlines()[0]}"
        )

    def close(self) -> None:
        atexit.unregister(self.close)
        self._done.set()
        self._thread.join(timeout=2 * self.beat_s)


def _place_of(thread: int) -> dict[str, Any] | None:
    """Where `thread` is now, as text. No frame outlives this call: a frame held while the
    watch sleeps would keep its locals (a closed engine, its tensors) alive."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return None
    try:
        return {**_place(list(traceback.walk_stack(frame))[::-1]), "at": time.time()}
    finally:
        del frame


def _place(frames: list[tuple[FrameType, int]]) -> dict[str, Any]:
    """The torch.distributed collective in `frames` (outermost first), if any, and the job's
    line that led there: the innermost frame outside torch and meshsplit. Read from the
    frames alone: no source line is looked up (linecache would keep whole files)."""
    places = [(f.f_code.co_filename, line, f.f_code.co_name) for f, line in frames]
    collective = next(
        (name for file, _, name in reversed(places) if file.endswith(_COLLECTIVES)), None
    )
    outside = [p for p in places if not p[0].startswith((_TORCH, _PACKAGE))]
    site = outside[-1] if outside else (places[-1] if places else None)
    text = "an unknown place" if site is None else f"{site[0]}:{site[1]} {site[2]}"
    return {"collective": collective, "site": text}
