"""``kvconn list``: every installed connector, what it declares, and whether it loads."""

from __future__ import annotations

import os
from typing import Annotated

import typer

__all__ = ["list_connectors", "register"]


def list_connectors(
    as_json: Annotated[bool, typer.Option("--json", help='Print {"connectors": [...]} as JSON on stdout.')] = False,
) -> None:
    """List installed connectors: distribution, entry point, roles, saves/loads, API version and status.

    A plugin that fails to import is listed as "broken: <why>"; the command still succeeds.
    KVCONN_PLUGINS / KVCONN_DISABLE_PLUGINS restrict what is listed.
    """
    from ..inspection import summarize_all
    from ..output import err_console, print_json, print_table
    from ..unregistered import warn_unregistered

    summaries = summarize_all()
    warn_unregistered()
    if as_json:
        print_json({"connectors": [s.to_dict() for s in summaries]})
        return
    if not summaries:
        filters = [f"{v}={os.environ[v]!r}" for v in ("KVCONN_PLUGINS", "KVCONN_DISABLE_PLUGINS") if v in os.environ]
        hint = f" (filtered by {', '.join(filters)})" if filters else "; create one with `kvconn new NAME`"
        err_console().print(f"No connectors installed{hint}.", markup=False)
        return

    from rich.markup import escape
    from rich.table import Table

    table = Table(title="kvconn connectors", title_justify="left")
    for column in ("name", "status", "roles", "saves", "loads", "api"):
        table.add_column(column, no_wrap=column != "status", overflow="fold")
    table.add_column("package / entry point", overflow="fold")
    for s in summaries:
        table.add_row(
            s.name,
            "[green]ok[/]" if s.ok else f"[red]{escape(s.status)}[/]",
            "\n".join(s.roles) if s.roles is not None else "-",
            _yes_no(s.saves),
            _yes_no(s.loads),
            s.api_version or "-",
            escape(f"{s.distribution or '?'} {s.version or ''}".strip() + "\n" + s.target),
        )
    print_table(table)


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def register(app: typer.Typer) -> None:
    app.command("list")(list_connectors)
