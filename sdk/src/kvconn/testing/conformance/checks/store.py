"""A store connector's store, judged as a store before any engine runs it: the store contract.

For a connector built on :mod:`kvconn.store` the engine checks run a layer
the SDK wrote (keys, integrity, deadlines) over a store the author wrote: a
bug in the store's four calls surfaces there only as a symptom (a failed
load, nothing loaded). This check runs the store contract that
:class:`~kvconn.testing.store_conformance.StoreConformance` holds a store to,
on the plugin's own store (``open_store`` with the run's config), and names
the call that broke it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from .... import KVConnectorRole, load_connector
from ....store import BlockStore
from ..catalog import IMPORTED, check
from ..results import CheckSkipped, ConformanceFailure
from ..session import Session

#: The store's own name for a run of the contract (a config factory gives it a namespace of its own).
RUN = "store-contract"


@check(
    "KV007",
    "store-contract",
    fix="make the store's calls keep the BlockStore contract (docs/authoring.md; kvconn/store/protocol.py): "
    "batched answers per key in order, write-once put, get into the caller's buffers answering lengths",
    requires=("store",),
    after=IMPORTED,
)
def store_contract(session: Session) -> None:
    """The connector's store keeps the store contract, call by call, before any engine check runs.

    Applies to a :class:`~kvconn.store.StoreConnector`: its ``open_store``
    (from the run's config) is held to what ``StoreConformance`` checks:
    missing keys answer missing, put then contains and get, per-key answers
    in order, write-once puts, short buffers, empty batches, concurrent
    callers, and the optional in-place calls a store declares. Catches a
    ``get`` that answers another key's value or a short one, a ``put`` that
    answers True and keeps nothing, before the engine checks meet them as a
    failed or empty load.
    """
    try:
        from ...store_conformance import StoreConformance
    except ImportError as exc:  # pytest, which the store kit's skips use
        raise CheckSkipped(
            f"the store contract needs the store kit's dependencies ({exc}): pip install pytest"
        ) from None
    connector: Any = load_connector(session.connector, role=KVConnectorRole.SCHEDULER, config=session.config_for(RUN))
    suite = type("StoreContract", (StoreConformance,), {"make_store": lambda _self: connector.open_store()})()
    try:
        for name, test in _contract(suite):
            _run(suite, name, test, type(connector).__qualname__)
    finally:
        connector.side.shutdown()


def _contract(suite: Any) -> Iterator[tuple[str, Callable[[BlockStore], None]]]:
    """The store kit's checks that take a store and nothing else, in the order the kit defines them."""
    for name, member in vars(type(suite).__mro__[1]).items():
        if name.startswith("test_") and list(inspect.signature(member).parameters) == ["self", "store"]:
            yield name, getattr(suite, name)


def _run(suite: Any, name: str, test: Callable[[BlockStore], None], owner: str) -> None:
    import pytest

    store = suite.make_store()
    try:
        test(store)
    except pytest.skip.Exception:
        return  # an optional ability the store does not declare, or a failure mode it does not say how to cause
    except AssertionError as exc:
        rule = str(exc).split("\n")[0]
        raise ConformanceFailure(
            f"its store ({type(store).__name__}, from {owner}.open_store()) failed the store contract's "
            f"{name.removeprefix('test_').replace('_', ' ')!r}",
            f"{rule} (kvconn.testing.store_conformance.StoreConformance.{name} checks it alone)",
        ) from None
    except Exception as exc:
        raise ConformanceFailure(
            f"its store ({type(store).__name__}, from {owner}.open_store()) raised in "
            f"{name.removeprefix('test_').replace('_', ' ')}: {type(exc).__name__}: {exc}",
            "make the store reachable (start its server, or point the config at one) and its calls answer "
            "rather than raise for keys that simply hold nothing",
        ) from None
    finally:
        store.close()
