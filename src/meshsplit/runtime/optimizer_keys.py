"""Which of this rank's optimizer state a checkpoint holds: found under another name of a
tied parameter, or missing, which a load says instead of skipping it in silence (a resumed
run whose momentum starts again from zero trains differently, and nothing else shows it)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from meshsplit.mesh import local_tensor

__all__: list[str] = []


def match_saved(
    state: dict[str, Any], saved: Mapping[str, Any], names: Mapping[str, torch.Tensor]
) -> dict[str, str]:
    """Re-key, in `state`, the optimizer state of a tied parameter that the checkpoint
    (`saved`: its keys) holds under another of its `names` (a layer split once named it by its
    last); warn when it holds some of this rank's optimizer state but not all, or another
    optimizer's and none of this one's. Returns saved key -> key."""
    shared: dict[tuple[int, torch.Size], list[str]] = {}
    for name, tensor in names.items():
        if tensor.numel():  # empty tensors share no data, whatever their pointers say
            shared.setdefault((local_tensor(tensor).data_ptr(), tensor.shape), []).append(name)
    aliases = {n: others for others in shared.values() if len(others) > 1 for n in others}
    renamed = {}
    for key in [k for k in state if k.startswith("optim/") and k not in saved]:
        _, name, item = key.split("/", 2)
        found = [f"optim/{a}/{item}" for a in aliases.get(name, ())]
        saved_key = next((k for k in found if k in saved and k not in state), None)
        if saved_key is not None:
            state[saved_key] = state.pop(key)
            renamed[saved_key] = key
    wanted = [k for k in state if k.startswith("optim/")]
    missing = [k for k in wanted if k not in saved]
    if missing and len(missing) < len(wanted):
        warnings.warn(
            f"the checkpoint holds no optimizer state for {len(missing)} of this rank's "
            f"{len(wanted)} optimizer state tensors (e.g. {', '.join(missing[:3])}): those "
            "start as a fresh optimizer's",
            stacklevel=4,
        )
    elif missing and any(k.startswith("optim/") for k in saved):
        # none of ours, though the saving run's optimizer had state: another optimizer class
        # (a checkpoint saved before the first step, or by a stateless one, holds none at all)
        others = sorted(
            {k.rsplit("/", 1)[1].split("#part")[0] for k in saved if k.startswith("optim/")}
        )  # a fused tensor's state is saved part by part: one name for its parts
        warnings.warn(
            f"the checkpoint holds optimizer state ({', '.join(others[:4])}) but none of this "
            f"rank's {len(wanted)} optimizer state tensors (e.g. {', '.join(missing[:3])}): "
            "was it saved with another optimizer? This optimizer starts fresh",
            stacklevel=4,
        )
    return renamed
