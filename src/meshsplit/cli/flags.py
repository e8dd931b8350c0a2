"""The Plan's command-line flags, made from the Plan itself.

Each field is a flag named after it (`micro_batches` -> `--micro-batches`), typed by its
annotation, defaulting to its default, with its docstring as the help; so a field added to
the Plan is on the command line with no edit here. NOT_FLAGS lists the exceptions.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any

from meshsplit.plan import Plan

__all__ = ["add_plan_flags", "plan_from"]

NOT_FLAGS = frozenset({"tp_plan", "ep_plan"})
"""Fields the command line does not take: tp_plan and ep_plan map module paths to splits,
which the Python API takes (Plan(tp_plan={'fc1': 'column'}))."""


PRECISION_FIELDS = ("precision", "reduce_dtype")
"""The Plan fields a command that builds its own plans (plan, compare) takes as flags:
every plan it builds has them."""


def add_plan_flags(command: argparse.ArgumentParser, fields: tuple[str, ...] | None = None) -> None:
    """One flag per Plan field (or per field in `fields`): `--dp 2 --pp 2 --stages 3 1 ...`."""
    helps, annotations = field_docstrings(), typing.get_type_hints(Plan)
    for field in dataclasses.fields(Plan):
        if field.name in NOT_FLAGS or (fields is not None and field.name not in fields):
            continue
        options = _argument(field.name, annotations[field.name])
        command.add_argument(
            "--" + field.name.replace("_", "-"),
            default=_default(field),
            help=" ".join(helps.get(field.name, "").split()).replace("%", "%%"),
            **options,
        )


def plan_from(args: argparse.Namespace) -> Plan:
    """The Plan the flags in `args` spell (lists become tuples, as the Plan stores them)."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Plan):
        if field.name not in NOT_FLAGS:
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return Plan(**values)


def field_docstrings() -> dict[str, str]:
    """Each Plan field's docstring: the string literal on the line after the field."""
    source = textwrap.dedent(inspect.getsource(Plan))
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    helps = {}
    for statement, following in zip(body, body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            helps[statement.target.id] = inspect.cleandoc(following.value.value)
    return helps


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _argument(name: str, annotation: Any) -> dict[str, Any]:
    """argparse's type, nargs or action for a field's annotation: `X | None` as X, a union
    with str as text (the Plan parses it, e.g. '2GiB'), a bool as --flag/--no-flag, a
    tuple[X, ...] as one or more X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        annotation = str if str in kinds else kinds[0] if len(kinds) == 1 else annotation
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation}
    element = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and len(element) == 2 and element[1] is Ellipsis:
        return {"type": element[0], "nargs": "+"}
    raise TypeError(
        f"Plan.{name}: {annotation} has no command-line form; add it to NOT_FLAGS in "
        "meshsplit/cli/flags.py, with the reason"
    )
