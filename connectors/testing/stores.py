"""Stores for tests: a fault-injecting wrapper and a memory store shared by name.

* ``FaultyStore`` wraps any store and makes chosen operations raise or hang (object_store's
  ``ThrottledStore`` idea): a backend that dies or stops answering mid-flight. Built from
  options like every store, so a server process can load it by ``"module:Class"``
  (``RaisingStore`` and ``HangingStore`` are its two usual settings, ready to name).
* ``SharedMemoryStore``: memory stores with the same ``space`` in one process share their
  pages, standing in for a shared backend when several engine instances of a test live in
  one process.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvconnect.connectors.base import BackendUnavailable, Capability, Page, PageStore, StoreUsage
from kvconnect.connectors.config import Size, StoreConfig, field_doc
from kvconnect.connectors.memory import MemoryStore, MemoryStoreConfig

OPERATIONS = ("exists", "get_into", "put_from", "delete", "clear")  # what RaisingStore fails
FAULTABLE = OPERATIONS + ("stats",)  # "stats": its usage figures raise too (an unreachable backend)


@dataclass(frozen=True)
class FaultyStoreConfig(StoreConfig):
    inner: str = field(default="memory", metadata=field_doc("the store to wrap (registry name or module:Class)"))
    inner_options: dict = field(default_factory=dict, metadata=field_doc("its options"))
    raise_on: tuple = field(default=(), metadata=field_doc(f"operations that raise: {', '.join(FAULTABLE)}"))
    hang_on: tuple = field(default=(), metadata=field_doc("operations that first block for hang_s (or until "
                                                          "release())"))
    hang_s: float = field(default=30.0, metadata=field_doc("how long a hanging operation blocks"))
    message: str = field(default="connection refused (injected fault)", metadata=field_doc("what raising says"))
    fault_flag: str = field(default="", metadata=field_doc("faults start once this file exists (another process "
                                                           "can then turn a healthy store bad mid-run); empty: "
                                                           "from the start"))

    def __post_init__(self) -> None:
        for key in ("raise_on", "hang_on"):
            unknown = set(getattr(self, key)) - set(FAULTABLE)
            if unknown:
                raise ValueError(f"{key}: unknown operations {sorted(unknown)} (accepted: {', '.join(FAULTABLE)})")


class FaultyStore(PageStore):
    """``inner`` with injected faults; ``calls`` counts each operation, ``release()`` ends hangs."""

    name = "faulty"
    config_class = FaultyStoreConfig

    @classmethod
    def capabilities_of(cls, config: FaultyStoreConfig | None) -> frozenset[Capability]:
        """The wrapped store's."""
        from kvconnect.connectors.registry import store_class

        config = config or cls.config_class()
        inner = store_class(config.inner)
        return inner.capabilities_of(inner.config_from_options(config.inner_options))

    def supports(self, capability: Capability | str) -> bool:
        return self.inner.supports(capability)

    def __init__(self, config: FaultyStoreConfig | None = None, context: Any = None, *,
                 inner: PageStore | None = None):
        super().__init__(context)
        self.config = config or type(self).config_class()
        if inner is None:
            from kvconnect.connectors.registry import create_store

            inner = create_store(self.config.inner, self.config.inner_options)
        self.inner = inner
        self.calls: Counter = Counter()
        self.released = threading.Event()

    def _fault(self, op: str) -> None:
        self.calls[op] += 1
        if self.config.fault_flag and not os.path.exists(self.config.fault_flag):
            return
        if op in self.config.hang_on:
            self.released.wait(self.config.hang_s)
        if op in self.config.raise_on:
            raise BackendUnavailable(self.name, self.config.message)

    def release(self) -> None:
        """Let blocked and later hanging calls go on."""
        self.released.set()

    def _exists(self, keys: list[str]) -> list[bool]:
        self._fault("exists")
        return self.inner.exists(keys)

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        self._fault("get_into")
        return self.inner.get_into(keys, pages)

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        self._fault("put_from")
        return self.inner.put_from(keys, pages)

    def _delete(self, keys: list[str]) -> list[bool]:
        self._fault("delete")
        return self.inner.delete(keys)

    def _clear(self) -> None:
        self._fault("clear")
        self.inner.clear()

    def _clear_prefix(self, prefix: str) -> None:
        self._fault("clear")
        self.inner.clear_prefix(prefix)

    def _usage(self) -> StoreUsage:
        self._fault("stats")
        s = self.inner.stats()
        return StoreUsage(s.keys, s.bytes_used, s.capacity_bytes, s.evictions, dict(s.extra))

    def _register_memory(self, address: int, nbytes: int) -> None:
        self.inner.register_memory(address, nbytes)  # it claims the inner store's needs_registered_memory

    def _close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class RaisingStoreConfig(FaultyStoreConfig):
    raise_on: tuple = field(default=OPERATIONS, metadata=field_doc("operations that raise"))


class RaisingStore(FaultyStore):
    """Every data-path call raises, as a client whose backend is gone might."""

    name = "raising"
    config_class = RaisingStoreConfig


@dataclass(frozen=True)
class HangingStoreConfig(FaultyStoreConfig):
    hang_on: tuple = field(default=("exists",), metadata=field_doc("operations that block"))


class HangingStore(FaultyStore):
    """A memory store whose ``exists`` blocks for ``hang_s``: a lookup that never answers in time."""

    name = "hanging"
    config_class = HangingStoreConfig


@dataclass(frozen=True)
class SharedMemoryConfig(StoreConfig):
    space: str = field(default="default", metadata=field_doc("stores with the same space share pages"))
    capacity: Size = field(default=64 << 20, metadata=field_doc("bytes of the space (set by its first store)"))


_SPACES: dict[str, MemoryStore] = {}
_SPACES_LOCK = threading.Lock()


class SharedMemoryStore(FaultyStore):
    """Memory store instances with the same ``space`` share pages (a shared backend, in one process)."""

    name = "shared-memory"
    config_class = SharedMemoryConfig  # type: ignore[assignment]
    # shared by the instances of one process: what a test of several engine ranks in one
    # process needs from a shared store
    capabilities = frozenset({Capability.SHARED, Capability.ANY_PAGE_SIZE})

    @classmethod
    def capabilities_of(cls, config: SharedMemoryConfig | None) -> frozenset[Capability]:
        return cls.capabilities

    def supports(self, capability: Capability | str) -> bool:
        return Capability(capability) in self.capabilities

    def __init__(self, config: SharedMemoryConfig | None = None, context: Any = None):
        config = config or SharedMemoryConfig()
        with _SPACES_LOCK:
            inner = _SPACES.setdefault(config.space, MemoryStore(MemoryStoreConfig(config.capacity)))
        super().__init__(FaultyStoreConfig(), context, inner=inner)
        self.space = config.space

    def _close(self) -> None:
        """The space outlives its stores (another instance may still use it)."""


def clear_spaces() -> None:
    """Forget every ``SharedMemoryStore`` space (between tests)."""
    with _SPACES_LOCK:
        _SPACES.clear()
