"""Store connectors that break the store contract, to show the SGLang checks fail them (loaded by module path)."""

from __future__ import annotations

from collections.abc import Sequence

from kvconn.store import BlockStore, StoreConfig, StoreConnector


class _OverwritingStore:
    """A dict store whose ``put`` overwrites (not write-once) and whose ``contains`` says yes to every key."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [True for _ in keys]

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        for key, value in zip(keys, values, strict=True):
            self.values[key] = bytes(value)
        return [True for _ in keys]

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        lengths: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            value = self.values.get(key)
            if value is not None:
                n = min(len(value), len(buffer))
                buffer[:n] = value[:n]
            lengths.append(None if value is None else len(value))
        return lengths

    def close(self) -> None:
        pass


class LyingConnector(StoreConnector):
    """Says every page is stored."""

    Config = StoreConfig

    def open_store(self) -> BlockStore:
        return _OverwritingStore()
