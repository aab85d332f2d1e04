"""The table a fault or operations run prints: one row a figure, its value and its target."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table


def figure_table(title: str) -> Table:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value")
    table.add_column("target", justify="right")
    return table


def print_table(table: Table) -> None:
    from rich.console import Console

    Console(width=160).print(table)
