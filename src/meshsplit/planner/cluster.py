"""A GPU cluster described by its public spec sheet, for planning runs this machine cannot do.

A `Cluster` holds what paper mode (`paper.py`) prices a layout with: peak FLOP/s, HBM, GPUs
per node, an alpha-beta `Link` inside a node and one between nodes, and three fractions of
each peak that kernels reach, each sourced in the shipped JSON. `load_cluster` takes a name
under `clusters/` or a path. Rationale: docs/internals.md#plannerclusterpy
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from meshsplit.plan import PlanError
from meshsplit.planner.machine import OPERATIONS, Link, Machine

__all__ = ["Cluster", "cluster_names", "load_cluster"]

DEFAULT_LAUNCH_S = 5e-6
"""A cluster file without `launch_s`: eager dispatch of one operator (1-4 us measured on
this project's CPU host for add, view and linear) plus a CUDA kernel launch."""

FRACTIONS = ("matmul_efficiency", "memory_efficiency", "link_efficiency")
"""Fields that are fractions of a peak: in (0, 1]."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """One homogeneous GPU cluster: devices, nodes and the links between them."""

    name: str
    """Short name, e.g. 'dgx-a100'."""
    flops: Mapping[str, float] = field(hash=False)
    """Peak dense (no sparsity) FLOP/s of one device by dtype, e.g. {'bf16': 312e12}."""
    memory_bytes: float
    """HBM capacity of one device in bytes."""
    memory_bytes_per_s: float
    """HBM bandwidth of one device in bytes/s (what memory-bound kernels stream at)."""
    devices_per_node: int
    """GPUs that share one NVLink/NVSwitch domain."""
    intra_node: Link
    """NVLink/NVSwitch: one message between GPUs of a node, per GPU and direction."""
    inter_node: Link
    """InfiniBand: one message between nodes, per GPU and direction (one NIC per GPU)."""
    matmul_efficiency: float
    """Fraction of peak FLOP/s the best large GEMM reaches on one device (measured, public)."""
    memory_efficiency: float
    """Fraction of HBM bandwidth a streaming elementwise kernel reaches."""
    link_efficiency: float
    """Fraction of a link's bandwidth NCCL collectives reach (bus bandwidth / spec)."""
    launch_s: float = DEFAULT_LAUNCH_S
    """The least time one operator takes in eager PyTorch: the host dispatching it and
    launching its kernel (small models are bound by it, not by FLOPs)."""
    description: str = ""
    """One line on what the figures describe."""
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Where each figure comes from, by field name."""

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of one device for `dtype`; unknown dtypes are a PlanError."""
        if dtype not in self.flops:
            raise PlanError(
                f"cluster {self.name!r} has no FLOP/s for dtype={dtype!r}; "
                f"use one of {', '.join(sorted(self.flops))}"
            )
        return self.flops[dtype]

    def link(self, group_span: int) -> Link:
        """The link a group of `group_span` consecutive ranks is limited by.

        A group whose ranks fit in one node talks over NVLink; a larger one crosses nodes,
        and its slowest hop is the InfiniBand NIC of each GPU.
        """
        return self.intra_node if group_span <= self.devices_per_node else self.inter_node

    def machine(self, *, dtype: str = "fp32", group_sizes: tuple[int, ...] = ()) -> Machine:
        """This cluster as a `Machine` for the planner's cost model (`cost.py`), on paper.

        Ring collectives over n consecutive ranks on the link they are limited by, with
        B = bytes_per_s * link_efficiency and the payload as `traffic.py` counts it:
        all_reduce of S bytes 2(n-1)·alpha + 2(n-1)/n·S/B; reduce_scatter of input S
        (n-1)·alpha + (n-1)/n·S/B; all_gather of a shard S (n-1)·alpha + (n-1)·S/B;
        all_to_all of S (pairwise: S/n to each peer) like reduce_scatter; send_recv
        alpha + S/B. Compute runs at peak(dtype) * matmul_efficiency, memory-bound work (the
        optimizer, the loss) at memory_bytes_per_s * memory_efficiency, and no operator takes
        less than launch_s.
        `group_sizes` default: powers of two up to 4096 and devices_per_node.
        """
        sizes = group_sizes or tuple(sorted({2**k for k in range(1, 13)} | {self.devices_per_node}))
        links: dict[str, dict[int, Link]] = {op: {} for op in OPERATIONS}
        for n in sizes:
            if n < 2:
                continue
            raw = self.link(n)
            alpha, rate = raw.alpha_s, raw.bytes_per_s * self.link_efficiency
            links["all_reduce"][n] = Link(
                alpha_s=2 * (n - 1) * alpha, bytes_per_s=rate * n / (2 * (n - 1))
            )
            links["reduce_scatter"][n] = Link(
                alpha_s=(n - 1) * alpha, bytes_per_s=rate * n / (n - 1)
            )
            links["all_gather"][n] = Link(alpha_s=(n - 1) * alpha, bytes_per_s=rate / (n - 1))
            links["all_to_all"][n] = links["reduce_scatter"][n]
            links["send_recv"][n] = Link(alpha_s=alpha, bytes_per_s=rate)
        return Machine(
            name=self.name,
            links=links,
            cores=None,
            flop_per_s=self.peak_flops(dtype) * self.matmul_efficiency,
            memory_bytes_per_s=self.memory_bytes_per_s * self.memory_efficiency,
            launch_s=self.launch_s,
        )

    def as_dict(self) -> dict[str, Any]:
        """The cluster as the JSON a file holds."""
        return {
            "name": self.name,
            "description": self.description,
            "flops": dict(self.flops),
            "memory_bytes": self.memory_bytes,
            "memory_bytes_per_s": self.memory_bytes_per_s,
            "devices_per_node": self.devices_per_node,
            "intra_node": {
                "alpha_s": self.intra_node.alpha_s,
                "bytes_per_s": self.intra_node.bytes_per_s,
            },
            "inter_node": {
                "alpha_s": self.inter_node.alpha_s,
                "bytes_per_s": self.inter_node.bytes_per_s,
            },
            "matmul_efficiency": self.matmul_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "link_efficiency": self.link_efficiency,
            "launch_s": self.launch_s,
            "sources": dict(self.sources),
        }


def cluster_names() -> list[str]:
    """Names of the shipped clusters (files in `clusters/`)."""
    folder = resources.files("meshsplit.planner").joinpath("clusters")
    return sorted(
        entry.name.removesuffix(".json")
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    )


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A shipped cluster by name ('dgx-a100', 'dgx-h100', 'dgx-h200') or one from a JSON file.

    Every field is checked: a missing one, a wrong type, or a number that is not positive is
    a PlanError naming the field and the file, with what would work.
    """
    text, where = _read(name_or_path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(
            f"cluster file {where} is not valid JSON ({error}); "
            "see clusters/dgx-a100.json for the format"
        ) from None
    if not isinstance(data, dict):
        raise PlanError(
            f"cluster file {where} must hold one JSON object; "
            "see clusters/dgx-a100.json for the format"
        )
    return _from_dict(data, where)


def _read(name_or_path: str | Path) -> tuple[str, str]:
    names = cluster_names()
    if isinstance(name_or_path, str) and name_or_path in names:
        entry = resources.files("meshsplit.planner").joinpath("clusters", f"{name_or_path}.json")
        return entry.read_text(encoding="utf-8"), f"clusters/{name_or_path}.json"
    path = Path(name_or_path)
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    raise PlanError(
        f"cluster {str(name_or_path)!r} is neither a shipped cluster nor a file; "
        f"use one of {', '.join(names)} or a path to a JSON file like clusters/dgx-a100.json"
    )


def _from_dict(data: dict[str, Any], where: str) -> Cluster:
    def number(key: str, container: dict[str, Any] = data, label: str = "") -> float:
        label = label or key
        if key not in container:
            raise PlanError(
                f"cluster file {where} is missing field {label!r}; "
                f"add it (see clusters/dgx-a100.json)"
            )
        value = container[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PlanError(f"cluster file {where}: field {label!r}={value!r} must be a number")
        if not value > 0:
            raise PlanError(f"cluster file {where}: field {label!r}={value!r} must be positive")
        return float(value)

    def link(key: str) -> Link:
        raw = data.get(key)
        if not isinstance(raw, dict):
            raise PlanError(
                f"cluster file {where}: field {key!r} must be an object like "
                '{"alpha_s": 5e-06, "bytes_per_s": 3e+11}'
            )
        return Link(
            alpha_s=number("alpha_s", raw, f"{key}.alpha_s"),
            bytes_per_s=number("bytes_per_s", raw, f"{key}.bytes_per_s"),
        )

    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise PlanError(f"cluster file {where}: field 'name' must be a non-empty string")
    flops = data.get("flops")
    if not isinstance(flops, dict) or not flops:
        raise PlanError(
            f"cluster file {where}: field 'flops' must be an object of FLOP/s by "
            'dtype, e.g. {"bf16": 3.12e+14}'
        )
    peak = {str(dtype): number(dtype, flops, f"flops.{dtype}") for dtype in flops}
    per_node = number("devices_per_node")
    if per_node != int(per_node):
        raise PlanError(
            f"cluster file {where}: field 'devices_per_node'={per_node} must be a "
            "whole number, e.g. 8"
        )
    fractions = {key: number(key) for key in FRACTIONS}
    for key, value in fractions.items():
        if value > 1:
            raise PlanError(
                f"cluster file {where}: field {key!r}={value} is a fraction of a "
                "peak and must be at most 1, e.g. 0.8"
            )
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise PlanError(f"cluster file {where}: field 'sources' must be an object of strings")
    return Cluster(
        name=name,
        description=str(data.get("description", "")),
        flops=peak,
        memory_bytes=number("memory_bytes"),
        memory_bytes_per_s=number("memory_bytes_per_s"),
        devices_per_node=int(per_node),
        intra_node=link("intra_node"),
        inter_node=link("inter_node"),
        sources={str(k): str(v) for k, v in sources.items()},
        launch_s=number("launch_s") if "launch_s" in data else DEFAULT_LAUNCH_S,
        **fractions,
    )
