"""The request ids a run gives the engine: each scenario name with a tag unique to the run and the session.

Scenarios and data runs name their requests ``'r0'``, ``'a'``, ``'b1'``... If
every run gave the engine those very names, a connector whose state outlives a
run would meet an id it had already finished: a server keyed by request id
(LMCache's multi-process server keeps per-request state under it), in the next
run or the next ``kvconn validate``. A real engine never repeats one (vLLM
gives every request a fresh random id), so the suite must not either.

A run therefore gives the engine ``name + tag``, e.g. ``'a-3f9c1e.4'``: a
token random per session (one ``kvconn validate``, one pytest class) and the
run's number in that session. The ``-`` keeps it URL- and key-safe (a server
may put the id in a path), and sorts before every digit and letter, so sorting
ids keeps the names' order (``'a-…'`` before ``'a1-…'``, as ``'a'`` before ``'a1'``).

The tag is applied where a run adds its requests (:func:`~.scenarios.run_scenario`,
the data runs of :mod:`.runs`): drivers, and the records the checks read, carry
the engine's ids. Reports name requests as scenarios do: :meth:`RequestTags.untag`
takes every tag of the session out of a message, in one place
(:meth:`~.session.Session.run`), for every check's message, fix and diagnosis.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RequestTags", "RunTag", "untag_any"]

#: Any session's tag (:meth:`RequestTags.next_run`): ``-``, the token (3 random bytes in hex), ``.``, the run.
_ANY_TAG = re.compile(r"-[0-9a-f]{6}\.\d+")


@dataclass(frozen=True)
class RunTag:
    """One run's tag: what the engine calls the request a scenario names ``name`` (:meth:`engine_id`)."""

    suffix: str

    def engine_id(self, name: str) -> str:
        """The id the engine and the connector see for the scenario's request ``name``."""
        return name + self.suffix

    def engine_ids(self, names: Iterable[str]) -> frozenset[str]:
        """:meth:`engine_id` of each of ``names``."""
        return frozenset(map(self.engine_id, names))


class RequestTags:
    """The tags of one session's runs: a random token, and a number per run (see the module docstring)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(3)
        self._runs = itertools.count(1)
        self._tag = re.compile(rf"-{self.token}\.\d+")

    def next_run(self) -> RunTag:
        """The tag of the session's next run."""
        return RunTag(f"-{self.token}.{next(self._runs)}")

    def untag(self, text: str) -> str:
        """``text`` with each request id of this session's runs back to its name (``'a-3f9c1e.4'`` -> ``'a'``)."""
        return self._tag.sub("", text)


def untag_any(text: str) -> str:
    """``text`` with the request ids of any session's runs back to their names.

    For text gathered across sessions, where no one session's tags apply: the
    CLI's summary of what connectors and engines logged (one ``kvconn validate
    --all`` runs a session per connector). A report's own messages use
    :meth:`RequestTags.untag`, which takes out only its session's tags.
    """
    return _ANY_TAG.sub("", text)
