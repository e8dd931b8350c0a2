"""A model's own tp plan: the `_tp_plan` that Hugging Face models carry, in meshsplit's terms.

Transformers models declare how their layers split, `*` standing for a layer index. The styles
meshsplit has a parallel layer for (`colwise`, `rowwise`, `colwise_gather_output`,
`embedding_rowwise`) map to its column, row and vocab splits; any other style falls back to
meshsplit's own rule, with a reason. Rationale: docs/internals.md#tensorhfplanpy
"""

from __future__ import annotations

import re

from torch import nn

__all__: list[str] = []

STYLES: dict[str, tuple[str, bool]] = {
    "colwise": ("column", False),
    "rowwise": ("row", False),
    "colwise_gather_output": ("column", True),
    "embedding_rowwise": ("vocab", False),
}
"""Model's plan style -> (meshsplit split, gather_output)."""


def _pattern(glob: str) -> re.Pattern[str]:
    parts = glob.split(".")
    return re.compile(".".join("[^.]+" if part == "*" else re.escape(part) for part in parts))


def model_plan(model: nn.Module) -> dict[str, str]:
    """Module name (in `model`) -> style, from the outermost module carrying a `_tp_plan`."""
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if isinstance(plan, dict) and plan:
            names = [name for name, _ in module.named_modules() if name]
            found: dict[str, str] = {}
            for glob, style in plan.items():
                pattern = _pattern(glob)
                for name in names:
                    if pattern.fullmatch(name):
                        found[f"{prefix}.{name}" if prefix else name] = str(style)
            return found
    return {}
