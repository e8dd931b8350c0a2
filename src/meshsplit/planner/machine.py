"""What a machine's links and cores cost, as numbers the planner's pure cost model reads.

A `Link` is the alpha-beta model of one collective over one group size: `alpha_s` seconds
to start plus `nbytes / bytes_per_s`, with `nbytes` the payload this rank contributes (as
`traffic.py` counts it). A `Machine` holds one Link per (operation, group size), the cores
the workers share and how fast a worker computes when several run at once. `calibrate.py`
measures one on the real backend; tests build them from made-up numbers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__: list[str] = []

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives the cost model prices. all_to_all: each rank's payload split evenly over
the group (the expert split's token dispatch); send_recv: one message between two ranks."""


@dataclass(frozen=True)
class Link:
    """Seconds for one collective: alpha_s + nbytes / bytes_per_s."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Machine:
    """Links per operation and group size, and how workers share the compute.

    `links[operation][group_size]`; a group size not measured is priced by the nearest
    measured one (the cost of a ring grows slowly with its size). `cores` is what the
    workers share on one host (None: each worker has its own device, as on a GPU node).
    `compute_slowdown[workers]` is how much longer a worker's compute takes when `workers`
    run at once (1.0 for one; on a 2-core host about workers / 2 past two).
    """

    name: str
    links: dict[str, dict[int, Link]]
    cores: int | None = None
    compute_slowdown: dict[int, float] = field(default_factory=dict)
    message_s: dict[int, float] = field(default_factory=dict)
    """Seconds of one small message to a rank that waits for it, with `workers` on this
    host (measured per job: a woken rank may wait for a core)."""
    lockstep_s: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """group size -> (bytes per rank, seconds) of one blocking all-reduce at a few payloads
    when every worker on this host is busy between collectives (measured per job): the
    least such a collective costs, read between the points and past the last at the link's
    bandwidth. Busy ranks wake each other for every hop of a collective: a 512 KiB one took
    2.5-2.8 ms between bursts of work here, against 0.8 between idle ranks."""
    flop_per_s: float | None = None
    """Paper mode: compute is priced as FLOPs at this rate instead of this host's timings."""
    launch_s: float = 0.0
    """Paper mode: the least time one operator takes (the host dispatching it and launching
    its kernel): an item's compute is priced at no less than its operators times this."""
    memory_bytes_per_s: float | None = None
    """Paper mode: memory-bound work (the optimizer step, the loss) is priced as the bytes it
    streams at this rate instead of this host's timings."""

    def link(self, operation: str, group_size: int) -> Link:
        sizes = self.links[operation]
        nearest = min(sizes, key=lambda size: (abs(size - group_size), -size))
        return sizes[nearest]

    def seconds(self, operation: str, group_size: int, nbytes: float) -> float:
        """One collective of `nbytes` (this rank's payload) over `group_size` ranks."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        return self.link(operation, group_size).seconds(nbytes)

    def blocking_s(
        self, operation: str, group_size: int, calls: float, nbytes: float, stretch: float
    ) -> float:
        """`calls` blocking collectives moving `nbytes` in all over `group_size` ranks inside
        a busy step: each at least what one of its payload costs in lockstep on this host
        when every worker works between them (in unstretched time: the step is stretched by
        `stretch` later)."""
        link = self.link(operation, group_size)
        if calls <= 0:
            return nbytes / link.bytes_per_s
        each = nbytes / calls
        idle = link.alpha_s + each / link.bytes_per_s
        busy = _between(self.lockstep_s.get(group_size, ()), each, link.bytes_per_s) / stretch
        return calls * max(idle, busy)

    def slowdown(self, workers: int) -> float:
        """Compute-time factor with `workers` busy at once (measured, else cores-based)."""
        if workers in self.compute_slowdown:
            return self.compute_slowdown[workers]
        if self.cores is None:
            return 1.0
        return max(1.0, workers / self.cores)

    def unshared(self) -> Machine:
        """These links with their own group's core sharing taken out: a collective timed
        over g workers that fill the cores ran g-fold shared, and the cost model stretches
        the whole step by the plan's sharing afterwards (once, not twice)."""
        if self.cores is None:
            return self
        links = {
            op: {g: _slowed(link, self.slowdown(g)) if g >= self.cores else link
                 for g, link in sizes.items()}
            for op, sizes in self.links.items()
        }  # fmt: skip
        return replace(self, links=links)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cores": self.cores,
            "compute_slowdown": {str(k): v for k, v in self.compute_slowdown.items()},
            "flop_per_s": self.flop_per_s,
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "launch_s": self.launch_s,
            "message_s": {str(k): v for k, v in self.message_s.items()},
            "lockstep_s": {
                str(k): [list(point) for point in v] for k, v in self.lockstep_s.items()
            },
            "links": {
                op: {str(size): asdict(link) for size, link in sizes.items()}
                for op, sizes in self.links.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Machine:
        return cls(
            name=data["name"],
            cores=data.get("cores"),
            compute_slowdown={int(k): float(v) for k, v in data["compute_slowdown"].items()},
            flop_per_s=data.get("flop_per_s"),
            memory_bytes_per_s=data.get("memory_bytes_per_s"),
            launch_s=float(data.get("launch_s", 0.0)),
            message_s={int(k): float(v) for k, v in data.get("message_s", {}).items()},
            lockstep_s={
                int(k): tuple((float(x), float(y)) for x, y in v)
                for k, v in data.get("lockstep_s", {}).items()
            },
            links={
                op: {int(size): Link(**link) for size, link in sizes.items()}
                for op, sizes in data["links"].items()
            },
        )

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def _slowed(link: Link, factor: float) -> Link:
    """`link` `factor` times faster (never slower): its time with the sharing taken out."""
    factor = max(1.0, factor)
    return Link(alpha_s=link.alpha_s / factor, bytes_per_s=link.bytes_per_s * factor)


def _between(points: tuple[tuple[float, float], ...], x: float, bytes_per_s: float) -> float:
    """The seconds at `x` bytes on the line through `points` (sorted by bytes): the first
    point's below it, the link's bandwidth past the last; 0 without points."""
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    last_x, last_y = points[-1]
    return last_y + (x - last_x) / bytes_per_s
