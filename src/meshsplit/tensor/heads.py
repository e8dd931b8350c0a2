"""The per-rank ints of an attention split by heads: which to divide, by what, and when a
split by heads is impossible.

A rank holding h/tp of h query heads must see h/tp wherever the attention reads its head count
(`num_heads`, `split_size`, ...). With fewer kv heads than ranks, a multiple of them, each rank
holds one kv head that tp/g ranks share (shared_heads.py), and its query heads per kv head
shrink by as much.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__: list[str] = []

HEAD_ATTRIBUTES = (
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "split_size",
    "all_head_size",
    "n_local_heads",
    "n_local_kv_heads",
)
"""Per-rank ints an attention reads in forward: a rank holds 1/tp of each (`n_local_*`: the
heads of Meta's reference LLaMA on one model-parallel rank)."""
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_local_kv_heads")
KV_GROUPS = ("num_key_value_groups", "n_rep")
"""Query heads per kv head, as an attention reads it: fewer kv heads than ranks, it shrinks."""


def head_counts(
    model: nn.Module, modules: list[str], tp: int
) -> tuple[list[tuple[str, int]], str, int]:
    """The per-rank ints to divide with their divisors, why a split by heads is impossible
    ('' when it is not), and the kv heads tp ranks share (0: tp divides them).

    An attention module (one with a head count or `head_dim`) whose config's head count tp
    does not divide cannot split. Fewer kv heads than tp ranks, a multiple of them, are
    shared: each rank holds one, its head count 1, its query heads per kv head divided by
    the ranks sharing it.
    """
    per_rank: list[tuple[str, int]] = []
    shared = 0
    for name in modules:
        module = model.get_submodule(name)
        config = getattr(module, "config", None)
        attention = any(hasattr(module, a) for a in (*HEAD_ATTRIBUTES, "head_dim"))
        for attr in (*KV_HEADS, "num_attention_heads"):
            # the config's count, or the module's own where it has no config (Meta, torchtitan)
            value = getattr(module if config is None else config, attr, None)
            if attention and isinstance(value, int) and value % tp:
                if attr in KV_HEADS and tp % value == 0 and shared in (0, value):
                    shared = value
                    continue
                return [], f"tp={tp} does not divide {attr}={value} of '{name}'", 0
        for attr in (*HEAD_ATTRIBUTES, *KV_GROUPS):
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            divisor = _divisor(attr, value, tp, shared)
            if divisor == 1:
                continue
            if value % divisor:
                return [], f"tp={tp} does not divide {attr}={value} of '{name}'", 0
            per_rank.append((f"{name}.{attr}" if name else attr, divisor))
    return per_rank, "", shared


def _divisor(attr: str, value: int, tp: int, shared: int) -> int:
    """What a rank's `attr` is divided by: tp, but where tp ranks share `shared` kv heads, a
    kv head count becomes one and the query heads per kv head shrink by the sharing ranks."""
    if attr in KV_GROUPS:
        return tp // shared if shared else 1
    if shared and attr in KV_HEADS and value == shared:
        return value
    return tp


def divide(
    model: nn.Module, per_rank: tuple[tuple[str, int], ...]
) -> list[tuple[nn.Module, str, int]]:
    """Divide the `per_rank` ints by their divisors, in place; (module, attribute, value)
    of each as it was."""
    saved = []
    for path, divisor in per_rank:
        owner, _, attr = path.rpartition(".")
        module = model.get_submodule(owner)
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, getattr(module, attr) // divisor)
    return saved


@contextmanager
def divided(model: nn.Module, per_rank: tuple[tuple[str, int], ...]) -> Iterator[None]:
    """The `per_rank` ints divided by their divisors for the duration."""
    saved = divide(model, per_rank)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
