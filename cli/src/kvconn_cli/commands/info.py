"""``kvconn info NAME``: a connector's description, config schema, implemented hooks and sides."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ..inspection import ConnectorDetails

__all__ = ["info", "register"]


def info(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="An installed connector name, or 'package.module:ClassName'.")
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the description as one JSON object on stdout.")
    ] = False,
) -> None:
    """Show a connector's description, its config fields (type, default, doc) and the hooks it implements."""
    import kvconn

    from ..errors import ConnectorFailure
    from ..inspection import describe
    from ..output import print_json
    from ..unregistered import not_found

    try:
        details = describe(name)
    except kvconn.ConnectorNotFoundError as exc:
        raise not_found(exc) from None
    except kvconn.ConnectorLoadError as exc:
        raise ConnectorFailure(str(exc)) from None
    if as_json:
        print_json(details.to_dict())
    else:
        _render(details)


def _render(details: ConnectorDetails) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..output import out_console, print_table

    console = out_console()
    s = details.summary
    console.print(f"[bold]{escape(s.name)}[/]  {escape(s.distribution or '?')} {escape(s.version or '')}".rstrip())
    console.print(f"entry point: {escape(s.target)}")
    console.print(
        f"roles: {', '.join(s.roles or [])}   saves: {'yes' if s.saves else 'no'}   "
        f"loads: {'yes' if s.loads else 'no'}   hook API: {s.api_version}"
    )
    if details.description:
        console.print()
        console.print(details.description, markup=False)
    console.print()
    if details.config:
        table = Table(title="config" + (f": {details.config_doc.splitlines()[0]}" if details.config_doc else ""))
        for column in ("field", "type", "default", "doc"):
            table.add_column(column, overflow="fold")
        for f in details.config:
            default = "(required)" if f.required else repr(f.default)
            constraints = ", ".join(f"{k}={v!r}" for k, v in f.constraints.items())
            doc = f"{f.doc} [{constraints}]" if constraints else f.doc
            table.add_row(escape(f.name), escape(f.type), escape(default), escape(doc))
        print_table(table)
    else:
        console.print("config: none (the connector takes no options)")
    console.print()
    console.print(f"hooks: {', '.join(details.hooks)}")
    for role, path in details.sides.items():
        lazy = " (imported only where it runs: its hooks are not listed)" if role in details.lazy_sides else ""
        console.print(f"{role} side: {path}{lazy}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("info")(info)
