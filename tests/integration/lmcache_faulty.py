"""Failing ``PageStore``s for the LMCache L2 adapter tests, importable by an ``lmcache
server`` subprocess (``"store": "tests.integration.lmcache_faulty:RaisingStore"``).

They stand in for a backend that breaks in ways a real one does (every call raising, a
call that never comes back); the dead-service case uses the real HF3FS metadata service,
killed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvconnect.connectors.base import BackendUnavailable, Page, PageStore
from kvconnect.connectors.config import StoreConfig, field_doc
from kvconnect.connectors.memory import MemoryStore


@dataclass(frozen=True)
class FaultyConfig(StoreConfig):
    hang_s: float = field(default=30.0, metadata=field_doc("how long HangingStore.exists blocks"))


class RaisingStore(PageStore):
    """Every data-path call raises, as a client whose backend is gone might."""

    name = "raising"
    config_class = FaultyConfig

    def __init__(self, config: FaultyConfig | None = None):
        super().__init__()
        self.config = config or FaultyConfig()

    def _fail(self) -> list[bool]:
        raise BackendUnavailable(self.name, "connection refused (test double)")

    def _exists(self, keys: list[str]) -> list[bool]:
        return self._fail()

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._fail()

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._fail()

    def _delete(self, keys: list[str]) -> list[bool]:
        return self._fail()

    def _clear(self) -> None:
        self._fail()


class HangingStore(MemoryStore):
    """A memory store whose ``exists`` blocks for ``hang_s`` (a lookup that never answers in
    time); ``release()`` lets blocked calls go on."""

    name = "hanging"
    config_class = FaultyConfig  # type: ignore[assignment]

    def __init__(self, config: FaultyConfig | None = None):
        super().__init__()
        self.hang_s = (config or FaultyConfig()).hang_s
        self.released = threading.Event()
        self.calls = 0

    def _exists(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        self.released.wait(self.hang_s)
        return super()._exists(keys)

    def release(self) -> None:
        self.released.set()
