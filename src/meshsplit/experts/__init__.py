"""The expert axis (Plan.ep): a mixture-of-experts layer's experts divided over ep ranks,
tokens dispatched to them by all-to-all (split.py, dispatch.py)."""

from __future__ import annotations

from meshsplit.experts.split import (
    ExpertGroups,
    ExpertSplit,
    dropped_tokens,
    expert_groups,
    expert_layouts,
    find_experts,
    parameters_of,
    split_experts,
    unshard_experts,
)

__all__ = [
    "ExpertGroups",
    "ExpertSplit",
    "dropped_tokens",
    "expert_groups",
    "expert_layouts",
    "find_experts",
    "parameters_of",
    "split_experts",
    "unshard_experts",
]
