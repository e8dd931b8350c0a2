"""What a recording is: a graph over storages, kept apart from how it is made and replayed.

A storage has the op that made it and the ordered log of in-place/out= ops that wrote into it
(through any view); every tensor an op reads is a `Ref`: a storage, how many of its writes had
happened, and a dtype/size/stride/offset view. The recorder builds this graph, `prune` cuts it
down to what the model's state needs, and the replay walks it back to real tensors.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch._ops import OpOverload
from torch.utils._pytree import tree_flatten


class DeferredInitError(RuntimeError):
    """The factory did something that a recording cannot reproduce."""


class View(NamedTuple):
    """How a tensor sits on its storage."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> View:
        return View(t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()))

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        empty = torch.empty(0, dtype=self.dtype, device=storage.device)
        return empty.set_(storage, self.offset, self.size, self.stride)


@dataclass(eq=False)
class Op:
    """One recorded aten call: every argument by name, tensors replaced by `Ref`s."""

    func: OpOverload
    kwargs: dict[str, Any]
    rng: tuple[torch.Generator, torch.Tensor] | None = None  # generator, the state it saw
    made: list[Storage | None] = field(default_factory=list)  # per tensor output: if new


@dataclass(eq=False)
class Storage:
    """A recorded storage: where factory() would put it, what made it, what wrote into it."""

    device: torch.device
    nbytes: int
    view: View  # how the output of `make` (or `constant`) sat on it
    make: Op | None = None
    constant: torch.Tensor | None = None  # a real tensor the factory used
    constant_version: int = 0
    owned: bool = False  # the factory made the constant itself (torch.tensor(data))
    writes: list[Op | None] = field(default_factory=list)  # None: pruned, nothing needs it
    resets: list[int] = field(default_factory=list)  # writes overwriting every byte unread

    def start(self, version: int) -> int:
        """Index of the last full overwrite before `version` (-1: replay from `make`)."""
        i = bisect.bisect_left(self.resets, version)
        return self.resets[i - 1] if i else -1


@dataclass(frozen=True, eq=False)
class Ref:
    """A tensor as an op saw it: its storage after `version` writes, seen through `view`."""

    storage: Storage
    version: int
    view: View

    def __deepcopy__(self, memo: dict[int, Any]) -> Ref:
        return self  # recordings never change: a deep-copied model shares its recording


def leaves(tree: Any, kind: type) -> list[Any]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, kind)]


class OpKind(NamedTuple):
    """What an op's schema and tags say about it."""

    name: str
    mutated: tuple[str, ...]  # the arguments it writes to
    random: bool
    view: bool  # returns views of its inputs (lift_fresh aside: data entering the recording)
    reads: bool  # hands tensor values to Python: item(), bool(), equal()
    out: OpOverload | None  # its out= variant


@functools.cache
def op_kind(func: OpOverload) -> OpKind:
    args, returns = func._schema.arguments, func._schema.returns
    mutated = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
    random = torch.Tag.nondeterministic_seeded in func.tags or "generator" in [a.name for a in args]
    aliases = [r.alias_info for r in returns]
    view = all(a is not None and not a.is_write for a in aliases) and bool(aliases)
    reads = not mutated and not any("Tensor" in str(r.type) for r in returns)
    overload = func._overloadname
    out = getattr(func.overloadpacket, "out" if overload == "default" else f"{overload}_out", None)
    if out is not None and op_kind(out).mutated != ("out",):
        out = None
    name = func.overloadpacket.__name__
    return OpKind(name, mutated, random, view and name != "lift_fresh", reads, out)


def prune(roots: list[Ref]) -> None:
    """Forget every recorded op (and constant) that no root depends on."""
    needed: dict[Storage, set[int]] = {}  # write indices to keep, -1 for `make`
    stack = list(roots)
    while stack:
        ref = stack.pop()
        keep = needed.setdefault(ref.storage, set())
        for i in range(ref.storage.start(ref.version), ref.version):
            if i not in keep:
                keep.add(i)
                op = ref.storage.make if i < 0 else ref.storage.writes[i]
                stack.extend(leaves(op.kwargs, Ref) if op is not None else [])
    for storage, keep in needed.items():
        storage.writes = [op if i in keep else None for i, op in enumerate(storage.writes)]
        if -1 not in keep:
            storage.make = storage.constant = None
