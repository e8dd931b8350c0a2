"""PlanError and the plan values shared by its checks (sizes, divisors), below `Plan`."""

from __future__ import annotations

import re

__all__ = ["PlanError"]

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


class PlanError(ValueError):
    """A plan that cannot work; the message names the field, the values and a fix."""


def divisors(n: int) -> list[int]:
    """The sizes that divide n evenly, for error messages that list what would work."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_bytes(value: str | int, field_name: str) -> int:
    """'2GiB', '1.5 GB', '512MiB' or an int -> bytes; anything else is a PlanError."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), "B"
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match is None:
            raise PlanError(f"{field_name}={value!r} is not a size; write e.g. '2GiB' or '512MB'")
        number, unit = float(match.group(1)), match.group(2) or "B"
    else:
        raise PlanError(f"{field_name}={value!r} is not a size; write e.g. '2GiB' or '512MB'")
    if unit not in UNITS:
        raise PlanError(
            f"{field_name}={value!r} has the unknown unit {unit!r}; use one of "
            f"{', '.join(UNITS)}, e.g. '2GiB'"
        )
    size = int(number * UNITS[unit])
    if size <= 0:
        raise PlanError(f"{field_name}={value!r} must be positive; e.g. '2GiB'")
    return size
