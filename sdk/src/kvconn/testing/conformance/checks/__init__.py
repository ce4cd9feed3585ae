"""The checks, grouped by what they look at; importing this package registers them.

Only checks live here: the runs they read are :mod:`..scenarios` and :mod:`..runs`,
and ``docs/checks.md`` lists every check by id.

Read by: nobody by name; the suite's ``__init__`` imports it so that every
check is in the registry (:mod:`..catalog`) before anyone lists them. A new
check takes the next free ``KV0xx`` id and a section in ``docs/checks.md``; the
checks sit above the runs and the session in the
``kvconn.testing.conformance`` layers contract, below the runner.
"""

from __future__ import annotations

from . import data, lifecycle, packaging, recovery, store, tables, wire

__all__ = ["data", "lifecycle", "packaging", "recovery", "store", "tables", "wire"]
