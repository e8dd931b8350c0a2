"""Faults found while training, turned into one clear error on every rank.

Non-finite guard (`Plan.nonfinite`): after the gradients are synchronised and before the
optimizer steps, each rank checks its loss and its gradients (the float32 sum of each
gradient bucket or shard: a NaN or infinity anywhere makes it non-finite, and no temporary
as large as the gradients is made; a sum past float32's 3.4e38 counts too); one all-reduce
over the world tells every rank whether any rank saw one, so all ranks take the same
branch: under 'raise' each raises the same `NonFiniteError` (the step, the ranks, and on
each the first parameter whose gradient went non-finite); under 'skip' every rank drops the
update alike. The parameters are untouched either way: the check runs before the step.

Stop requests (`StopRequest`, used by `Engine.fit`): SIGTERM or SIGINT (preemption, Ctrl-C)
asks the loop to stop at the next step boundary; one all-reduce a step tells every rank
whether any was asked, so all stop after the same step, save and raise `TrainingStopped`.
The first signal puts the default handlers back, so a second one ends the process at once,
even inside a collective, before it can touch the last complete checkpoint.

Stalls (`Watchdog`, one thread per engine): every second it posts where this rank is (step,
phase, the wait it is in) to the job's store; when a wait for other ranks has lasted past
the stall bound (MESHSPLIT_STALL_WARN_S, default 60 s, as Horovod warns) it prints a
warning naming the wait and where every other rank was last seen — those not waiting, at
another step, or silent are the ones holding the job up. When the process group's timeout
(`ms.launch(timeout_s=...)`) ends the wait, `explain_collective_error` turns gloo's bare
"Timed out waiting ..." into a `CollectiveTimeout` with the same account.

Bad input (`explain_input_error`): an exception raised inside the model's forward is traced
back to the innermost module whose `forward` was running; the error is re-raised as an
`InputError` naming that module (its path in this rank's part of the model), what its
weight expects and the shape it received, with the rank, stage and tp index.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit import phases
from meshsplit.mesh import local_tensor

__all__ = ["CollectiveTimeout", "InputError", "NonFiniteError", "TrainingStopped"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class NonFiniteError(FloatingPointError):
    """A loss or gradient went NaN or infinite; the parameters are those before the step."""


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


class InputError(ValueError):
    """A batch a layer cannot take (wrong shape, dtype or class range)."""


def nonfinite_parameter(named: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity."""
    for name, param in named:
        grad = param.grad
        if grad is not None and not bool(torch.isfinite(local_tensor(grad)).all()):
            return name
    return None


def check_step(
    loss: torch.Tensor,
    gradients: list[torch.Tensor],
    named: Iterable[tuple[str, nn.Parameter]],
    *,
    rows: int,
    mode: str,
    step: int,
    where: str,
    group: dist.ProcessGroup | None,
) -> bool:
    """Whether every rank's loss and gradients are finite (a collective over `group`, the
    mesh's processes; None: this rank alone, for workers that do not wait for each other).
    Under mode 'raise' a non-finite one raises NonFiniteError on every rank. The same
    all-reduce compares the global batch each rank was given: ranks fed different batches
    (a DataLoader per rank) raise InputError before the update."""
    sums = [loss.detach().sum(dtype=torch.float32)]
    sums += [local_tensor(g).sum(dtype=torch.float32) for g in gradients]
    bad = not bool(torch.stack(sums).isfinite().all())
    members = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    seen = torch.zeros(2, members, dtype=torch.int64, device=loss.device)
    seen[0, me], seen[1, me] = int(bad), rows
    if group is not None:
        dist.all_reduce(seen, group=group)
    flags, batches = seen[0], seen[1].tolist()
    if len(set(batches)) > 1:
        given = ", ".join(f"rank {r}: {n}" for r, n in enumerate(batches))
        raise InputError(
            f"step {step}: the ranks were given global batches of different sizes ({given} "
            "rows); every rank must call train_step with the same global batch (each takes "
            "its own rows of it): give every rank the same data in the same order (one seed), "
            "not a DataLoader of its own. The update was not applied"
        )
    if not bool(flags.any()):
        return True
    if mode == "skip":
        return False
    mine = ""
    if bad:
        first = nonfinite_parameter(named)
        loss_text = "finite" if bool(torch.isfinite(loss.detach()).all()) else str(loss.item())
        mine = f"{where}: loss {loss_text}" + (
            f", first non-finite gradient: {first}" if first else ", gradients finite"
        )
    reports: list[Any] = [mine]
    if group is not None:
        reports = [None] * members
        dist.all_gather_object(reports, mine, group=group)
    flagged = [r for r, flag in enumerate(flags.tolist()) if flag]
    ranks = flagged if group is not None else [dist.get_rank()]
    raise NonFiniteError(
        f"step {step}: a NaN or infinity on rank(s) {ranks} (gradients synchronised over "
        "dp carry one replica's to all): "
        + "; ".join(str(reports[r]) for r in flagged)
        + ". The parameters are those before this step. Lower the learning rate, clip "
        "gradients or check the batch; Plan(nonfinite='skip') drops such steps instead"
    )


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
