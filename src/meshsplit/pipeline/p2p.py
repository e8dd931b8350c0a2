"""Point-to-point transfers between stages: batched isend/irecv, shapes learnt once, pooled buffers.

The first message under a key carries a header of its tensors' dtypes and shapes; after that
the receiver receives straight into pooled buffers, so a warm step allocates nothing. Sends are
asynchronous, receives block up to the group's timeout, and both waits are marked ("p2p wait")
so a timeline shows where a stage sits idle. Rationale: docs/internals.md#pipelinep2ppy
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshsplit.phases import waiting
from meshsplit.plan import Plan

__all__: list[str] = []

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,  # rotary frequencies (Llama 4's freqs_cis) cross stage boundaries
    torch.complex128,
)


WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}
"""Plan.compress_transfers -> the dtype floating tensors travel as (None: their own)."""


def wire_dtype(plan: Plan) -> torch.dtype | None:
    """What floating tensors travel between stages as: Plan.compress_transfers when set,
    else their own dtype (None). Under mixed precision a value autocast made travels in the
    low dtype it already has, and a float32 one (the residual stream) stays float32: sending
    it as bf16 rounded what the next stage added to, and its gradient, which plain autocast
    never does (OLMo 2's embeddings ended 4.5x as far from it as two micro-batches do)."""
    return WIRE_DTYPES[plan.compress_transfers]


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a buffer for one tensor and restore it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    wire: torch.dtype | None = None
    """The dtype it travels as, when not its own (then the buffer holds this dtype)."""

    @classmethod
    def of(cls, tensor: torch.Tensor, wire: torch.dtype | None = None) -> TensorMeta:
        """`tensor`'s meta; a floating tensor of another dtype than `wire` travels as `wire`."""
        cast = wire is not None and tensor.is_floating_point() and tensor.dtype != wire
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, wire if cast else None)

    @property
    def carried(self) -> torch.dtype:
        """The dtype on the wire and in the receive buffer."""
        return self.wire if self.wire is not None else self.dtype


def encode(metas: list[TensorMeta]) -> torch.Tensor:
    """Header for a message: per tensor [dtype, wire dtype, requires_grad, ndim, *shape]
    (int64; dtypes as indices into DTYPES)."""
    values: list[int] = []
    for meta in metas:
        unknown = {meta.dtype, meta.carried} - set(DTYPES)
        if unknown:
            raise TypeError(
                f"a tensor of {unknown.pop()} crosses a pipeline stage boundary, and stages "
                f"exchange only {', '.join(str(d) for d in DTYPES)}; cast it in the model, or "
                "cut elsewhere with Plan.split_points"
            )
        dtypes = [DTYPES.index(meta.dtype), DTYPES.index(meta.carried)]
        values += [*dtypes, int(meta.requires_grad), len(meta.shape), *meta.shape]
    return torch.tensor(values, dtype=torch.int64)


def decode(header: torch.Tensor) -> list[TensorMeta]:
    values = header.tolist()
    metas, at = [], 0
    while at < len(values):
        dtype, wire, grad, ndim = values[at : at + 4]
        shape = tuple(values[at + 4 : at + 4 + ndim])
        cast = DTYPES[wire] if wire != dtype else None
        metas.append(TensorMeta(shape, DTYPES[dtype], bool(grad), cast))
        at += 4 + ndim
    return metas


class BufferPool:
    """Receive buffers reused across micro-batches and steps, keyed by (shape, dtype).

    A buffer is lent by `take` and comes back with `give` once nothing reads it any more
    (after the backward that used it); `allocations` counts buffers ever created.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocations = 0
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._storages: set[int] = set()
        self.buffers: list[torch.Tensor] = []
        """Every buffer the pool created, lent or free (for memory accounting)."""
        self.zeroed = False
        """New buffers hold zeros, not whatever memory held: for a simulated rank, whose
        receives write nothing, so that a received index (position ids) stays in range."""

    def take(self, meta: TensorMeta) -> torch.Tensor:
        free = self._free.get((meta.shape, meta.carried))
        if free:
            return free.pop()
        self.allocations += 1
        make = torch.zeros if self.zeroed else torch.empty
        buffer = make(meta.shape, dtype=meta.carried, device=self.device)
        self._storages.add(buffer.untyped_storage().data_ptr())
        self.buffers.append(buffer)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` shares memory with a pool buffer (it may be overwritten later)."""
        return tensor.untyped_storage().data_ptr() in self._storages


@dataclass
class Sending:
    """Sends in flight, and the tensors they read (kept alive until `wait`)."""

    works: list[Any]
    tensors: list[torch.Tensor]
    peers: list[int] = field(default_factory=list)

    def wait(self) -> None:
        if self.works:
            with waiting("p2p wait, send", lambda: _traffic(self.peers, self.tensors)):
                for work in self.works:
                    work.wait()
        self.works, self.tensors = [], []


@dataclass(frozen=True)
class _Posted:
    """A receive started ahead: the pool buffers it fills and its works."""

    buffers: list[torch.Tensor]
    works: list[dist.Work]


@dataclass(frozen=True)
class Received:
    """One message: its tensors, with what the sender said about them, and the pool buffers
    they still occupy (give them back once nothing reads them; a tensor cast back from its
    wire dtype is a copy, and its buffer is back in the pool already)."""

    tensors: list[torch.Tensor]
    metas: list[TensorMeta]
    lent: list[torch.Tensor]


class Exchange:
    """This rank's point-to-point traffic with the other stages (global ranks)."""

    def __init__(
        self, device: torch.device, wire: torch.dtype | None = None, rank: int | None = None
    ) -> None:
        self.device = device
        self.rank = rank
        """This process's global rank: a message to it stays here (the turn of a 'zbv' V,
        where one rank runs two consecutive chunks), as a copy in its own dtype (nothing
        travels, so compress_transfers leaves it alone)."""
        self._local: dict[int, deque[tuple[list[torch.Tensor], list[TensorMeta]]]] = {}
        """tag -> the messages this rank sent itself, oldest first."""
        self.wire = wire
        """What floating tensors travel as (see wire_dtype); None: their own dtype."""
        self.pool = BufferPool(device)
        self.told: dict[tuple[int, int, Hashable], list[TensorMeta]] = {}
        """(peer, tag, key) -> the header sent to that peer under that tag and key."""
        self._heard: dict[tuple[int, int, Hashable], list[TensorMeta]] = {}
        self.unheard: Callable[[list[tuple[int, int, Hashable]]], None] | None = None
        """Called with the (peer, tag, key) of headers about to be received that were never
        heard (a simulated run, which has no peers to hear them from, stops there)."""
        self._posted: dict[tuple[int, int], deque[tuple[list[TensorMeta], _Posted]]] = {}
        """(peer, tag) -> receives started ahead of time (`post`), oldest first."""

    def meta(self, tensor: torch.Tensor) -> TensorMeta:
        """How `tensor` travels from this rank (its dtype, or the wire dtype)."""
        return TensorMeta.of(tensor, self.wire)

    def learn(self, peer: int, tag: int, key: Hashable, metas: list[TensorMeta]) -> None:
        """Take the header `peer` sends under `tag` and `key` as heard (a simulated run has
        no peer)."""
        self._heard[(peer, tag, key)] = metas

    def send(
        self, messages: list[tuple[int, int, list[torch.Tensor]]], key: Hashable | None
    ) -> Sending:
        """Start sending each (peer, tag, tensors), with a header the first time for `key`.

        `key=None` sends no header: the receiver knows the shapes (gradients of what it sent).
        Messages between two ranks arrive in order within a tag; tags keep apart the links of
        chunks that share a pair of ranks (one per pair of chunks, see `Stage`).
        A tensor that lives in a pool buffer is copied first: the buffer may be reused for
        the next receive while this send is still in flight.
        """
        ops, keep = [], []
        for peer, tag, tensors in messages:
            if peer == self.rank:
                copies = [t.detach().clone() for t in tensors]
                self._local.setdefault(tag, deque()).append(
                    (copies, [TensorMeta.of(t) for t in tensors])
                )
                continue
            if key is not None and (peer, tag, key) not in self.told:
                metas = [self.meta(t) for t in tensors]
                header = encode(metas).to(self.device)
                length = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
                ops += [
                    dist.P2POp(dist.isend, length, peer, tag=tag),
                    dist.P2POp(dist.isend, header, peer, tag=tag),
                ]
                keep += [length, header]
                self.told[(peer, tag, key)] = metas
            for tensor in tensors:
                data = tensor.detach()
                wire = self.meta(data).wire
                if wire is not None:  # a cast is a copy of its own
                    data = data.to(wire).contiguous()
                else:
                    data = data.clone() if self.pool.owns(data) else data.contiguous()
                ops.append(dist.P2POp(dist.isend, data, peer, tag=tag))
                keep.append(data)
        works = dist.batch_isend_irecv(ops) if ops else []
        return Sending(works=works, tensors=keep, peers=[peer for peer, _, _ in messages])

    def known(
        self, sources: list[tuple[int, int, Hashable]]
    ) -> list[tuple[int, int, list[TensorMeta]]] | None:
        """What one message from each (peer, tag, key) holds, where every header is heard
        (None: one is not yet; a message from this rank itself needs none)."""
        remote = [(peer, tag, key) for peer, tag, key in sources if peer != self.rank]
        if any(source not in self._heard for source in remote):
            return None
        return [(peer, tag, self._heard[(peer, tag, key)]) for peer, tag, key in remote]

    def post(self, messages: list[tuple[int, int, list[TensorMeta]]]) -> None:
        """Start receiving each (peer, tag) message now, into pool buffers, for the receive
        that will ask for it: it lands while this rank computes, instead of starting when the
        rank is ready to wait (a message's transfer then needs both ranks' transport threads
        to get a core, milliseconds on busy cores). Post in the order the receives ask: one
        tag's messages match receives in the order they are posted."""
        for peer, tag, metas in messages:
            if peer == self.rank or not metas:
                continue
            buffers = [self.pool.take(meta) for meta in metas]
            ops = [dist.P2POp(dist.irecv, buffer, peer, tag=tag) for buffer in buffers]
            posted = _Posted(buffers, dist.batch_isend_irecv(ops))
            self._posted.setdefault((peer, tag), deque()).append((metas, posted))

    def receive(self, sources: list[tuple[int, int, Hashable]]) -> list[Received]:
        """One message from each (peer, tag, key), into pool buffers; learns its header the
        first time for that key."""
        unknown = [
            (peer, tag, key)
            for peer, tag, key in sources
            if (peer, tag, key) not in self._heard and peer != self.rank
        ]
        if unknown:
            if self.unheard is not None:
                self.unheard(unknown)
            lengths = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in unknown]
            self._wait([(peer, tag, t) for (peer, tag, _), t in zip(unknown, lengths, strict=True)])
            headers = [
                torch.empty(int(n.item()), dtype=torch.int64, device=self.device) for n in lengths
            ]
            self._wait([(peer, tag, t) for (peer, tag, _), t in zip(unknown, headers, strict=True)])
            for (peer, tag, key), header in zip(unknown, headers, strict=True):
                self._heard[(peer, tag, key)] = decode(header.cpu())
        return self.receive_like(
            [(peer, tag, self._heard.get((peer, tag, key), [])) for peer, tag, key in sources]
        )

    def receive_like(self, messages: list[tuple[int, int, list[TensorMeta]]]) -> list[Received]:
        """One message from each (peer, tag) whose shapes this rank already knows (e.g.
        gradients)."""
        remote = [message for message in messages if message[0] != self.rank]
        buffers, started, receives = [], [], []
        for peer, tag, metas in remote:
            queue = self._posted.get((peer, tag))
            if queue:
                posted_metas, posted = queue.popleft()
                if posted_metas != metas:
                    raise RuntimeError(
                        f"rank {self.rank}: the receive posted ahead from rank {peer} (tag "
                        f"{tag}) expected {posted_metas}, the step asks for {metas}"
                    )
                buffers.append(posted.buffers)
                started.append((peer, posted))
                continue
            taken = [self.pool.take(meta) for meta in metas]
            buffers.append(taken)
            receives += [(peer, tag, buffer) for buffer in taken]
        self._wait(receives, started)
        heard = iter(
            [self._restore(b, metas) for b, (_, _, metas) in zip(buffers, remote, strict=True)]
        )
        return [self._own(tag) if peer == self.rank else next(heard) for peer, tag, _ in messages]

    def _own(self, tag: int) -> Received:
        """The oldest message this rank sent itself under `tag` (its schedule sends it first)."""
        queue = self._local.get(tag)
        if not queue:
            raise RuntimeError(
                f"rank {self.rank} waits for a message to itself (tag {tag}) never sent"
            )
        tensors, metas = queue.popleft()
        return Received(tensors=tensors, metas=metas, lent=[])

    def _restore(self, buffers: list[torch.Tensor], metas: list[TensorMeta]) -> Received:
        """The tensors as the sender had them: cast back from the wire dtype where needed."""
        tensors, lent = [], []
        for buffer, meta in zip(buffers, metas, strict=True):
            if meta.wire is None:
                tensors.append(buffer)
                lent.append(buffer)
            else:
                tensors.append(buffer.to(meta.dtype))
                self.pool.give(buffer)
        return Received(tensors=tensors, metas=metas, lent=lent)

    def _wait(
        self,
        receives: list[tuple[int, int, torch.Tensor]],
        started: Sequence[tuple[int, _Posted]] = (),
    ) -> None:
        """Receive each (peer, tag, buffer), and wait for the receives from each peer
        `started` ahead (`post`)."""
        if not receives and not started:
            return
        peers = [peer for peer, _, _ in receives] + [peer for peer, _ in started]
        tensors = [t for _, _, t in receives] + [t for _, p in started for t in p.buffers]
        with waiting("p2p wait, receive", lambda: _traffic(peers, tensors)):
            ops = [dist.P2POp(dist.irecv, tensor, peer, tag=tag) for peer, tag, tensor in receives]
            ahead = [work for _, posted in started for work in posted.works]
            for work in [*ahead, *(dist.batch_isend_irecv(ops) if ops else [])]:
                work.wait()


def _traffic(peers: list[int], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """A wait's args (built only for a clock): the global ranks it waited for, the bytes."""
    return {
        "peers": sorted(set(peers)),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
    }


def broadcast_tensor(
    tensor: torch.Tensor | None, src: int, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    """`tensor` from global rank `src` on every rank of `group` (shape sent first)."""
    header = torch.empty(0, dtype=torch.int64)
    if tensor is not None:
        header = encode([TensorMeta(tuple(tensor.shape), tensor.dtype, False)])
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if tensor is None:
        header = torch.empty(int(length.item()), dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src=src, group=group)
    (meta,) = decode(header.cpu())
    if tensor is None:
        out = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    else:
        out = tensor.contiguous()
    dist.broadcast(out, src=src, group=group)
    return out
