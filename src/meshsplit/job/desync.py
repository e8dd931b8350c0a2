"""Desynchronised ranks (MESHSPLIT_DEBUG=1): the first collective the ranks disagree on, named
with both call sites, instead of a hang, an abort inside gloo or silently wrong numbers.

Off unless MESHSPLIT_DEBUG=1 is set in the workers: nothing is wrapped and nothing is paid.
When on, `install` (called once a worker of `ms.launch` or a torchrun job has joined)
listens to every operation intercept.py hears, so every caller that looks the collectives up
as `dist.<name>` (meshsplit, user code, FSDP2's gathers) is checked.
Before each collective the rank posts a fingerprint — operation, the shapes and dtypes that
must agree, the reduce op or root, and the call site — to the job's store under (group,
per-group sequence number, rank), then waits for the other members' fingerprints:

    rank r:  set desync/<group>/<n>/<r> = fingerprint ; wait for desync/<group>/<n>/<peer>
             equal -> run the collective ; different -> DesyncError (both call sites)

A group is named by its description and member global ranks (group names differ between
ranks for mesh subgroups). Call sites are shown, never compared: two ranks may reach the
same collective from different lines. A peer that does not arrive is judged from what it
posted last: waiting in another checked collective that this rank has not reached (the two
wait for each other: a collective was skipped or added) raises at once; otherwise, after
MESHSPLIT_DEBUG_WAIT_S (default 30 s, or the process group's timeout if shorter), the error
names the collective it last passed and where its watchdog last placed it. Every rank that
sees a divergence raises, and the job ends through ms.launch's WorkerError.

Point-to-point: `send` posts its shape under (sender, receiver, sequence); `recv` waits for
it and compares. `batch_isend_irecv` posts its sends first and compares each receive whose
sender has posted; the others are compared at this rank's next checked call (waiting there
could deadlock ranks that batch their receives before their sends). Unchecked: what
intercept.py does not hear (`isend`/`irecv` outside a batch, collectives called inside torch
itself). Asynchronous collectives are checked when issued, which makes their issue wait for
the peers' issue.

PyTorch's own TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper) also catches op and shape
mismatches on gloo, with an extra collective per call and no call sites; it is left to the
user to add.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshsplit import phases
from meshsplit.job import intercept

__all__ = ["DesyncError"]

_TORCH = str(Path(torch.__file__).parent)
_PACKAGE = str(Path(__file__).parent.parent)
_STDLIB = str(Path(inspect.__file__).parent)
_INTERCEPTORS = (__file__, intercept.__file__)
"""Frames of the checked call itself, left out of its call site."""


class DesyncError(dist.DistError):
    """Ranks of one process group called different collectives (or shapes) at the same point."""


def enabled() -> bool:
    """Whether MESHSPLIT_DEBUG asks for the check (any value but '', '0', 'false', 'no')."""
    return os.environ.get("MESHSPLIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def wait_s() -> float:
    """How long a rank waits for a peer that is busy elsewhere (MESHSPLIT_DEBUG_WAIT_S)."""
    return float(os.environ.get("MESHSPLIT_DEBUG_WAIT_S", "30"))


def _bound(timeout_s: float) -> tuple[float, str]:
    """The wait for an absent peer, and what set it: MESHSPLIT_DEBUG_WAIT_S, or the process
    group's timeout when shorter (that peer would have failed the collective anyway)."""
    if timeout_s < wait_s():
        return timeout_s, "the process group's timeout, ms.launch(timeout_s=...)"
    return wait_s(), "MESHSPLIT_DEBUG_WAIT_S"


def _tensor(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _tensors(ts: Any) -> str:
    return "None" if ts is None else f"{len(ts)} x {_tensor(ts[0]) if ts else '[]'}"


def _op(op: Any) -> str:
    return str(getattr(op, "name", op)).removeprefix("ReduceOp.").removeprefix("RedOpType.")


def _root(a: dict[str, Any], name: str) -> str:
    group_root = a.get(f"group_{name}")
    return f"group_{name}={group_root}" if group_root is not None else f"{name}={a.get(name)}"


def _agree(name: str, a: dict[str, Any]) -> list[str]:
    """The arguments of operation `name` (bound arguments `a`) that must agree across the
    group, described."""
    if name == "all_to_all_single" and (
        a.get("output_split_sizes") is not None or a.get("input_split_sizes") is not None
    ):
        return [str(a["input"].dtype).removeprefix("torch."), "uneven splits"]
    described = []
    for argument in intercept.OPERATIONS[name].agree:
        if argument == "op":
            described.append(f"op={_op(a.get('op', 'SUM'))}")
        elif argument in ("src", "dst"):
            described.append(_root(a, argument))
        elif argument == "object_list":
            described.append(f"{len(a['object_list'])} objects")
        elif argument.endswith("_list"):
            described.append(_tensors(a[argument]))
        else:
            described.append(_tensor(a[argument]))
    return described


def call_site(skip: int = 1) -> str:
    """Where a collective was called: the innermost frame outside torch, this module and
    intercept.py, and, when that is meshsplit's, the user's frame that led to it."""
    frame: Any = sys._getframe(skip)
    caller = user = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name not in _INTERCEPTORS:
            place = f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}"
            caller = caller or place
            if not name.startswith((_PACKAGE, _STDLIB, "<")):
                user = place
                break
        frame = frame.f_back
    if caller is None:
        return "an unknown place"
    return caller + (f" (called from {user})" if user is not None and user != caller else "")


def _short(filename: str) -> str:
    if filename.startswith(_PACKAGE):
        return "meshsplit/" + os.path.relpath(filename, _PACKAGE)
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


class Checker:
    """Checks this rank's collectives against its peers' through the job's store."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self.store = store
        self.bound = _bound(timeout_s)
        """How long to wait for an absent peer, and why that long."""
        self.rank = dist.get_rank()
        self.sequence: dict[str, int] = {}
        """Group key -> how many checked collectives this rank has passed on it."""
        self.p2p: dict[str, int] = {}
        """'src>dst' -> how many point-to-point messages this rank sent or received on it."""
        self.pending: list[tuple[str, dict[str, Any]]] = []
        """Receives whose sender had not posted yet: (key, this rank's fingerprint)."""
        self.lock = threading.RLock()

    def collective(self, name: str, bound: dict[str, Any]) -> None:
        group = bound.get("group") or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        if self.rank not in ranks:
            return  # c10d ignores a call on a group this rank is not in
        with self.lock:
            self.check_pending()
            desc = getattr(group, "group_desc", "") or "group"
            label = _label(desc, ranks)
            key = hashlib.sha1(f"{desc}{ranks}".encode()).hexdigest()[:12]
            n = self.sequence.get(key, 0)
            mine = {
                "rank": self.rank,
                "call": f"{name}({', '.join(_agree(name, bound))})",
                "agree": _agree(name, bound),
                "site": call_site(),
                "group": label,
                "key": key,
                "n": n,
                "ranks": ranks,
            }
            self.store.set(f"desync/{key}/{n}/{self.rank}", json.dumps(mine))
            self.store.set(f"desync/last/{self.rank}", json.dumps({**mine, "state": "waiting"}))
            with phases.waiting("desync check", lambda: {"collective": mine["call"]}):
                theirs = self._gather(mine, [r for r in ranks if r != self.rank])
            for other in theirs:
                if other["agree"] != mine["agree"] or other["call"] != mine["call"]:
                    raise DesyncError(_mismatch(mine, other))
            self.sequence[key] = n + 1
            passed = {**mine, "state": "passed", "at": time.time()}
            self.store.set(f"desync/last/{self.rank}", json.dumps(passed))
            if n > 0:  # every member has posted n: all have read n - 1
                self.store.delete_key(f"desync/{key}/{n - 1}/{self.rank}")

    def _gather(self, mine: dict[str, Any], peers: list[int]) -> list[dict[str, Any]]:
        """The peers' fingerprints for this collective, waiting while they may still come."""
        prefix = f"desync/{mine['key']}/{mine['n']}"
        found: dict[int, dict[str, Any]] = {}
        started, pause, looked = time.monotonic(), 1e-4, 0.0
        while True:
            for peer in peers:
                if peer not in found and self.store.check([f"{prefix}/{peer}"]):
                    found[peer] = json.loads(self.store.get(f"{prefix}/{peer}"))
            if len(found) == len(peers):
                return [found[p] for p in peers]
            waited = time.monotonic() - started
            if waited - looked > 0.2:  # a peer stuck in another checked collective?
                looked = waited
                for peer in peers:
                    if peer not in found:
                        self._judge(mine, peer, waited > self.bound[0])
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def _judge(self, mine: dict[str, Any], peer: int, out_of_time: bool) -> None:
        """Raise if `peer` cannot reach this collective: it waits in another checked one
        that this rank has not reached, or it has not come within the bound."""
        last_key = f"desync/last/{peer}"
        last = json.loads(self.store.get(last_key)) if self.store.check([last_key]) else None
        if last is not None and last["state"] == "waiting" and self.rank in last["ranks"]:
            reached = self.sequence.get(last["key"], 0) > last["n"]
            if not reached and (last["key"], last["n"]) != (mine["key"], mine["n"]):
                raise DesyncError(_crossed(mine, last))
        if out_of_time:
            raise DesyncError(_absent(mine, peer, last, self._watchdog(peer), self.bound))

    def _watchdog(self, peer: int) -> dict[str, Any] | None:
        key = f"watchdog/{peer}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def send(self, tensor: torch.Tensor, dst: int, tag: int, name: str, site: str) -> None:
        with self.lock:
            channel = f"{self.rank}>{dst}:{tag}"
            n = self.p2p.get(channel, 0)
            self.p2p[channel] = n + 1
            posted = {
                "rank": self.rank,
                "call": f"{name}({_tensor(tensor)}, dst={dst})",
                "site": site,
                "agree": _tensor(tensor),
            }
            self.store.set(f"desync/p2p/{channel}/{n}", json.dumps(posted))

    def receive(
        self, tensor: torch.Tensor, src: int, tag: int, name: str, site: str, wait: bool
    ) -> None:
        with self.lock:
            channel = f"{src}>{self.rank}:{tag}"
            n = self.p2p.get(channel, 0)
            self.p2p[channel] = n + 1
            key = f"desync/p2p/{channel}/{n}"
            mine = {
                "rank": self.rank,
                "call": f"{name}({_tensor(tensor)}, src={src})",
                "site": site,
                "agree": _tensor(tensor),
            }
            if wait:
                started = time.monotonic()
                with phases.waiting("desync check", lambda: {"receive": mine["call"]}):
                    while not self.store.check([key]):
                        if time.monotonic() - started > self.bound[0]:
                            raise DesyncError(
                                _absent(mine, src, None, self._watchdog(src), self.bound)
                            )
                        time.sleep(0.005)
            self.pending.append((key, mine))
            self.check_pending()

    def batch(self, ops: list[Any]) -> None:
        """batch_isend_irecv: post its sends first, then compare each receive whose sender
        has posted (the others at this rank's next checked call)."""
        site = call_site()
        sends = [op for op in ops if getattr(op.op, "__name__", "") == "isend"]
        for op in sends:
            self.send(op.tensor, op.peer, op.tag, "isend", site)
        for op in ops:
            if op not in sends:
                self.receive(op.tensor, op.peer, op.tag, "irecv", site, wait=False)

    def check_pending(self) -> None:
        """Compare each receive whose sender has posted by now."""
        still = []
        for key, mine in self.pending:
            if not self.store.check([key]):
                still.append((key, mine))
                continue
            theirs = json.loads(self.store.get(key))
            self.store.delete_key(key)
            if theirs["agree"] != mine["agree"]:
                raise DesyncError(
                    f"point-to-point message {key.rsplit('/', 2)[1]} #{key.rsplit('/', 1)[1]}: "
                    f"rank {theirs['rank']} called {theirs['call']} at {theirs['site']}, while "
                    f"rank {mine['rank']} called {mine['call']} at {mine['site']}; a receive "
                    "must match its send's shape and dtype"
                )
        self.pending = still[-256:]


def _label(desc: str, ranks: list[int]) -> str:
    where = {"default_pg": "the world"}.get(desc)
    if where is None:
        where = f"mesh axis {desc[5:]}" if desc.startswith("mesh_") else f"group {desc!r}"
    return f"{where} (ranks {ranks})"


def _mismatch(mine: dict[str, Any], other: dict[str, Any]) -> str:
    first, second = sorted([mine, other], key=lambda f: f["rank"])
    return (
        f"ranks diverged at collective #{mine['n']} on {mine['group']}: "
        f"rank {first['rank']} called {first['call']} at {first['site']}, while "
        f"rank {second['rank']} called {second['call']} at {second['site']}. Every rank of a "
        "group must call the same collectives, in the same order, with the same shapes and "
        "dtypes (MESHSPLIT_DEBUG=1 checked this one before running it)"
    )


def _crossed(mine: dict[str, Any], last: dict[str, Any]) -> str:
    return (
        f"ranks diverged: rank {mine['rank']} waits in {mine['call']} (collective #{mine['n']} "
        f"on {mine['group']}) at {mine['site']}, while rank {last['rank']} waits in "
        f"{last['call']} (collective #{last['n']} on {last['group']}) at {last['site']}, "
        f"which rank {mine['rank']} has not reached: one of them skipped a collective or "
        "called one the other does not (MESHSPLIT_DEBUG=1)"
    )


def _absent(
    mine: dict[str, Any],
    peer: int,
    last: dict[str, Any] | None,
    seen: dict[str, Any] | None,
    bound: tuple[float, str],
) -> str:
    text = (
        f"rank {peer} has not reached {mine['call']}"
        + (f" (collective #{mine['n']} on {mine['group']})" if "group" in mine else "")
        + f" within {bound[0]:g} s ({bound[1]}), which rank {mine['rank']} "
        f"called at {mine['site']}; "
    )
    if last is None:
        text += f"rank {peer} has passed no checked collective yet"
    else:
        ago = f", {time.time() - last['at']:.0f} s ago" if "at" in last else ""
        text += (
            f"the last collective rank {peer} passed was {last['call']} (#{last['n']} on "
            f"{last['group']}) at {last['site']}{ago}"
        )
    if seen is not None:
        wait = f"waiting in {seen['wait']}" if seen.get("wait") else "not waiting for anyone"
        text += f"; its watchdog last placed it at step {seen['step']}, {seen['phase']}, {wait}"
    return text + f". Rank {peer} skipped this collective, or is still busy elsewhere"


def _listener(checker: Checker) -> intercept.Listener:
    """Checks each operation intercept.py hears, before it runs."""

    def hear(name: str, bound: dict[str, Any]) -> Callable[[Any], None] | None:
        tag = bound.get("tag", 0)
        if name == "batch_isend_irecv":
            checker.batch(bound["p2p_op_list"])
        elif name == "send":
            checker.send(bound["tensor"], bound["dst"], tag, name, call_site())
        elif name == "recv" and bound.get("src") is None:  # from any rank: known once run
            site = call_site()
            return lambda src: checker.receive(bound["tensor"], src, tag, name, site, wait=True)
        elif name == "recv":
            checker.receive(bound["tensor"], bound["src"], tag, name, call_site(), wait=True)
        else:
            checker.collective(name, bound)
        return None

    return hear


_installed: list[Checker] = []


def install(store: dist.Store | None, timeout: timedelta) -> None:
    """Check every collective from now on, if MESHSPLIT_DEBUG asks (once per process);
    `timeout` is the process group's."""
    if not enabled() or store is None or _installed or dist.get_world_size() == 1:
        return
    checker = Checker(store, timeout.total_seconds())
    intercept.listen(_listener(checker))
    _installed.append(checker)
