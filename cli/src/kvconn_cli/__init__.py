"""kvconn-cli: the ``kvconn`` command line for KV-cache connector authors and operators.

The console script is :func:`kvconn_cli.app.main`; each command lives in its
own module under :mod:`kvconn_cli.commands`.
"""

from __future__ import annotations

from .errors import CLIError, ConnectorFailure, UsageError

__version__ = "0.1.0"

__all__ = ["CLIError", "ConnectorFailure", "UsageError", "__version__"]
