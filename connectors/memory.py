"""``memory``: the in-process reference store.

Thread-safe, capacity-bounded, LRU eviction. It is the conformance reference and the
demo's embedded default. Values are never mutated once published (a new buffer per write),
so a reader copying outside the lock can never see a torn page: an overwrite or eviction
swaps the dict entry, it never touches bytes a reader holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvconnect.connectors.base import Capability, Page, PageStore, StoreUsage, page_nbytes
from kvconnect.connectors.buffers import buffer_address, gather_many, scatter_many
from kvconnect.connectors.config import Size, StoreConfig, field_doc
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.errors import ConfigError

_EVICTED_KEPT = 65536  # how many evicted keys a miss can still be explained by


@dataclass(frozen=True)
class MemoryStoreConfig(StoreConfig):
    capacity: Size = field(default=1 << 30, metadata=field_doc("bytes kept before LRU eviction ('4gb' style)"))

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ConfigError("capacity", f"must be > 0, got {self.capacity}", "1..2**50 bytes ('4gb' style)",
                              "store 'memory'")


class MemoryStore(PageStore):
    """Pages in a process-local LRU dict."""

    name = "memory"
    config_class = MemoryStoreConfig
    capabilities = frozenset({Capability.ANY_PAGE_SIZE,  # one process's memory: shared with nobody
                              Capability.EVICTION_EVENTS})

    def __init__(self, config: MemoryStoreConfig | None = None, context: EngineContext | None = None):
        super().__init__(context)
        self.config = config or MemoryStoreConfig()
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, bytearray] = OrderedDict()  # never mutated once stored
        self._used = 0
        self._evictions = 0
        self._evicted: OrderedDict[str, None] = OrderedDict()  # recent victims: a miss says "evicted"

    def _exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._pages for k in keys]

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        with self._lock:
            values = []
            for k in keys:
                v = self._pages.get(k)
                if v is not None:
                    self._pages.move_to_end(k)
                values.append(v)
            evicted = sum(1 for k, v in zip(keys, values) if v is None and k in self._evicted)
        self._miss("evicted", evicted)
        out = [v is not None and len(v) == page_nbytes(page) for v, page in zip(values, pages)]
        self._miss("mismatch", sum(1 for v, o in zip(values, out) if v is not None and not o))
        scatter_many([buffer_address(v) for v, ok in zip(values, out) if ok],
                     [page for page, ok in zip(pages, out) if ok])
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        cap = self.config.capacity
        out = [False] * len(keys)
        new: list[int] = []
        with self._lock:
            for i, (k, page) in enumerate(zip(keys, pages)):
                if k in self._pages:
                    self._pages.move_to_end(k)
                    out[i] = True
                elif page_nbytes(page) <= cap:
                    new.append(i)
        # copies outside the lock, all pages of the batch at once
        datas = [bytearray(page_nbytes(pages[i])) for i in new]
        gather_many([pages[i] for i in new], [buffer_address(d) if d else 0 for d in datas])
        victims: list[str] = []
        with self._lock:
            for i, data in zip(new, datas):
                k, n = keys[i], len(data)
                out[i] = True
                if k in self._pages:  # a racing writer published first
                    continue
                while self._used + n > cap and self._pages:
                    victim, old = self._pages.popitem(last=False)
                    self._used -= len(old)
                    self._evictions += 1
                    victims.append(victim)
                    self._evicted[victim] = None
                    if len(self._evicted) > _EVICTED_KEPT:
                        self._evicted.popitem(last=False)
                self._evicted.pop(k, None)
                self._pages[k] = data
                self._used += n
        if victims:
            self._report_evicted(victims)
        return out

    def _delete(self, keys: list[str]) -> list[bool]:
        out = []
        with self._lock:
            for k in keys:
                v = self._pages.pop(k, None)
                self._evicted.pop(k, None)
                if v is not None:
                    self._used -= len(v)
                out.append(v is not None)
        return out

    def _clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._evicted.clear()
            self._used = 0

    def _clear_prefix(self, prefix: str) -> None:
        with self._lock:
            for k in [k for k in self._pages if k.startswith(prefix)]:
                self._used -= len(self._pages.pop(k))
            for k in [k for k in self._evicted if k.startswith(prefix)]:
                del self._evicted[k]

    def describe(self) -> str:
        return f"this process's memory, {self.config.capacity} bytes (LRU), shared with no other process"

    def _usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(keys=len(self._pages), bytes_used=self._used,
                              capacity_bytes=self.config.capacity, evictions=self._evictions)

    def _close(self) -> None:
        self._clear()
