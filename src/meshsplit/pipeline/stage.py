"""One pipeline stage: its program, the values it exchanges, and how it runs F(j) and B(j).

The program is a traced LayerGraph's layers (`program.LayerProgram`) or the model's own forward
with other stages' pieces stubbed (`spine.py`); the stage sees only values in and values out. A
value goes straight from the stage that makes it to every stage that reads it.
Rationale: docs/internals.md#pipelinestagepy
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import tensors
from meshsplit.phases import phase
from meshsplit.pipeline.p2p import Exchange, Received, Sending, TensorMeta
from meshsplit.pipeline.program import Program, Routes
from meshsplit.pipeline.schedules import Action
from meshsplit.pipeline.split_backward import (
    WeightWork,
    gradients_of,
    input_gradients,
    weight_gradients,
)
from meshsplit.precision import Precision
from meshsplit.sharded_views import ViewWatch

__all__: list[str] = []


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward (or weight gradient) on one chunk."""

    received: list[list[torch.Tensor]]
    buffers: list[torch.Tensor]
    sent: list[list[torch.Tensor]]
    sending: Sending
    loss: torch.Tensor | None = None
    roots: list[torch.Tensor] = field(default_factory=list)
    """After B of a split backward that W re-runs whole: what W starts from, with `seeds`
    (its gradients)."""
    seeds: list[torch.Tensor | None] = field(default_factory=list)
    work: WeightWork | None = None
    """After B of a split backward: the parameter halves W runs."""


@dataclass
class _Step:
    """What one pass over the micro-batches keeps until it ends."""

    in_flight: dict[tuple[int, int], _InFlight] = field(default_factory=dict)
    """(chunk, micro-batch) -> its values between forward and backward."""
    sending: list[Sending] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    loss: torch.Tensor | None = None


def run(
    stages: Mapping[int, Stage],
    actions: Sequence[Action],
    inputs: Sequence[Any],
    targets: Sequence[Any] | None,
    loss_of: Callable[[Any, Any], torch.Tensor] | None,
) -> _Step:
    """Run `actions` over the micro-batches on this rank's chunks (`stages`, by chunk); with
    no targets, forward only (inference). A schedule with W actions splits each backward."""
    step = _Step()
    (only, *_) = stages
    split = any(action.kind == "W" for action in actions)
    posted = 0  # the actions whose receives are posted: always the first ones, in order

    def post_through(last: int) -> None:
        """Post the receives of the actions up to `last` while their shapes are known."""
        nonlocal posted
        while posted <= min(last, len(actions) - 1):
            action = actions[posted]
            stage = stages[only if action.chunk is None else action.chunk]
            expected = stage.expected(step, action, inputs[action.micro])
            if expected is None:  # it receives as it runs, and nothing after it before it
                return
            stage.exchange.post(expected)
            posted += 1

    for index, action in enumerate(actions):
        post_through(index + 1)  # the next action's message lands while this one computes
        posted = max(posted, index + 1)
        stage = stages[only if action.chunk is None else action.chunk]
        where = "" if action.chunk is None else f", chunk {action.chunk}"
        if action.kind == "F":
            target = targets[action.micro] if targets is not None else None
            with phase(f"forward, micro-batch {action.micro}{where}"):
                stage.forward(step, action.micro, inputs[action.micro], target, loss_of)
        elif action.kind == "B":
            with phase(f"backward, micro-batch {action.micro}{where}"):
                stage.backward(step, action.micro, weights_later=split)
        else:
            with phase(f"weight gradients, micro-batch {action.micro}{where}"):
                stage.weights(step, action.micro)
    # on an error the sends are left unfinished on purpose: waiting for a peer that may
    # never receive would turn a failure into a hang; the job ends instead
    for sending in step.sending:
        sending.wait()
    return step


class Stage:
    """One chunk of the model on this rank (its stage, unless interleaved) and its traffic
    with the other chunks.

    Messages are tagged by the pair of chunks they link, activations from chunk s to chunk d
    2(s·C + d) and their gradients one more (C chunks), so no two links between one pair of
    ranks share a tag: a chunk that sends to two chunks of one peer (a value that skips a
    cut, under interleaving or in a V) never has its messages taken for each other's.
    """

    def __init__(
        self,
        *,
        index: int,
        stages: int,
        module: nn.Module,
        program: Program,
        output: str,
        routes: Routes,
        peers: Sequence[int],
        exchange: Exchange,
        precision: Precision,
    ) -> None:
        self.index = index
        """The chunk: routes and peers count chunks (chunk c runs on peers[c])."""
        self.last = index == stages - 1
        self.stages = stages
        self.module = module
        """The modules whose parameters this stage trains."""
        self.program = program
        self.model_output = output
        self.routes = routes
        self.peers = list(peers)
        self.exchange = exchange
        self.precision = precision
        """The autocast forward and loss run in, and the loss scale backward starts from."""
        self.compute: Callable[..., tuple[Any, ...]] = program
        """How the program runs: as it is, or recomputed in backward (the memory policy)."""
        self._views: ViewWatch | None = None
        """Under ZeRO 2/3: the views the chunk's sharded units return (made on first use)."""

    def _tag(self, source: int, destination: int | None = None) -> int:
        """The tag of activations from chunk `source` to `destination` (default: this one)."""
        to = self.index if destination is None else destination
        return 2 * (source * self.stages + to)

    def _key(self, x: Any) -> Hashable:
        """What fixes every shape this micro-batch sends: its input's signature and the mode."""
        signature = tuple((tuple(t.shape), t.dtype) for t in tensors(x))
        return (signature, torch.is_grad_enabled(), self.module.training)

    def expected(
        self, step: _Step, action: Action, x: Any
    ) -> list[tuple[int, int, list[TensorMeta]]] | None:
        """What `action` on this chunk will receive from other ranks, as (peer, tag, metas),
        where that is known yet (None: a header not heard, or B before its F)."""
        if action.kind == "F":
            return self.exchange.known(self._sources(self._key(x)))
        if action.kind == "W":
            return []
        flight = step.in_flight.get((self.index, action.micro))
        return None if flight is None else self._gradients_wanted(flight)

    def _sources(self, key: Hashable) -> list[tuple[int, int, Hashable]]:
        """(peer, tag, key) of each value F receives, as F and the posting ahead ask."""
        return [(self.peers[src], self._tag(src), key) for src, _ in self.routes.receives]

    def _gradients_wanted(self, flight: _InFlight) -> list[tuple[int, int, list[TensorMeta]]]:
        """(peer, tag, metas) of the gradients B receives for what F sent that needs one."""
        return [
            (self.peers[dst], self._tag(self.index, dst) + 1, metas)
            for (dst, _), ts in zip(self.routes.sends, flight.sent, strict=True)
            if (metas := [self.exchange.meta(t) for t in ts if t.requires_grad])
        ]

    def forward(
        self,
        step: _Step,
        micro: int,
        x: Any,
        y: Any | None,
        loss_of: Callable[[Any, Any], torch.Tensor] | None,
    ) -> None:
        key = self._key(x)
        messages = self.exchange.receive(self._sources(key))
        received = [_leaves(message) for message in messages]
        flat = [t for values in received for t in values]
        views = self._watch()
        with self.precision.autocast(), views.watching():
            made = self.compute(x, *flat)
        values, sent = self._sent(made)
        sending = self.exchange.send(
            [
                (self.peers[dst], self._tag(self.index, dst), t)
                for (dst, _), t in zip(self.routes.sends, sent, strict=True)
            ],
            key,
        )
        buffers = [b for message in messages for b in message.lent]
        if y is None:  # inference: nothing to keep for a backward
            step.sending.append(sending)
            if self.last:
                step.outputs.append(pytree.tree_map(self._owned, values[self.model_output]))
            for buffer in buffers:
                self.exchange.pool.give(buffer)
            return
        flight = _InFlight(received=received, buffers=buffers, sent=sent, sending=sending)
        if self.last and loss_of is not None:
            with self.precision.autocast():
                flight.loss = loss_of(values[self.model_output], y)
            step.loss = flight.loss.detach() + (step.loss if step.loss is not None else 0.0)
        views.check()
        step.in_flight[(self.index, micro)] = flight

    def _sent(self, made: tuple[Any, ...]) -> tuple[dict[str, Any], list[list[Any]]]:
        """The values `made` by name, and what each send carries. A stage of the block front
        end sends what the next stage's first piece is called with, which a forward may make
        otherwise when evaluating (RWKV's blocks pass their state then): its one send carries
        them all, in order, as the next stage's forward asks for them."""
        names = self.program.made
        if len(made) != len(names) and not self.last and len(self.routes.sends) == 1:
            return {}, [list(made)]
        values = dict(zip(names, made, strict=True))
        return values, [[values[n] for n in names] for _, names in self.routes.sends]

    def _watch(self) -> ViewWatch:
        """The views this chunk's sharded units (ZeRO 2/3) return, watched for in-place
        changes instead of warned about (made on first use, after FSDP2 wrapped them)."""
        if self._views is None:
            self._views = ViewWatch(self.module)
        return self._views

    def _sharded(self) -> bool:
        """Whether FSDP2 (ZeRO 2/3) wraps a module of this chunk."""
        return bool(self._watch().units)

    def _owned(self, value: Any) -> Any:
        """A value of its own: a copy if it lives in a pool buffer that will be reused."""
        owned = isinstance(value, torch.Tensor) and self.exchange.pool.owns(value)
        return value.clone() if owned else value

    def backward(self, step: _Step, micro: int, *, weights_later: bool) -> None:
        """B: the gradients of what this chunk received, sent back at once; the weights'
        gradients too, unless `weights_later` (then W computes them)."""
        flight = step.in_flight[(self.index, micro)]
        flight.sending.wait()  # the readers have finished this forward: they sent our gradients
        grads = self.exchange.receive_like(self._gradients_wanted(flight))
        roots: list[torch.Tensor] = [t for ts in flight.sent for t in ts if t.requires_grad]
        seeds: list[torch.Tensor | None] = [g for message in grads for g in message.tensors]
        if flight.loss is not None:
            multiplier = self.precision.multiplier  # the fp16 loss scale, as Precision.backward
            roots.append(flight.loss * multiplier if multiplier != 1.0 else flight.loss)
            seeds.append(None)
        leaves = [t for ts in flight.received for t in ts if t.requires_grad]
        with self._watch().recomputing():
            if not weights_later:
                if roots:
                    torch.autograd.backward(roots, seeds)
                found = [_grad_of(t) for t in leaves]
            elif roots and leaves and not self._sharded():
                found, flight.work = input_gradients(roots, seeds, leaves)
                roots, seeds = [], []
            elif roots and leaves:
                # FSDP2 reduces a unit's gradients as backward leaves its inputs, which B does
                # before any weight gradient exists: W re-runs the backward whole
                found = gradients_of(leaves, roots, seeds)
            else:
                found = [torch.zeros_like(t) for t in leaves]
        given = iter(found)
        back = [
            (self.peers[src], self._tag(src) + 1, [next(given) for t in ts if t.requires_grad])
            for (src, _), ts in zip(self.routes.receives, flight.received, strict=True)
        ]
        sent_back = self.exchange.send([message for message in back if message[2]], None)
        step.sending.append(sent_back)
        lent = [b for message in grads for b in message.lent]
        if weights_later:  # W reads the graph, its seeds and the received buffers
            flight.roots, flight.seeds, flight.buffers = roots, seeds, flight.buffers + lent
            return
        del step.in_flight[(self.index, micro)]
        for buffer in lent + flight.buffers:
            self.exchange.pool.give(buffer)

    def weights(self, step: _Step, micro: int) -> None:
        """W: the weight gradients B left, accumulated as a plain backward does (the
        parameters' hooks fire here); or the whole backward again, from the roots B kept."""
        flight = step.in_flight.pop((self.index, micro))
        with self._watch().recomputing():
            if flight.work is not None:
                weight_gradients(flight.work)
            if flight.roots:
                torch.autograd.backward(flight.roots, flight.seeds)
        for buffer in flight.buffers:
            self.exchange.pool.give(buffer)


def _leaves(message: Received) -> list[torch.Tensor]:
    """Received values as autograd leaves, needing a gradient where the sender's value did."""
    return [
        buffer.detach().requires_grad_(meta.requires_grad and torch.is_grad_enabled())
        for buffer, meta in zip(message.tensors, message.metas, strict=True)
    ]


def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    """The gradient a received value collected (zeros if nothing here used it)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
