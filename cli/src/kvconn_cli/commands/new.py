"""``kvconn new NAME``: scaffold a connector plugin distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["new", "register"]


def new(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="The connector's name (a lowercase slug such as 'mystore').")
    ],
    directory: Annotated[
        Path | None,
        typer.Option("--dir", metavar="DIR", help="Where to create it (default: ./kvconn-NAME). Must be new or empty."),
    ] = None,
    hooks: Annotated[
        bool,
        typer.Option(
            "--hooks", help="Generate a raw-hook connector (scheduler and worker sides) instead of a store connector."
        ),
    ] = False,
) -> None:
    """Create a connector plugin: pyproject with the entry point, connector, README and conformance test.

    By default the connector is a kvconn.store store connector (write the store's four batched calls);
    --hooks writes the raw-hook template. As generated it installs with pip and passes `kvconn validate NAME`.
    """
    import kvconn
    from kvconn.install import pip_install

    from ..output import note, warn
    from ..scaffold import Scaffold, write

    scaffold = Scaffold.for_name(name, hooks=hooks)
    target = directory if directory is not None else Path.cwd() / scaffold.distribution
    if name in kvconn.available_connectors():
        warn(f"a connector named {name!r} is already installed; installing this one too would shadow or be shadowed")
    written = write(scaffold, target)
    # What was written and what to do next is for people: stderr (stdout stays empty).
    note(f"Created {scaffold.distribution} in {target}:")
    for path in written:
        note(f"  {path.relative_to(target)}")
    where = target.resolve()  # the commands work from any directory
    note(f"\nNext (kvconn-sdk must be installed in this environment):\n  {pip_install('-e', str(where))}")
    note(f"  kvconn validate {name}\n  pytest {where / 'tests'}")


def register(app: typer.Typer) -> None:
    app.command("new")(new)
