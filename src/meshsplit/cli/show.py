"""Tables printed whole: a pipe, a log or CI gets every column at its natural width.

rich fits a table to the console (80 columns when it is not a terminal) and cuts headers and
cells it cannot fit ("sample…"); a report that cuts its own figures is no report.
"""

from __future__ import annotations

from typing import IO

from rich.console import Console, Group
from rich.table import Table

__all__: list[str] = []


def print_table(shown: Table | Group, file: IO[str] | None = None) -> None:
    """Print a table (or a group holding tables) with nothing cut: at its natural width when
    not on a terminal, and on a terminal too narrow for it with long cells folded."""
    console = Console(file=file)
    if not console.is_terminal:
        natural = Console(width=10_000).measure(shown).maximum
        console = Console(file=file, width=max(console.width, natural))
    parts = shown.renderables if isinstance(shown, Group) else [shown]
    for table in parts:
        for column in table.columns if isinstance(table, Table) else []:
            column.overflow = "fold"
    console.print(shown)
