"""Stalls: a rank that waits too long for its peers says what it waits for and where every
other rank was last seen, so the rank holding the job up is named, not guessed.

`Watchdog` (one thread per engine) posts every second where this rank is (step, phase, the
wait it is in) to the job's store; when a wait for other ranks has lasted past the stall
bound (MESHSPLIT_STALL_WARN_S, default 60 s, as Horovod warns) it prints a warning naming
the wait and where every other rank was last seen — those not waiting, at another step, or
silent are the ones holding the job up. When the process group's timeout
(`ms.launch(timeout_s=...)`) ends the wait, `explain_collective_error` turns gloo's bare
"Timed out waiting ..." into a `CollectiveTimeout` with the same account.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from meshsplit import phases

__all__ = ["CollectiveTimeout"]


class CollectiveTimeout(RuntimeError):
    """A wait for other ranks ran past the process group's timeout."""


def stall_warning_s() -> float:
    """The stall bound: a wait longer than this is warned about (MESHSPLIT_STALL_WARN_S)."""
    return float(os.environ.get("MESHSPLIT_STALL_WARN_S", "60"))


class Watchdog:
    """Posts where this rank is, every `beat_s`, and warns of a wait past `warn_s`."""

    def __init__(
        self,
        store: dist.Store,
        where: str,
        position: Callable[[], dict[str, Any]],
        *,
        warn_s: float,
        beat_s: float = 1.0,
    ) -> None:
        self.store, self.where, self.position = store, where, position
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.warn_s, self.beat_s = warn_s, beat_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshsplit-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # stopped before the interpreter tears the store down

    def _run(self) -> None:
        warned: float | None = None
        while not self._done.wait(self.beat_s):
            try:
                wait = phases.current_wait()
                self._post(wait)
                stalled = wait is not None and time.monotonic() - wait[2] > self.warn_s
                if wait is not None and stalled and warned != wait[2]:
                    warned = wait[2]
                    print(f"meshsplit watchdog: {self.account(wait)}", file=sys.stderr)
            except Exception:  # noqa: BLE001 - the store went with the job: nothing to watch
                return

    def _post(self, wait: tuple[str, dict[str, Any], float] | None) -> None:
        seen = {**self.position(), "wait": None if wait is None else wait[0], "at": time.time()}
        self.store.set(f"watchdog/{self.rank}", json.dumps(seen))

    def others(self) -> dict[int, dict[str, Any]]:
        """Where every other rank was last seen (ranks that never posted are left out)."""
        seen = {}
        for rank in range(self.world_size):
            key = f"watchdog/{rank}"
            if rank != self.rank and self.store.check([key]):
                seen[rank] = json.loads(self.store.get(key))
        return seen

    def account(self, wait: tuple[str, dict[str, Any], float]) -> str:
        """This rank's wait, and every other rank's last known place, in one message."""
        name, details, started = wait
        mine = self.position()
        text = (
            f"{self.where} has waited {time.monotonic() - started:.0f} s in {name}"
            f"{' ' + json.dumps(details) if details else ''} at step {mine['step']}"
            + ("" if name.endswith(")") else f" ({mine['phase']})")
        )
        try:
            others = self.others()
        except Exception:  # noqa: BLE001 - the store is gone: say what this rank knows
            return text + "; where the other ranks are is unknown (the job's store is gone)"
        holding = []
        parts = []
        now = time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            seen = others.get(rank)
            if seen is None:
                parts.append(f"rank {rank}: never heard from")
                holding.append(rank)
                continue
            silent = now - seen["at"] > 3 * self.beat_s
            state = f"in {seen['wait']}" if seen["wait"] else "not waiting for anyone"
            parts.append(
                f"rank {rank}: step {seen['step']}, {seen['phase']}, {state}, "
                f"last heard {now - seen['at']:.0f} s ago"
            )
            if silent or not seen["wait"] or seen["step"] != mine["step"]:
                holding.append(rank)
        verdict = f"; held up by rank(s) {holding}" if holding else ""
        return text + verdict + " — " + "; ".join(parts)

    def close(self) -> None:
        atexit.unregister(self.close)
        self._done.set()
        self._thread.join(timeout=2 * self.beat_s)


def explain_collective_error(
    error: BaseException, watchdog: Watchdog | None
) -> CollectiveTimeout | None:
    """A CollectiveTimeout with the watchdog's account, for an error that ended a wait on
    the process group's timeout; None for any other error."""
    if "timed out" not in str(error).lower() or isinstance(error, CollectiveTimeout):
        return None
    wait = phases.broken_wait()
    if watchdog is None or wait is None:
        return None
    return CollectiveTimeout(
        f"{watchdog.account(wait)}. The wait ended on the process group's timeout "
        f"(ms.launch(timeout_s=...)): {str(error).splitlines()[0]}"
    )
