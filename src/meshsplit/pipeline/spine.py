"""A stage as the model's own forward with the other stages' pieces stubbed out.

Stage k holds pieces [first, stop) (see `blocks.py`) and runs the whole `forward`: pieces
before `first` return placeholders, the inputs of piece `first` are replaced by what stage k-1
sent, and the inputs of piece `stop` are what this stage sends on, where the forward is
abandoned. `check_chain` proves in one process that the chain gives the model's own output.
Rationale: docs/internals.md#pipelinespinepy
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshsplit.batch import call_model, rows, tensors
from meshsplit.pipeline.blocks import Piece
from meshsplit.plan import PlanError

__all__: list[str] = []


class _Cut(BaseException):
    """Stops the forward at the next stage's first piece (BaseException: no `except Exception`
    in a model's forward catches it)."""

    def __init__(self, values: list[torch.Tensor]) -> None:
        super().__init__()
        self.values = values


class Spine:
    """Runs a range of pieces of `model` inside the model's own forward (one per model)."""

    def __init__(self, model: nn.Module, pieces: Sequence[Piece]) -> None:
        self.model = model
        self.pieces = list(pieces)
        self._range: tuple[int, int] | None = None
        self._received: list[torch.Tensor] = []
        self._swapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id of a tensor the stage's first piece was called with -> (it, its received value)."""
        self._calls: dict[int, int] = {}
        """Piece index -> its calls so far in this run, before the stage's first piece."""
        self._rows = 0
        self._device = torch.device("cpu")
        for index, piece in enumerate(self.pieces):
            self._wrap(index, piece)

    def _wrap(self, index: int, piece: Piece) -> None:
        original = piece.module.forward
        spine = self

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if spine._range is None:
                return original(*args, **kwargs)
            first, stop = spine._range
            if index < first:  # what this call of the piece answered on the example
                call = spine._calls[index] = spine._calls.get(index, -1) + 1
                answers = piece.placeholders.get(module.training)
                answers = answers or next(iter(piece.placeholders.values()))
                made = answers[min(call, len(answers) - 1)]
                return made.make(spine._rows, spine._device)
            if index == first and first > 0 and not spine._swapped:  # its first call only
                args, kwargs = spine._substitute(piece, (args, kwargs))
            elif spine._swapped:
                args, kwargs = spine._resubstitute((args, kwargs))
            if index == stop:  # what crosses is what the piece would have been called with
                raise _Cut(tensors((args, kwargs)))
            return original(*args, **kwargs)

        piece.module.forward = types.MethodType(forward, piece.module)

    def _substitute(self, piece: Piece, call: tuple[Any, Any]) -> tuple[Any, Any]:
        """The call's tensors replaced, in pytree order, by those the previous stage sent."""
        leaves, spec = pytree.tree_flatten(call)
        received = iter(self._received)
        count = sum(isinstance(leaf, torch.Tensor) for leaf in leaves)
        if count != len(self._received):
            raise PlanError(
                f"{piece.name!r} is called with {count} tensors here but the stage before sent "
                f"{len(self._received)}: the model's forward passes different values on "
                "different stages; cut elsewhere with Plan.split_points"
            )
        swapped = [next(received) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        for old, new in zip(leaves, swapped, strict=True):
            if isinstance(old, torch.Tensor):
                self._swapped[id(old)] = (old, new)
        return pytree.tree_unflatten(swapped, spec)

    def _resubstitute(self, call: tuple[Any, Any]) -> tuple[Any, Any]:
        """A later piece's call with every tensor the first piece was handed replaced too.

        The forward passes some values to every piece (an encoder's output to each decoder
        block, a mask); made here from placeholders, they must be the received ones.
        """

        def swap(leaf: Any) -> Any:
            old, new = self._swapped.get(id(leaf), (None, None))
            return new if old is leaf else leaf

        return pytree.tree_map(swap, call)

    def run(
        self, first: int, stop: int, inputs: Any, received: Sequence[torch.Tensor]
    ) -> tuple[Any, ...]:
        """Pieces [first, stop) on `inputs`: what piece `stop` is called with, or the output."""
        leaves = tensors(inputs)
        self._range, self._received = (first, stop), list(received)
        self._rows, self._device = rows(inputs), leaves[0].device
        try:
            output = call_model(self.model, inputs)
        except _Cut as cut:
            return tuple(cut.values)
        finally:
            self._range, self._received, self._swapped, self._calls = None, [], {}, {}
        if stop < len(self.pieces):
            raise PlanError(
                f"the forward of {type(self.model).__name__} did not call "
                f"{self.pieces[stop].name!r} on this input, though it did on the example; "
                "the layer split needs every piece called on every batch"
            )
        return (output,)


def check_chain(spine: Spine, sizes: Sequence[int], example: Any) -> None:
    """Refuse a cut whose stages, chained, do not give the model's own output on `example`,
    evaluating nor training alike seeded (see `cut_positions`).

    That happens when the forward reads, after a cut, something made before it other than
    through the arguments of the piece after it (say, the embeddings' output reused at the
    end). Runs with every stage's weights still here.
    """
    mismatches = []
    for training in (False, True):
        with _in_mode(spine.model, training=training):
            want = _whole(spine, example)
            try:
                mismatches.append(_first_mismatch(_chained(spine, sizes, example), want))
            except (PlanError, RuntimeError, ValueError, IndexError, TypeError) as error:
                mismatches.append(str(error))
        if not mismatches[-1]:
            return
    starts = [spine.pieces[sum(sizes[:k])].name for k in range(1, len(sizes))]
    raise PlanError(
        f"cutting {type(spine.model).__name__} before {starts} changes its output "
        f"({mismatches[0]}): its forward uses a value from before a cut other than through "
        "the arguments of the piece after it; choose other cuts with Plan.split_points, or "
        "make the model an nn.Sequential of pieces"
    )


def cut_positions(spine: Spine, example: Any) -> list[int]:
    """The pieces a stage may begin at: those where one cut alone keeps the model's output,
    evaluating (no dropout) or training alike seeded (the mode the stages run in, whose
    values the placeholders hold: RWKV's blocks pass a state only when evaluating).

    (GPT-2 adds its token and position embeddings after calling both, so no stage may begin
    at the position embedding; a recurrent-depth model loops over some blocks, so no stage
    begins inside the loop.)
    """
    count = len(spine.pieces)
    kept: set[int] = set()
    for training in (False, True):
        if len(kept) == count - 1:
            break
        with _in_mode(spine.model, training=training):
            want = _whole(spine, example)
            kept |= {
                k
                for k in range(1, count)
                if k not in kept and _keeps(spine, (k, count - k), example, want)
            }
    return sorted(kept)


def _keeps(spine: Spine, sizes: Sequence[int], example: Any, want: Any) -> bool:
    """Whether stages of `sizes`, chained, give `want`; a cut inside a loop over pieces (a
    piece the forward calls again after a later one) fails, or runs on placeholders."""
    try:
        return not _first_mismatch(_chained(spine, sizes, example), want)
    except (PlanError, RuntimeError, ValueError, IndexError, TypeError):
        return False


@contextmanager
def _in_mode(model: nn.Module, *, training: bool) -> Iterator[None]:
    """Runs of `model` in one mode, without gradients, leaving its modes, buffers (running
    statistics) and the random streams as they were."""
    modes = {module: module.training for module in model.modules()}
    buffers = [b.detach().clone() for b in model.buffers()]
    model.train(training)
    try:
        with torch.no_grad(), torch.random.fork_rng():
            yield
    finally:
        for module, mode in modes.items():
            module.training = mode
        with torch.no_grad():
            for saved, live in zip(buffers, model.buffers(), strict=True):
                live.copy_(saved)


_SEED = 0
"""Each run starts from this seed (inside `_in_mode`), so training runs draw alike."""


def _whole(spine: Spine, example: Any) -> Any:
    torch.manual_seed(_SEED)
    return call_model(spine.model, example)


def _chained(spine: Spine, sizes: Sequence[int], example: Any) -> Any:
    torch.manual_seed(_SEED)
    values: tuple[Any, ...] = ()
    start = 0
    for size in sizes:
        values = spine.run(start, start + size, example, tensors(values))
        start += size
    return values[0]


def _first_mismatch(got: Any, want: Any) -> str:
    got_leaves, want_leaves = tensors(got), tensors(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} output tensors instead of {len(want_leaves)}"
    for index, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True):
            return f"output tensor {index} differs"
    return ""
