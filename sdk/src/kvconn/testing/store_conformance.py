"""``StoreConformance``: the store contract, checked for any :class:`~kvconn.store.BlockStore`.

Subclass it in one line in a test module, defining how to open a fresh store::

    class TestMyStore(StoreConformance):
        def make_store(self) -> BlockStore:
            return MyStore(...)

Every check says what the store did and how to fix it. Override
:meth:`make_unreachable` to also check that a store that cannot answer raises
(rather than answering "missing" or hanging), and does so within the
connector's deadline (``deadline_s``: the ``timeout_s`` the store runs under).
``kvconn validate`` runs the connector checks on top.
"""

from __future__ import annotations

import itertools
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..store import BlockStore, PartsStore, ScatterStore, StoreConfig

__all__ = ["StoreConformance"]

#: How long a call to an unreachable store may take before the check calls it hung (the store's own timeout).
HUNG_AFTER_S = 30.0


class StoreConformance:
    """Base class of a store's conformance tests (pytest collects the ``test_*`` methods)."""

    #: bytes per test value
    value_size = 4096
    #: The connector's deadline of one store call (``timeout_s`` of the config the store runs under): a call on
    #: an unreachable store must raise sooner, so that its own timeout (a socket's, a lock's), not the deadline,
    #: ends it and frees the store thread.
    deadline_s: float = StoreConfig().timeout_s

    def make_store(self) -> BlockStore:
        raise NotImplementedError("define make_store(self) -> BlockStore in your StoreConformance subclass")

    def make_unreachable(self, store: BlockStore) -> None:
        """Make ``store``, holding values already, unable to answer; the default skips the error checks.

        Stop its server, close its connection or point its client where nothing answers: afterwards every
        ``contains``, ``put`` and ``get`` on ``store`` must raise within :attr:`deadline_s`. Whatever it
        changes is the test's: ``store.close()`` still follows (it may raise nothing or anything).
        """
        pytest.skip("define make_unreachable(self, store) to check how the store fails (errors and timeouts)")

    #: An empty directory of the running test's own, removed after it (``tmp_path`` without pytest's
    #: kept base directories): where a store in files keeps them, so that a test run leaves nothing behind.
    directory: Path

    @pytest.fixture(autouse=True)
    def _kvconn_directory(self) -> Iterator[None]:
        with tempfile.TemporaryDirectory(prefix="kvconn-store-") as directory:
            self.directory = Path(directory)
            yield

    @pytest.fixture
    def store(self) -> Iterator[BlockStore]:
        store = self.make_store()
        yield store
        store.close()

    def keys(self, n: int) -> list[bytes]:
        run = uuid.uuid4().hex.encode()
        return [b"kvconn-conformance/" + run + b"/%d" % i for i in range(n)]

    def values(self, n: int, fill: int = 0) -> list[bytes]:
        return [bytes([(fill + i) % 256]) * self.value_size for i in range(n)]

    def read(self, store: BlockStore, keys: list[bytes]) -> tuple[list[int | None], list[bytes]]:
        buffers = [bytearray(self.value_size) for _ in keys]
        lengths = list(store.get(keys, [memoryview(b) for b in buffers]))
        return lengths, [bytes(b) for b in buffers]

    def test_missing_keys_are_missing(self, store: BlockStore) -> None:
        keys = self.keys(3)
        assert list(store.contains(keys)) == [False] * 3, "contains() must answer False for keys never put"
        lengths, _ = self.read(store, keys)
        assert lengths == [None] * 3, "get() must answer None (not 0, not raise) for a key that holds nothing"

    def test_put_then_contains_and_get(self, store: BlockStore) -> None:
        keys, values = self.keys(4), self.values(4)
        assert list(store.put(keys, values)) == [True] * 4, "put() must answer True per key it stored"
        assert list(store.contains(keys)) == [True] * 4, "contains() must see every key put() stored"
        lengths, read = self.read(store, keys)
        assert lengths == [self.value_size] * 4, "get() must answer each value's length in bytes"
        assert read == values, "get() must copy each value into its own buffer, in key order"

    def test_partial_batches_answer_per_key_in_order(self, store: BlockStore) -> None:
        keys, values = self.keys(5), self.values(5)
        store.put(keys[1::2], values[1::2])
        assert list(store.contains(keys)) == [False, True, False, True, False], (
            "contains() must answer per key, in the order asked, for a batch mixing stored and missing keys"
        )
        lengths, read = self.read(store, keys)
        assert lengths == [None, self.value_size, None, self.value_size, None], "get() must answer per key, in order"
        assert read[1::2] == values[1::2], "get() must fill the buffers of the stored keys of a mixed batch"

    def test_put_is_write_once(self, store: BlockStore) -> None:
        keys = self.keys(2)
        store.put(keys[:1], self.values(1, fill=1))
        answers = list(store.put(keys, self.values(2, fill=7)))
        assert answers == [True, True], "put() must answer True for a key that already holds a value"
        _, read = self.read(store, keys)
        assert read[0] == self.values(1, fill=1)[0], (
            "put() must keep the first value of a key (write-once): readers may be verifying it right now"
        )

    def test_a_short_buffer_gets_the_length_and_a_prefix(self, store: BlockStore) -> None:
        keys, values = self.keys(1), self.values(1, fill=3)
        store.put(keys, values)
        buffer = bytearray(self.value_size // 2)
        lengths = list(store.get(keys, [memoryview(buffer)]))
        assert lengths == [self.value_size], "get() must answer the value's full length even if the buffer is shorter"
        assert bytes(buffer) == values[0][: len(buffer)], "get() must write only what fits the buffer"

    def test_put_parts_stores_what_put_would(self, store: BlockStore) -> None:
        """Only for a :class:`~kvconn.store.PartsStore` (optional): what saves in place rely on."""
        if not isinstance(store, PartsStore):
            pytest.skip("not a PartsStore (put_parts is optional): saves go through staging")
        keys, first = self.keys(4), self.values(1, fill=1)
        values = [bytes((i + j) % 251 for j in range(self.value_size)) for i in range(4)]  # every byte placed
        store.put(keys[1:2], first)
        cuts = (0, 64, 64 + self.value_size // 3, self.value_size)  # a header, then pieces of uneven sizes
        parts = [[memoryview(bytearray(v))[a:b] for a, b in itertools.pairwise(cuts)] for v in values[1:]]
        assert list(store.put_parts(keys[1:], parts)) == [True] * 3, (
            "put_parts() must answer True per key that holds a value afterwards, as put() does"
        )
        assert list(store.contains(keys)) == [False, True, True, True], (
            "put_parts() must store exactly the keys of its batch"
        )
        lengths, read = self.read(store, keys)
        assert read[1] == first[0], "put_parts() must keep the first value of a key (write-once), as put() does"
        assert lengths[2:] == [self.value_size] * 2 and read[2:] == values[2:], (
            "put_parts() must store each value as the concatenation of its parts, in order (the same bytes as "
            "put() of the joined value): send every part whole, none skipped or reordered"
        )

    def test_get_parts_reads_across_parts_and_answers_lengths(self, store: BlockStore) -> None:
        """Only for a :class:`~kvconn.store.ScatterStore` (optional): what async loads in place rely on."""
        if not isinstance(store, ScatterStore):
            pytest.skip("not a ScatterStore (get_parts is optional): async loads go through staging")
        keys, values = self.keys(3), self.values(3, fill=5)
        store.put(keys[:2], values[:2])
        sizes = (self.value_size // 4, self.value_size // 2, self.value_size // 4)
        parts = [[bytearray(n) for n in sizes] for _ in keys]
        lengths = list(store.get_parts(keys, [[memoryview(b) for b in p] for p in parts]))
        assert lengths == [self.value_size, self.value_size, None], (
            "get_parts() must answer each value's length, and None for a key that holds nothing"
        )
        assert [b"".join(p) for p in parts[:2]] == values[:2], "get_parts() must write each value across its parts"
        other = memoryview(bytearray(self.value_size // 2))  # parts of another total size than the value
        assert list(store.get_parts(keys[:1], [[other]])) == [self.value_size], (
            "get_parts() into parts of another total size must answer the value's length (the caller refuses it), "
            "not raise or answer None"
        )

    def test_empty_batches(self, store: BlockStore) -> None:
        assert list(store.contains([])) == [], "contains([]) must answer []"
        assert list(store.put([], [])) == [], "put([], []) must answer []"
        assert list(store.get([], [])) == [], "get([], []) must answer []"

    def test_concurrent_callers(self, store: BlockStore) -> None:
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                keys, values = self.keys(8), self.values(8, fill=worker)
                store.put(keys, values)
                lengths, read = self.read(store, keys)
                assert read == values and lengths == [self.value_size] * 8
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"calls from several threads at once must not interfere: {errors[0]!r}"

    def test_an_unreachable_store_raises_in_bounded_time(self, store: BlockStore) -> None:
        keys = self.keys(2)
        store.put(keys, self.values(2))
        self.make_unreachable(store)
        for name, call in (
            ("contains", lambda: store.contains(keys)),
            ("put", lambda: store.put(self.keys(1), self.values(1))),
            ("get", lambda: self.read(store, keys)),
        ):
            outcome: list[object] = []
            thread = threading.Thread(target=_catch, args=(call, outcome), daemon=True)
            started = time.monotonic()
            thread.start()
            thread.join(HUNG_AFTER_S)
            took = time.monotonic() - started
            assert outcome, f"{name}() on an unreachable store hung: give the client a socket/operation timeout"
            assert isinstance(outcome[0], Exception), (
                f"{name}() on an unreachable store answered {outcome[0]!r}: it must raise (the connector then "
                "degrades); answering 'missing' hides an outage"
            )
            assert took < self.deadline_s, (
                f"{name}() on an unreachable store raised after {took:.2f} s, past the connector's deadline "
                f"(deadline_s = timeout_s = {self.deadline_s} s): give the client a timeout shorter than timeout_s "
                "(a call past the deadline keeps a store thread until its own timeout ends it)"
            )


def _catch(call: Callable[[], object], outcome: list[object]) -> None:
    try:
        outcome.append(call())
    except Exception as exc:
        outcome.append(exc)
