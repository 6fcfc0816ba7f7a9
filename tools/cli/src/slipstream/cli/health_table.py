"""The health table `up` and `demo` print: one row per process (name, pid, url, health).

Log paths are left out of the table (they all sit in `<run dir>/logs/<name>.log`; the commands
say so once) so the table fits an 80-column terminal. Kept apart from libs/stack
(`slipstream.stack.local`) so the Python API does not import rich.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.table import Table


def _style(health: str) -> str:
    if health in ("ready", "up") or health.startswith("up "):
        return "green"
    return "red" if health.startswith(("exited", "unreachable", "gave up")) else "yellow"


def health_table(rows: Iterable[Mapping[str, Any]], title: str = "slipstream stack") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("url", no_wrap=True)
    table.add_column("health")
    for row in rows:
        health = str(row["health"])
        style = _style(health)
        table.add_row(
            str(row["name"]),
            "-" if row.get("pid") is None else str(row["pid"]),
            str(row["url"]),
            f"[{style}]{health}[/{style}]",
        )
    return table
