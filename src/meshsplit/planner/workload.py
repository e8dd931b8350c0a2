"""What one model costs, item by item, at each operator-split width: the cost model's input.

An item is what the layer split cuts between (a traced layer, or a block of a block list).
Its times are lines in the micro-batch's rows, fitted from profiles at two sizes, because a
plan changes the rows each rank runs (global batch / (dp * micro-batches)); its traffic under
tp is bytes per row per collective. All of it is measured once per width (`measure.py`) and
then priced for any plan without running it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__: list[str] = []


@dataclass(frozen=True)
class Line:
    """Seconds at a micro-batch's rows: straight between measured (rows, seconds) points,
    extended past the ends along the nearest segment (never below zero).

    Small batches on a CPU are not proportional (fixed costs dominate), so an item is
    measured at every power of two of rows a plan can give it, not at two sizes.
    """

    points: tuple[tuple[float, float], ...]

    def at(self, rows: float) -> float:
        points = self.points
        if len(points) == 1:
            return max(0.0, points[0][1] * rows / points[0][0])
        index = next((i for i, (r, _) in enumerate(points) if r >= rows), len(points) - 1)
        index = min(max(index, 1), len(points) - 1)
        (r0, s0), (r1, s1) = points[index - 1], points[index]
        return max(0.0, s0 + (s1 - s0) * (rows - r0) / (r1 - r0))

    @classmethod
    def per_row(cls, seconds_per_row: float) -> Line:
        return cls(((1.0, seconds_per_row),))


@dataclass(frozen=True)
class Traffic:
    """One collective kind an item calls over the tp group, per micro-batch."""

    operation: str
    """all_reduce or all_gather (payload as traffic.py counts it)."""
    calls: int
    bytes_per_row: float


@dataclass(frozen=True, kw_only=True)
class Item:
    """One item of the model at one tp width, on one tp rank."""

    name: str
    forward: Line
    backward: Line
    parameter_bytes: int
    """Parameters and buffers this tp rank holds for the item."""
    output_bytes_per_row: float
    """What a stage boundary after the item sends per row (and receives back as gradient),
    in the dtypes the item makes them (under autocast: the autocast dtype for matmuls)."""
    compact_output_bytes_per_row: float | None = None
    """The same outputs with their floating tensors in a 2-byte dtype: what the boundary
    sends when transfers travel in bf16 or fp16 (mixed precision, compress_transfers='bf16').
    None: half of output_bytes_per_row (outputs all fp32)."""
    saved_bytes_per_row: float
    """Tensors autograd keeps for the item's backward, per row."""
    exit_bytes_per_row: float = 0.0
    """Outputs of the item's modules that hold parameters, per row: the gradients arriving
    there are what zero bubble's B keeps for W (pipeline/split_backward.py)."""
    trainable: bool = True
    forward_flops_per_row: float = 0.0
    backward_flops_per_row: float = 0.0
    forward_ops: int = 0
    """Operators one forward of the item dispatches, whatever its rows (paper mode prices
    each at least a kernel launch)."""
    backward_ops: int = 0
    forward_traffic: tuple[Traffic, ...] = ()
    backward_traffic: tuple[Traffic, ...] = ()
    expert_bytes: int = 0
    """Of parameter_bytes, the experts modules': what Plan.ep divides over its ranks."""
    experts_calls: int = 0
    """Experts modules the item calls per forward (each dispatches its tokens under ep)."""
    dispatch_bytes_per_row: float = 0.0
    """Bytes of (token, top-k slot) rows the item's experts modules are handed per row,
    summed over them: one all-to-all's payload on a rank under ep (hidden size x top-k x
    tokens per row, in the activation dtype)."""
    batch_norm_channels: tuple[int, ...] = ()
    """Channels of each BatchNorm in the item: under dp each one's forward waits for an
    all-gather of its statistics and its backward for an all-reduce of two sums
    (batchnorm.py), per micro-batch, whatever the rows."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, measured: items per tp width, and what runs around them."""

    items: dict[int, tuple[Item, ...]]
    """tp width -> the items, in order."""
    precision: str = "fp32"
    """The Plan.precision the items were measured under (their times, bytes and traffic)."""
    loss_forward: Line
    loss_backward: Line
    optimizer_s_per_byte: float
    """Seconds of optimizer.step per byte of parameters it updates."""
    optimizer_state_per_byte: float
    """Bytes of optimizer state per byte of parameters (Adam: 2, SGD with momentum: 1)."""
    accumulate_s_per_byte: float = 0.0
    """Seconds per byte of parameters to add a micro-batch's gradients to those of the
    micro-batches before it (autograd's accumulation, m - 1 times a step of m)."""
    step_overhead_s: float = 0.0
    """What a whole step takes beyond its items, loss and optimizer (engine bookkeeping)."""
    global_rows: int
    """The global batch the workload was measured for."""
    refused: dict[int, str] = field(default_factory=dict)
    """tp width -> why the model cannot be split that wide."""
    parameter_bytes: int = 0
    """The whole model's parameters and buffers."""
    min_rows: int = 1
    """The fewest micro-batch rows the model runs on (BatchNorm wants more than one value per
    channel in training)."""
    min_rows_reason: str = ""
    """What the model said at fewer rows than `min_rows`."""
    experts: tuple[int, ...] = ()
    """The number of experts of each experts module (empty: a dense model, no ep to try)."""
    cut_starts: tuple[int, ...] | None = None
    """The items a pipeline stage may begin at, as the layer split allows (a block list whose
    forward reads a value across some places, GPT-2's position embedding); None: any."""

    @property
    def widths(self) -> list[int]:
        return sorted(self.items)

    def segments(self, tp: int) -> list[tuple[int, int]]:
        """[start, stop) runs of the items at width `tp` that a stage takes whole: from one
        allowed start to the next."""
        count = len(self.items[tp])
        starts = range(1, count) if self.cut_starts is None else self.cut_starts
        bounds = [0, *(k for k in starts if 0 < k < count), count]
        return list(zip(bounds, bounds[1:], strict=False))

    def trainable_segments(self, tp: int) -> int:
        """How many stages (chunks) the items at width `tp` can be cut into at most."""
        items = self.items[tp]
        return sum(any(item.trainable for item in items[a:b]) for a, b in self.segments(tp))
