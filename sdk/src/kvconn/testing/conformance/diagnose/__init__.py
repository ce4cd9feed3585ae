"""Diagnosis: from what a run showed to the mechanism that broke it, and the fix for that mechanism.

A check knows *that* something went wrong (the tokens differ, nothing can be
scheduled, a hook raised); these helpers say *why*, in the terms of the
connector's own code: which request waits for which report and since which
answer, which frame of the connector raised and in what situation.

By what they read: a run that raised or stalled (:mod:`.errors`), loaded KV
that is wrong (:mod:`.wrong_kv`), a store whose calls failed (:mod:`.store`);
each returns a :class:`Diagnosis` (:mod:`.diagnosis`).

Read by: the checks, the runs and the drivers (which pass what they observed).
Public to the suite, not to authors: ``__all__`` below. Below the scenarios and
the drivers in the ``kvconn.testing.conformance`` layers contract: a diagnosis
reads a run's records, it never drives one.
"""

from __future__ import annotations

from .diagnosis import Diagnosis
from .errors import HOOK_BUDGET_FIX, Awaited, Stalled, WaitsReporter, connector_frame, diagnose_error, stall
from .store import WarningLog, capture_warnings, lost_saves, store_refusals, store_trouble
from .wrong_kv import RANK_KEY_FIX, explain_wrong_kv, shifted_pairing, transfer_kind

__all__ = [
    "HOOK_BUDGET_FIX",
    "RANK_KEY_FIX",
    "Awaited",
    "Diagnosis",
    "Stalled",
    "WaitsReporter",
    "WarningLog",
    "capture_warnings",
    "connector_frame",
    "diagnose_error",
    "explain_wrong_kv",
    "shifted_pairing",
    "stall",
    "lost_saves",
    "store_refusals",
    "store_trouble",
    "transfer_kind",
]
