"""The errors commands raise to end with a one-line message and an exit code.

Exit codes are part of the CLI's contract (scripts and CI depend on them):
0 success, 1 a connector failed (a check failed or it cannot be loaded),
2 a usage error (the command line or its inputs are wrong).
"""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "CLIError", "ConnectorFailure", "UsageError"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class CLIError(Exception):
    """End the command: print ``kvconn: error: <message>`` to stderr, exit with ``exit_code``."""

    exit_code = EXIT_FAILURE


class UsageError(CLIError):
    """What the user passed is wrong (unknown name, bad JSON, conflicting options): exit 2."""

    exit_code = EXIT_USAGE


class ConnectorFailure(CLIError):
    """A connector cannot be loaded or used: exit 1."""

    exit_code = EXIT_FAILURE
