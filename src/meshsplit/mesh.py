"""The dp x pp x tp device mesh: named process groups, passed to whatever needs them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from meshsplit.plan import Plan

__all__: list[str] = []

AXES = ("dp", "pp", "tp")
"""Mesh axes, outermost first: tp ranks are neighbours, so operator-split traffic stays local."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its shard when it is a DTensor (FSDP2's sharded
    parameters, their gradients and optimizer state), else the tensor."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():  # the shard itself, not a view made through autograd
        return tensor.to_local()


def job_timeout(device: torch.device) -> timedelta | None:
    """The timeout the job's process group was started with (None where torch hides it)."""
    default = dist.distributed_c10d._get_default_group()
    try:
        return default._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def ensure_process_group() -> None:
    """Start a one-process gloo group when the caller runs outside `launch` (plain `python`)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class Mesh:
    """This process's place on the dp x pp x tp mesh and the groups along each axis."""

    device_mesh: DeviceMesh
    device: torch.device

    @classmethod
    def build(cls, plan: Plan) -> Mesh:
        """Create the mesh for `plan` on the running process group (every rank must call this)."""
        ensure_process_group()
        plan.check_world(dist.get_world_size())
        on_gpu = dist.get_backend() == "nccl"
        device = (
            torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        )
        shape = (plan.dp, plan.pp, plan.tp)
        if plan.server_count:  # the workers' mesh; the servers (the last ranks) stand beside it
            workers = torch.arange(plan.mesh_size).view(shape)
            device_mesh = DeviceMesh(device.type, workers, mesh_dim_names=AXES)
        else:
            device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=AXES)
        return cls(device_mesh=device_mesh, device=device)

    @property
    def is_server(self) -> bool:
        """Whether this process is a parameter server, outside the workers' mesh."""
        return self._coordinate is None

    @cached_property
    def world(self) -> dist.ProcessGroup:
        """Every process of the mesh (the whole job, less any parameter servers); asked every
        step, so found once."""
        if self.device_mesh.mesh.numel() == dist.get_world_size():
            return dist.distributed_c10d._get_default_group()
        return self.group("dp")  # with servers, pp == tp == 1: dp spans the mesh

    def size(self, axis: str) -> int:
        return self.device_mesh.size(AXES.index(axis))

    def rank(self, axis: str) -> int:
        """This process's coordinate along `axis`."""
        if self._coordinate is None:
            return self.device_mesh.get_local_rank(axis)  # a server: DeviceMesh says why not
        return self._coordinate[AXES.index(axis)]

    @cached_property
    def _coordinate(self) -> tuple[int, ...] | None:
        """Where this process sits on the mesh, read once (DeviceMesh looks it up per call)."""
        coordinate = self.device_mesh.get_coordinate()
        return None if coordinate is None else tuple(coordinate)

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(axis)

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A group of `ranks` apart from the mesh's axes (every rank must call this), bounded
        by the job's timeout like the mesh's own groups: new_group's default is 30 minutes."""
        return dist.new_group(ranks, timeout=job_timeout(self.device))

    def global_rank(self, **coordinates: int) -> int:
        """The global rank at this process's coordinates, with some replaced (e.g. pp=stage+1)."""
        index = [coordinates.get(axis, self.rank(axis)) for axis in AXES]
        return int(self.device_mesh.mesh[tuple(index)].item())

    @property
    def is_first_rank(self) -> bool:
        """Rank 0 of the whole job: the one that prints."""
        return dist.get_rank() == 0
