"""Checkpoints that outlive the processes and the plan, on `torch.distributed.checkpoint`.

Every rank hands DCP its own part under the ORIGINAL model's names: `model/<name>` and
`optim/<name>/<key>`. A tensor split by the operator split goes in as a DTensor sharded
over tp, so DCP records its global shape and any later plan reads the slice it needs;
replicas over dp (and replicated tensors over tp) share a key and are written once; pipeline
stages hold disjoint names. A save writes `step-N.partial/`, renames it to `step-N/` once
every rank has finished, and only then moves the `latest` pointer, so an interrupted save
never touches the previous good checkpoint.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from meshsplit import tensor as tp_tensor
from meshsplit.memory import pools
from meshsplit.mesh import Mesh
from meshsplit.plan import Plan

__all__ = ["CheckpointError", "load_full_state_dict"]

LATEST = "latest"
KEEP = 2
"""Complete checkpoints kept in a directory; older ones are removed after a good save."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this model."""


class _LocalState(Protocol):
    def local_state_dict(self) -> dict[str, torch.Tensor]: ...

    def named_parameters(self) -> dict[torch.Tensor, str]: ...


class Engine(Protocol):
    """What a checkpoint reads and restores: the engine, seen from here."""

    plan: Plan
    mesh: Mesh
    steps: int
    data_position: dict[str, int]

    @property
    def runner(self) -> _LocalState: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """None before the model is split: no optimizer state exists yet."""
        ...

    def shard_layouts(self) -> dict[str, tuple[int, int]]: ...


def save(engine: Engine, directory: str | os.PathLike[str]) -> Path:
    """Write the engine's training state to `directory/step-N/` and point `latest` at it."""
    root = Path(directory)
    names: list[Any] = [None]
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        names[0] = _fresh_name(root, engine.steps)
    dist.broadcast_object_list(names, src=0)
    final = root / names[0]
    staging = root / f"{names[0]}.partial"
    dcp.save(_state(engine), checkpoint_id=staging)
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


def load(engine: Engine, directory: str | os.PathLike[str]) -> Path:
    """Restore model, optimizer, step count, RNG and data position; the plan may differ."""
    path = resolve(directory)
    metadata = _metadata(path)
    _ensure_optimizer_state(engine)
    state = _state(engine)
    rng_key = f"rng/rank{dist.get_rank()}"
    state = {
        key: value
        for key, value in state.items()
        if not (key.startswith("optim/") or key.startswith("rng/"))
        or key in metadata.state_dict_metadata
    }
    _check_fits(state, metadata, path)
    dcp.load(state, storage_reader=FileSystemReader(path))
    layouts = _layouts(engine)
    with torch.no_grad():
        for key, live in _live_tensors(engine):
            loaded = state.get(key)
            if isinstance(loaded, DTensor):
                live.copy_(loaded.to_local())
            elif key in layouts and isinstance(loaded, torch.Tensor) and loaded is not live:
                dim, parts = layouts[key]
                group = engine.mesh.group("tp")
                rank, size = dist.get_rank(group), dist.get_world_size(group)
                live.copy_(tp_tensor.local_shard(loaded, dim, parts, rank, size))
    progress = state["progress"]
    engine.steps = progress["steps"]
    engine.data_position = dict(progress["data_position"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
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
    return {key.removeprefix("model/"): value for key, value in state.items()}


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


def _layouts(engine: Engine) -> dict[str, tuple[int, int]]:
    """Checkpoint key -> (dim, parts) of every tp-split model or optimizer tensor here."""
    layouts = engine.shard_layouts()
    shapes = {name: t.shape for name, t in engine.runner.local_state_dict().items()}
    found = {}
    for key, live in _live_tensors(engine):
        name = key.split("/", 2)[1]
        # optimizer state shaped like its parameter (momenta) is split the same way
        if name in layouts and live.shape == shapes[name]:
            found[key] = layouts[name]
    return found


def _placed(tensor: torch.Tensor, layout: tuple[int, int] | None, engine: Engine) -> Any:
    """A tp shard as DCP should see it: a DTensor over tp (contiguous blocks), the whole
    tensor gathered (a fused tensor's blocks are not contiguous), or the tensor itself."""
    if layout is None:
        return tensor
    dim, parts = layout
    if parts == 1:
        tp_mesh = engine.mesh.device_mesh["tp"]
        return DTensor.from_local(tensor, tp_mesh, [Shard(dim)], run_check=False)
    return tp_tensor.unshard_tensor(tensor, dim, parts, engine.mesh.group("tp"))


def _live_tensors(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, live tensor) for every model tensor and optimizer state tensor."""
    for name, tensor in engine.runner.local_state_dict().items():
        yield f"model/{name}", tensor
    optimizer = _local_optimizer(engine)
    if optimizer is None:
        return
    name_of = engine.runner.named_parameters()
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optim/{name_of[param]}/{key}", value


def _state(engine: Engine) -> dict[str, Any]:
    layouts = _layouts(engine)
    state: dict[str, Any] = {
        key: _placed(tensor, layouts.get(key), engine) for key, tensor in _live_tensors(engine)
    }
    state[f"rng/rank{dist.get_rank()}"] = torch.get_rng_state()
    state["progress"] = {"steps": engine.steps, "data_position": dict(engine.data_position)}
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


def _local_optimizer(engine: Engine) -> torch.optim.Optimizer | None:
    """The optimizer that holds this rank's state (the inner one under ZeRO)."""
    optimizer = engine.optimizer
    return None if optimizer is None else pools.local_optimizer(optimizer)


def _ensure_optimizer_state(engine: Engine) -> None:
    """Create the optimizer's state tensors (lazy in torch) for the load to fill."""
    optimizer = _local_optimizer(engine)
    if optimizer is not None:
        pools.create_state(optimizer)
