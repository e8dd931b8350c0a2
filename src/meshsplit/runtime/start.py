"""One start for every rank: rank 0's model values and one random stream where it matters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.mesh import Mesh

__all__: list[str] = []


def share_random_stream(mesh: Mesh, everywhere: bool = False) -> None:
    """Give the tp ranks of each group one random stream: the first tp rank's (`everywhere`:
    every rank rank 0's).

    Every tp rank then draws the same dropout masks (and any other random numbers) in the
    replicated regions, so replicated parameters stay bit-identical across tp; the ranks
    stay in step because each draws the same amounts. dp replicas and stages keep their own
    streams (usually one seed on every rank, as the caller set it). A no-op when the tp
    ranks were seeded alike.
    """
    first, group = mesh.global_rank(tp=0), mesh.group("tp")
    if everywhere:
        first, group = 0, dist.distributed_c10d._get_default_group()
    if dist.get_world_size(group) == 1:
        return
    state = torch.get_rng_state()
    dist.broadcast(state, src=first, group=group)
    torch.set_rng_state(state)
    if mesh.device.type == "cuda":
        device_state = torch.cuda.get_rng_state().to(mesh.device)
        dist.broadcast(device_state, src=first, group=group)
        torch.cuda.set_rng_state(device_state.cpu())


def broadcast_from_first_rank(model: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
