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

from connectors.base import Page, PageStore, StoreUsage, page_nbytes
from connectors.buffers import buffer_address, gather, scatter
from connectors.config import Size, StoreConfig, field_doc


@dataclass(frozen=True)
class MemoryStoreConfig(StoreConfig):
    capacity: Size = field(default=1 << 30, metadata=field_doc("bytes kept before LRU eviction ('4gb' style)"))

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity must be > 0")


class MemoryStore(PageStore):
    """Pages in a process-local LRU dict."""

    name = "memory"
    config_class = MemoryStoreConfig

    def __init__(self, config: MemoryStoreConfig | None = None):
        super().__init__()
        self.config = config or MemoryStoreConfig()
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, bytearray] = OrderedDict()  # never mutated once stored
        self._used = 0
        self._evictions = 0

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
        out = []
        for v, page in zip(values, pages):
            if v is None or len(v) != page_nbytes(page):
                out.append(False)
                continue
            scatter(buffer_address(v), page)
            out.append(True)
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        out = []
        cap = self.config.capacity
        for k, page in zip(keys, pages):
            with self._lock:
                if k in self._pages:
                    self._pages.move_to_end(k)
                    out.append(True)
                    continue
            n = page_nbytes(page)
            if n > cap:
                out.append(False)
                continue
            data = gather(page)  # one copy, outside the lock
            with self._lock:
                if k in self._pages:  # a racing writer published first
                    out.append(True)
                    continue
                while self._used + n > cap and self._pages:
                    _, old = self._pages.popitem(last=False)
                    self._used -= len(old)
                    self._evictions += 1
                self._pages[k] = data
                self._used += n
            out.append(True)
        return out

    def _delete(self, keys: list[str]) -> list[bool]:
        out = []
        with self._lock:
            for k in keys:
                v = self._pages.pop(k, None)
                if v is not None:
                    self._used -= len(v)
                out.append(v is not None)
        return out

    def _clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._used = 0

    def _usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(keys=len(self._pages), bytes_used=self._used,
                              capacity_bytes=self.config.capacity, evictions=self._evictions)

    def _close(self) -> None:
        self._clear()
