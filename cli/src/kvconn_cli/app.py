"""The ``kvconn`` typer application and its console-script entry point.

Each command lives in its own module under :mod:`kvconn_cli.commands` and
exposes ``register(app)``; adding a command is one module plus one name in
:data:`COMMAND_MODULES`. Command modules import only typer (and the CLI's
standard-library-only modules, such as :mod:`kvconn_cli.rounds` for option
defaults) at module level and everything heavy (kvconn, rich, plugins) inside
the command, so ``kvconn --help`` and ``kvconn list`` start quickly.

:func:`main` owns error presentation: a :class:`~kvconn_cli.errors.CLIError`
becomes ``kvconn: error: <one line>`` with its exit code, a usage error click
finds (unknown option, bad value) the same line with exit code 2, and any
other exception a one-line internal error — the traceback only with
``--debug`` or ``KVCONN_DEBUG=1``. ``-h`` is ``--help`` everywhere. It also
keeps stdout for the data below Python (:func:`~kvconn_cli.output.reserve_stdout`):
what plugins write to file descriptor 1 goes to stderr.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from . import __version__
from .errors import EXIT_FAILURE, CLIError
from .output import error, reserve_stdout

__all__ = ["COMMAND_MODULES", "app", "main"]

#: Modules of :mod:`kvconn_cli.commands`, in help order; each defines ``register(app: typer.Typer)``.
COMMAND_MODULES = ("listing", "info", "validate", "new", "simulate", "bench")

app = typer.Typer(
    name="kvconn",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        import kvconn

        typer.echo(f"kvconn-cli {__version__} (kvconn-sdk {kvconn.__version__}, hook API {kvconn.API_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the versions and exit.")
    ] = False,
) -> None:
    """List, inspect, validate, scaffold, simulate and benchmark kvconn KV-cache connectors."""


for _module in COMMAND_MODULES:
    importlib.import_module(f"{__package__}.commands.{_module}").register(app)


def _debug_requested(argv: Sequence[str]) -> bool:
    from .logs import debug_from_env

    return "--debug" in argv or debug_from_env()


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``kvconn`` with ``argv`` (default: ``sys.argv[1:]``); exits the process with the command's code."""
    from typer._click.exceptions import ClickException, NoArgsIsHelpError

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with reserve_stdout():
            code = typer.main.get_command(app).main(args=args, prog_name="kvconn", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `kvconn` alone: the help, on stderr (it is not the requested output)
        exc.show()
        sys.exit(exc.exit_code)
    except ClickException as exc:
        context = getattr(exc, "ctx", None)
        hint = f" (see '{context.command_path} --help')" if context is not None else ""
        error(f"{_one_line(exc.format_message())}{hint}")
        sys.exit(exc.exit_code)
    except CLIError as exc:
        error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        error("interrupted")
        sys.exit(130)
    except Exception as exc:
        if _debug_requested(args):
            raise
        error(f"internal error: {type(exc).__name__}: {exc} (rerun with KVCONN_DEBUG=1 to see the traceback)")
        sys.exit(EXIT_FAILURE)
    sys.exit(code if isinstance(code, int) else 0)


def _one_line(message: str) -> str:
    """Click's message on one line, with a lowercase start like every ``kvconn: error:``."""
    text = " ".join(message.split()).rstrip(".")
    return text[:1].lower() + text[1:]


if __name__ == "__main__":
    main()
