"""Checkpoints that outlive the processes and the plan, on `torch.distributed.checkpoint`.

Every rank hands DCP its own part under the ORIGINAL model's names, tp shards as DTensors, so
any later plan reads the slice it needs. A save goes to `step-N.partial/` and is renamed once
every rank has finished, so an interrupted save never touches the last good checkpoint.
Rationale: docs/internals.md#runtimecheckpointpy
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshsplit import tensor as tp_tensor
from meshsplit.memory import pools
from meshsplit.mesh import Mesh, local_tensor
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import Precision
from meshsplit.runtime import fused_parts, optimizer_keys, optimizer_settings

__all__ = ["CheckpointError", "load_full_state_dict"]

LATEST = "latest"
LOSS_SCALE = "amp/loss_scale"
"""fp16's loss scale and its clean steps, as one tensor (the same on every rank)."""
SETTINGS = "optim_settings"
"""Each optimizer parameter group's settings (lr, ...): what a schedule has moved."""
KEEP = 2
"""Complete checkpoints kept in a directory; older ones are removed after a good save."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this model."""


class _LocalState(Protocol):
    def local_state_dict(self) -> dict[str, torch.Tensor]: ...

    def parameter_names(self) -> dict[torch.Tensor, str]: ...


@dataclass
class Training:
    """What a checkpoint reads and restores: this rank's part of the model, its optimizer
    (None before the model is split: no state exists yet), and where training is."""

    plan: Plan
    mesh: Mesh
    runner: _LocalState
    optimizer: torch.optim.Optimizer | None
    layouts: dict[str, tuple[int, int]]
    """State-dict name -> (dimension, parts) of every tensor the operator split cut."""
    steps: int
    data_position: dict[str, int]
    precision: Precision | None = None
    """The fp16 loss scale to save and restore with the rest (none under other precisions)."""
    expert_names: set[str] = field(default_factory=set)
    """State-dict names of the experts split along dim 0 over `expert_group` (Plan.ep)."""
    expert_group: dist.ProcessGroup | None = None


def check_plan(plan: Plan) -> None:
    """Refuse checkpoints where the training state is not on the workers."""
    if plan.sync == "ps":
        raise PlanError(
            "checkpoints of sync='ps' plans are not supported: the optimizer state lives "
            "on the parameter servers; save full_state_dict() instead, or train with "
            "sync='allreduce' to checkpoint and resume"
        )


def save(training: Training, directory: str | os.PathLike[str]) -> Path:
    """Write the training state to `directory/step-N/` and point `latest` at it."""
    root = Path(directory)
    names: list[Any] = [None]
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        names[0] = _fresh_name(root, training.steps)
    dist.broadcast_object_list(names, src=0)
    final = root / names[0]
    staging = root / f"{names[0]}.partial"
    dcp.save(_state(training, *_split_keys(training)), checkpoint_id=staging)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(staging, final)
        pointer = root / f"{LATEST}.partial"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
        _prune(root, keep=final.name)
    dist.barrier()
    return final


def check_readable(path: Path) -> None:
    """Refuse a checkpoint whose metadata cannot be read, before it is needed."""
    _metadata(path)


def load(training: Training, directory: str | os.PathLike[str]) -> Path:
    """Restore model, optimizer, step count, RNG and data position; the plan may differ."""
    path = resolve(directory)
    metadata = _metadata(path)
    _ensure_optimizer_state(training)
    layouts, experts = _split_keys(training)
    state = _state(training, layouts, experts)
    saved = metadata.state_dict_metadata
    as_parts, sharded = fused_parts.ask_as_saved(state, saved, training.mesh.device)
    rng_key = f"rng/rank{dist.get_rank()}"
    renamed = optimizer_keys.match_saved(
        state, metadata.state_dict_metadata, training.runner.local_state_dict()
    )
    state = {
        key: value
        for key, value in state.items()
        if not key.startswith(("optim/", SETTINGS, "rng/", LOSS_SCALE))
        or key in metadata.state_dict_metadata
    }
    _check_fits(state, metadata, path)
    dcp.load(state, storage_reader=FileSystemReader(path))
    for saved_key, key in renamed.items():
        state[key] = state.pop(saved_key)
    for key, (dim, count, _) in as_parts.items():
        pieces = [state.pop(name) for name in fused_parts.keys(key, dim, count)]
        state[key] = fused_parts.assembled(pieces, dim)
        if key in sharded:
            state[key] = fused_parts.placed_like(state[key], sharded[key])
    with torch.no_grad():
        for key, live in _live_tensors(training):
            loaded = state.get(key)
            if not isinstance(loaded, torch.Tensor) or _same_memory(loaded, live):  # read in place
                continue
            # read whole: a fused tensor saved whole or split otherwise, an expert split over
            # ep too (`_placed` made it whole over tp)
            blocks = key in as_parts and as_parts[key][2]  # this rank's blocks of each part
            split_here = key in experts or not isinstance(loaded, DTensor)
            whole = key in layouts and not blocks and split_here
            value = local_tensor(loaded)
            if whole:
                dim, parts = layouts[key]
                group = training.mesh.group("tp")
                rank, size = dist.get_rank(group), dist.get_world_size(group)
                value = tp_tensor.local_shard(value, dim, parts, rank, size)
            _copy_into(live, value)
    if SETTINGS in state and training.optimizer is not None:
        optimizer_settings.restore(training.optimizer, state[SETTINGS])
    progress = state["progress"]
    training.steps = progress["steps"]
    training.data_position = dict(progress["data_position"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    scale = training.precision.loss_scale if training.precision is not None else None
    if LOSS_SCALE in state and scale is not None:
        value, clean_steps = state[LOSS_SCALE].tolist()
        scale.load_state_dict({"scale": value, "clean_steps": clean_steps})
    return path


def resolve(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint folder `directory` names: itself, or the one its `latest` points to."""
    root = Path(directory)
    if (root / ".metadata").exists():
        return root
    pointer = root / LATEST
    if not pointer.exists():
        raise CheckpointError(
            f"no checkpoint in {root}: neither {root / '.metadata'} nor {pointer} exists; "
            "save one with engine.save(directory) or check the path"
        )
    path = root / pointer.read_text().strip()
    if not (path / ".metadata").exists():
        raise CheckpointError(
            f"{pointer} points to {path}, which has no .metadata: the checkpoint is incomplete "
            "or was removed; delete the pointer to fall back to an explicit step folder"
        )
    return path


def load_full_state_dict(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The unsplit model state from a checkpoint, in this process, with no process group."""
    path = resolve(directory)
    metadata = _metadata(path)
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model/") and isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process" is what we ask for
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    except Exception as error:
        raise CheckpointError(f"cannot read the checkpoint {path}: {error}") from error
    return {key.removeprefix("model/"): value for key, value in fused_parts.joined(state).items()}


def _fresh_name(root: Path, steps: int) -> str:
    name, suffix = f"step-{steps:08d}", 1
    while (root / name).exists():
        name, suffix = f"step-{steps:08d}-{suffix}", suffix + 1
    shutil.rmtree(root / f"{name}.partial", ignore_errors=True)  # a save that died midway
    return name


def _prune(root: Path, keep: str) -> None:
    complete = sorted(
        (p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial")),
        key=lambda p: p.stat().st_mtime,
    )
    for old in complete[:-KEEP]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def _metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(
            f"cannot read the checkpoint metadata in {path}: {type(error).__name__}: {error}; "
            "the checkpoint is corrupt, load an earlier step folder"
        ) from error


def _expert_keys(training: Training) -> set[str]:
    """Checkpoint keys of the experts split over ep: their parameters and the optimizer
    state shaped like them."""
    if training.expert_group is None:
        return set()
    shapes = {name: t.shape for name, t in training.runner.local_state_dict().items()}
    return {
        key
        for key, live in _live_tensors(training)
        if (name := key.split("/", 2)[1]) in training.expert_names and live.shape == shapes[name]
    }


def _layouts(training: Training) -> dict[str, tuple[int, int]]:
    """Checkpoint key -> (dim, parts) of every tp-split model or optimizer tensor here."""
    layouts = training.layouts
    shapes = {name: t.shape for name, t in training.runner.local_state_dict().items()}
    found = {}
    for key, live in _live_tensors(training):
        name = key.split("/", 2)[1]
        # optimizer state shaped like its parameter (momenta) is split the same way
        if name in layouts and live.shape == shapes[name]:
            found[key] = layouts[name]
    return found


def _placed(
    tensor: torch.Tensor, layout: tuple[int, int] | None, training: Training, *, expert: bool
) -> Any:
    """A tp shard as DCP should see it: a DTensor over tp (contiguous blocks), over dp x tp
    where ZeRO 2/3 shards it again, an expert gathered whole over tp (`_state` shards it over
    ep instead), or the tensor itself. (A fused tensor goes as its parts: `_state`.)"""
    if layout is None:
        return tensor
    dim, parts = layout
    if isinstance(tensor, DTensor):  # ZeRO 2/3 shards a tp shard again over dp
        if parts == 1 and not expert:
            return _sharded_twice(tensor, dim, training)
        tensor = tensor.full_tensor()
    if parts == 1 and not expert:
        tp_mesh = training.mesh.device_mesh["tp"]
        return DTensor.from_local(tensor, tp_mesh, [Shard(dim)], run_check=False)
    return tp_tensor.unshard_tensor(tensor, dim, parts, training.mesh.group("tp"))


def _sharded_twice(shard: DTensor, dim: int, training: Training) -> DTensor:
    """A tp shard (split along `dim`) that FSDP2 splits again along dim 0 over dp, as one
    DTensor over the dp x tp mesh: each rank saves and reads its own piece, nothing is gathered
    (the whole tp shard on every dp rank is what ZeRO 3 is there to avoid). Along one dim the
    split is tp's first, then dp's within it: FSDP2's own `_StridedShard`."""
    mesh = training.mesh.device_mesh["dp", "tp"]
    tp = mesh.size(1)
    over_dp = _StridedShard(0, split_factor=tp) if dim == 0 else Shard(0)
    shape = list(shard.shape)
    shape[dim] *= tp
    whole = torch.empty(shape, device="meta")
    return DTensor.from_local(
        local_tensor(shard), mesh, [over_dp, Shard(dim)], run_check=False,
        shape=whole.shape, stride=whole.stride(),
    )  # fmt: skip


def _copy_into(live: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` into `live`; a `live` that ZeRO 2/3 shards over dp (a DTensor of the
    whole `value`'s shape) takes its own slice of it."""
    if not isinstance(live, DTensor):
        live.copy_(value)
        return
    if value.shape == live.shape:
        mesh = live.device_mesh
        whole = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
        value = whole.redistribute(mesh, live.placements).to_local()  # a slice, no messages
    live.to_local().copy_(value)


def _same_memory(loaded: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether DCP read `loaded` into `live` itself (the same tensor, or its local piece)."""
    if loaded is live:
        return True
    here, there = local_tensor(loaded), local_tensor(live)
    return here.data_ptr() == there.data_ptr() and here.shape == there.shape


def _live_tensors(training: Training) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, live tensor) for every model tensor and optimizer state tensor."""
    for name, tensor in training.runner.local_state_dict().items():
        yield f"model/{name}", tensor
    optimizer = _local_optimizer(training)
    if optimizer is None:
        return
    name_of = training.runner.parameter_names()
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optim/{name_of[param]}/{key}", value


def _split_keys(training: Training) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """The checkpoint keys of the tensors split over tp (with their layouts) and of the
    experts split over ep, worked out once for a save or a load."""
    return _layouts(training), _expert_keys(training)


def _state(
    training: Training, layouts: dict[str, tuple[int, int]], expert_keys: set[str]
) -> dict[str, Any]:
    """What DCP saves or reads: each live tensor placed as its split says, and the rest."""
    state: dict[str, Any] = {}
    for key, tensor in _live_tensors(training):
        layout = layouts.get(key)
        if layout is not None and layout[1] > 1 and key not in expert_keys:
            # a fused tensor as its parts; under ZeRO 2/3 its tp shard gathered over dp only
            shard = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            tp_mesh = training.mesh.device_mesh["tp"]
            state.update(fused_parts.as_parts(key, shard, *layout, tp_mesh))
        else:
            state[key] = _placed(tensor, layout, training, expert=key in expert_keys)
    if expert_keys:  # experts as DTensors sharded along dim 0 over ep: any ep reads them back
        group = training.expert_group
        assert group is not None
        ep_mesh = DeviceMesh.from_group(group, training.mesh.device.type)
        for key in expert_keys:
            state[key] = DTensor.from_local(state[key], ep_mesh, [Shard(0)], run_check=False)
    state[f"rng/rank{dist.get_rank()}"] = torch.get_rng_state()
    scale = training.precision.loss_scale if training.precision is not None else None
    if scale is not None:  # the same on every rank
        state[LOSS_SCALE] = torch.tensor([scale.value, scale.clean_steps], dtype=torch.float64)
    if training.optimizer is not None:
        state[SETTINGS] = optimizer_settings.settings(training.optimizer)
    state["progress"] = {"steps": training.steps, "data_position": dict(training.data_position)}
    return state


def _check_fits(state: dict[str, Any], metadata: Metadata, path: Path) -> None:
    """Refuse a checkpoint that lacks this model's tensors or holds them in other shapes."""
    saved = metadata.state_dict_metadata
    missing = [key for key in state if key.startswith("model/") and key not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} does not hold {len(missing)} tensors of this model, e.g. "
            f"{missing[:3]}; it was written for another model"
        )
    for key, value in state.items():
        item = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(item, TensorStorageMetadata):
            shape = tuple(value.shape)
            if tuple(item.size) != shape:
                raise CheckpointError(
                    f"checkpoint {path}: {key} has shape {tuple(item.size)} but this model "
                    f"needs {shape}; it was written for another model"
                )


def _local_optimizer(training: Training) -> torch.optim.Optimizer | None:
    """The optimizer that holds this rank's state (the inner one under ZeRO)."""
    optimizer = training.optimizer
    return None if optimizer is None else pools.local_optimizer(optimizer)


def _ensure_optimizer_state(training: Training) -> None:
    """Create the optimizer's state tensors (lazy in torch) for the load to fill."""
    optimizer = _local_optimizer(training)
    if optimizer is not None:
        pools.create_state(optimizer)
