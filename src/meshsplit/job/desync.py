"""Desynchronised ranks (MESHSPLIT_DEBUG=1): the first collective the ranks disagree on, named
with both call sites, instead of a hang, an abort inside gloo or silently wrong numbers.

Off unless MESHSPLIT_DEBUG=1 is set in the workers: nothing is wrapped and nothing is paid.
When on, `install` (called once a worker of `ms.launch` or a torchrun job has joined)
replaces the collectives of the `torch.distributed` module with checked ones, so every
caller that looks them up as `dist.<name>` (meshsplit, user code, FSDP2's gathers) is seen.
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
names the collective it last passed and
where its watchdog last placed it. Every rank that sees a divergence raises, and the job
ends through ms.launch's WorkerError.

Point-to-point: `send` posts its shape under (sender, receiver, sequence); `recv` waits for
it and compares. `batch_isend_irecv` posts its sends first and compares each receive whose
sender has posted; the others are compared at this rank's next checked call (waiting there
could deadlock ranks that batch their receives before their sends). `isend`/`irecv` stay
unwrapped (P2POp checks their identity). Unchecked: collectives called inside torch itself
(DTensor's and the functional collectives, DDP's reducer, DeviceMesh set-up, what
all_gather_object does inside). Asynchronous collectives are checked when issued, which
makes their issue wait for the peers' issue.

PyTorch's own TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper) also catches op and shape
mismatches on gloo, with an extra collective per call and no call sites; it is left to the
user to add.
"""

from __future__ import annotations

import functools
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

__all__ = ["DesyncError"]

_TORCH = str(Path(torch.__file__).parent)
_PACKAGE = str(Path(__file__).parent.parent)
_STDLIB = str(Path(inspect.__file__).parent)


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


# operation -> the arguments that must agree across the group, described (bound arguments)
_AGREE: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "all_reduce": lambda a: [_tensor(a["tensor"]), f"op={_op(a.get('op', 'SUM'))}"],
    "broadcast": lambda a: [_tensor(a["tensor"]), _root(a, "src")],
    "reduce": lambda a: [_tensor(a["tensor"]), _root(a, "dst"), f"op={_op(a.get('op', 'SUM'))}"],
    "all_gather": lambda a: [_tensors(a["tensor_list"]), _tensor(a["tensor"])],
    "all_gather_into_tensor": lambda a: [_tensor(a["output_tensor"]), _tensor(a["input_tensor"])],
    "all_gather_single": lambda a: [_tensor(a["output_tensor"]), _tensor(a["input_tensor"])],
    "reduce_scatter": lambda a: [
        _tensor(a["output"]),
        _tensors(a["input_list"]),
        f"op={_op(a.get('op', 'SUM'))}",
    ],
    "reduce_scatter_tensor": lambda a: [
        _tensor(a["output"]),
        _tensor(a["input"]),
        f"op={_op(a.get('op', 'SUM'))}",
    ],
    "all_to_all_single": lambda a: (
        [_tensor(a["output"]), _tensor(a["input"])]
        if a.get("output_split_sizes") is None and a.get("input_split_sizes") is None
        else [str(a["input"].dtype).removeprefix("torch."), "uneven splits"]
    ),
    "gather": lambda a: [_tensor(a["tensor"]), _root(a, "dst")],
    "scatter": lambda a: [_tensor(a["tensor"]), _root(a, "src")],
    "barrier": lambda a: [],
    "all_gather_object": lambda a: [],
    "broadcast_object_list": lambda a: [f"{len(a['object_list'])} objects", _root(a, "src")],
}


def call_site(skip: int = 2) -> str:
    """Where a collective was called: the innermost frame outside torch and this module,
    and, when that is meshsplit's, the user's frame that led to it."""
    frame: Any = sys._getframe(skip)
    caller = user = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
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
                "call": f"{name}({', '.join(_AGREE[name](bound))})",
                "agree": _AGREE[name](bound),
                "site": call_site(3),
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


def _checked(name: str, original: Callable[..., Any], checker: Checker) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        tag = bound.get("tag", 0)
        if name == "send":
            checker.send(bound["tensor"], bound["dst"], tag, name, call_site())
        elif name == "recv" and bound.get("src") is None:  # from any rank: known once here
            src = original(*args, **kwargs)
            checker.receive(bound["tensor"], src, tag, name, call_site(), wait=True)
            return src
        elif name == "recv":
            checker.receive(bound["tensor"], bound["src"], tag, name, call_site(), wait=True)
        else:
            checker.collective(name, bound)
        return original(*args, **kwargs)

    return wrapper


def _checked_batch(original: Callable[..., Any], checker: Checker) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(p2p_op_list: list[Any]) -> Any:
        site = call_site()
        sends = [op for op in p2p_op_list if getattr(op.op, "__name__", "") == "isend"]
        for op in sends:
            checker.send(op.tensor, op.peer, op.tag, "isend", site)
        for op in p2p_op_list:
            if op not in sends:
                checker.receive(op.tensor, op.peer, op.tag, "irecv", site, wait=False)
        return original(p2p_op_list)

    return wrapper


_installed: list[Checker] = []


def install(store: dist.Store | None, timeout: timedelta) -> None:
    """Check every collective from now on, if MESHSPLIT_DEBUG asks (once per process);
    `timeout` is the process group's."""
    if not enabled() or store is None or _installed or dist.get_world_size() == 1:
        return
    checker = Checker(store, timeout.total_seconds())
    for name in (*_AGREE, "send", "recv"):
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _checked(name, original, checker))
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv, checker)
    _installed.append(checker)
