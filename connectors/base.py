"""The page-store interface every kvconnect store implements.

A *page* is the KV of ``page_size`` tokens of one key space. In host memory a page is
one or more contiguous segments, each an ``(address, nbytes)`` pair: exactly what
SGLang's ``host_pool.get_page_buffer_meta()`` and LMCache's memory objects hand out.
Stores move bytes between those segments and their backing medium, without an
intermediate copy wherever the medium allows it.

Two layers (object_store's "contract" split):

* ``PageStore`` public methods (``exists``, ``get_into``, ``put_from``, ``delete``,
  ``clear``, ``stats``, ``close``) are written once here: argument checks, batching
  contract, counters, closed-store checks.
* A store implements the ``_exists`` / ``_get_into`` / ``_put_from`` / ``_delete`` /
  ``_clear`` primitives (and optionally ``_register_memory``).

Contract for every store:
  * every call is batched and thread-safe; results keep the order of ``keys``;
  * ``get_into`` returns False for a page it did not fill completely and correctly:
    a read never yields another key's bytes or a torn page (validate, then report a miss);
  * ``put_from`` is idempotent: a key already present is not rewritten and reports True;
    a write becomes visible only once all its bytes landed;
  * a failed or timed-out backend call is a miss / failed write, not a hang.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, Sequence

Segment = tuple[int, int]
"""``(address, nbytes)`` of one contiguous host-memory region."""

Page = Sequence[Segment]
"""A page: its segments, in byte order."""


# ---------------------------------------------------------------------------------
# Errors: one hierarchy, carrying context. Data-path outcomes (hits, misses, failed
# writes) are values; exceptions are for misuse, configuration and lifecycle.
# ---------------------------------------------------------------------------------


class KVStoreError(Exception):
    """Base of every error kvconnect raises."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, unknown or invalid.

    The message always names the key and, where there is a closed set, the accepted values.
    """

    def __init__(self, key: str, problem: str, accepted: Iterable[str] | str | None = None,
                 where: str | None = None):
        self.key = key
        self.problem = problem
        self.where = where
        if accepted is not None and not isinstance(accepted, str):
            accepted = ", ".join(repr(a) for a in accepted)
        self.accepted = accepted
        msg = f"{where + ': ' if where else ''}config key {key!r}: {problem}"
        if accepted:
            msg += f" (accepted: {accepted})"
        super().__init__(msg)


class UnknownConfigKey(ConfigError):
    """A key that the store does not know (never silently dropped)."""

    def __init__(self, key: str, accepted: Iterable[str], where: str | None = None):
        super().__init__(key, "unknown key", sorted(accepted), where)


class UnknownStore(ConfigError):
    """A store name that is not registered."""

    def __init__(self, name: str, accepted: Iterable[str]):
        super().__init__("store", f"unknown store {name!r}", sorted(accepted))
        self.name = name


class MissingDependency(KVStoreError, ImportError):
    """An optional dependency of a store is not installed; names the extra to install."""

    def __init__(self, store: str, extra: str | None, cause: BaseException | None = None):
        self.store = store
        self.extra = extra
        hint = f'pip install "kvconnect[{extra}]"' if extra else "install its dependencies"
        detail = f" ({cause})" if cause else ""
        super().__init__(f"store {store!r} cannot be loaded{detail}: {hint}")


class Unsupported(KVStoreError, NotImplementedError):
    """An operation, layout or capability a store or adapter does not support."""

    def __init__(self, operation: str, adapter: str, accepted: Iterable[str] | None = None):
        self.operation = operation
        self.adapter = adapter
        msg = f"{adapter}: {operation} is not supported"
        if accepted is not None:
            msg += f" (supported: {', '.join(repr(a) for a in accepted)})"
        super().__init__(msg)


class BackendUnavailable(KVStoreError, ConnectionError):
    """The store's backend (service, master, peer) cannot be reached."""

    def __init__(self, store: str, detail: str):
        self.store = store
        super().__init__(f"{store}: backend unavailable: {detail}")


class StoreClosed(KVStoreError, RuntimeError):
    """The store was closed."""


class NotFound(KVStoreError, KeyError):
    """A key is not present (raised only by convenience APIs; the data path returns misses)."""


class PageSizeMismatch(KVStoreError, ValueError):
    """The caller's page and the stored page differ in size."""


# ---------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------


@dataclass
class StoreStats:
    """Counters every store keeps; stores may add ``extra`` figures of their own."""

    store: str = ""
    exists_calls: int = 0
    exists_keys: int = 0
    exists_hits: int = 0
    get_calls: int = 0
    get_pages: int = 0
    get_hits: int = 0
    get_bytes: int = 0
    put_calls: int = 0
    put_pages: int = 0
    put_written: int = 0
    put_failed: int = 0
    put_bytes: int = 0
    deletes: int = 0
    errors: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    keys: int | None = None
    bytes_used: int | None = None
    capacity_bytes: int | None = None
    evictions: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StoreUsage:
    """What a store reports about its contents (filled by ``PageStore._usage``)."""

    keys: int | None = None
    bytes_used: int | None = None
    capacity_bytes: int | None = None
    evictions: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def page_nbytes(page: Page) -> int:
    return sum(n for _, n in page)


# ---------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------


class PageStore(ABC):
    """A batched, thread-safe store of KV pages addressed by string keys.

    Subclasses set ``name`` (the registry name) and ``config_class`` (a
    ``kvconnect.connectors.config.StoreConfig`` dataclass) and implement the underscore primitives.
    Build stores with ``kvconnect.connectors.registry.create_store(name, options)``.
    """

    name: ClassVar[str] = "abstract"
    config_class: ClassVar[type] = type(None)
    zero_copy: ClassVar[bool] = False
    """True when the store moves bytes straight between caller memory and its medium."""
    needs_registered_memory: ClassVar[bool] = False
    """True when ``register_memory`` must cover caller pages before zero-copy I/O."""

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = StoreStats(store=self.name)
        self._closed = False

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **context: Any) -> "PageStore":
        """Build from a plain options mapping (JSON), validated by ``config_class``."""
        from kvconnect.connectors.config import parse_config

        config = parse_config(cls.config_class, options or {}, where=f"store {cls.name!r}")
        return cls(config, **cls._accepted_context(context))  # type: ignore[call-arg]

    @classmethod
    def _accepted_context(cls, context: Mapping[str, Any]) -> dict[str, Any]:
        """The engine facts (rank, pool, ...) this store's constructor takes.

        Adapters pass the same context to every store; a store that has no use for a fact
        (the in-process store and the rank, say) simply does not declare it.
        """
        import inspect

        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(context)
        return {k: v for k, v in context.items() if k in params}

    # -- public API (final) -------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether a complete page is stored (LRU order untouched)."""
        self._check_open()
        keys = list(keys)
        if not keys:
            return []
        result = self._checked("exists", keys, self._exists(keys))
        hits = sum(result)
        with self._stats_lock:
            s = self._stats
            s.exists_calls += 1
            s.exists_keys += len(keys)
            s.exists_hits += hits
        return result

    def get_into(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Fill each caller page with the stored bytes of its key.

        True: the page holds exactly the bytes stored under the key. False: a miss (absent,
        evicted, overwritten during the read, size mismatch, backend error); the caller must
        treat that page's memory as garbage.
        """
        self._check_open()
        keys, pages = self._check_batch(keys, pages)
        if not keys:
            return []
        t0 = time.perf_counter()
        result = self._checked("get_into", keys, self._get_into(keys, pages))
        dt = time.perf_counter() - t0
        nbytes = sum(page_nbytes(p) for p, ok in zip(pages, result) if ok)
        with self._stats_lock:
            s = self._stats
            s.get_calls += 1
            s.get_pages += len(keys)
            s.get_hits += sum(result)
            s.get_bytes += nbytes
            s.get_seconds += dt
        return result

    def put_from(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Store each caller page under its key. Idempotent: a present key reports True."""
        self._check_open()
        keys, pages = self._check_batch(keys, pages)
        if not keys:
            return []
        t0 = time.perf_counter()
        result = self._checked("put_from", keys, self._put_from(keys, pages))
        dt = time.perf_counter() - t0
        nbytes = sum(page_nbytes(p) for p, ok in zip(pages, result) if ok)
        with self._stats_lock:
            s = self._stats
            s.put_calls += 1
            s.put_pages += len(keys)
            s.put_written += sum(result)
            s.put_failed += len(keys) - sum(result)
            s.put_bytes += nbytes
            s.put_seconds += dt
        return result

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; True where a key was present."""
        self._check_open()
        keys = list(keys)
        if not keys:
            return []
        result = self._checked("delete", keys, self._delete(keys))
        with self._stats_lock:
            self._stats.deletes += sum(result)
        return result

    def clear(self) -> None:
        """Remove every key this store instance can reach."""
        self._check_open()
        self._clear()

    def register_memory(self, address: int, nbytes: int) -> None:
        """Declare caller memory that pages will live in (needed by RDMA / Mooncake)."""
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"register_memory: nbytes must be > 0, got {nbytes}")
        self._register_memory(address, nbytes)

    def stats(self) -> StoreStats:
        with self._stats_lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items()})
        usage = self._usage()
        snap.keys = usage.keys
        snap.bytes_used = usage.bytes_used
        snap.capacity_bytes = usage.capacity_bytes
        snap.evictions = usage.evictions
        snap.extra = dict(usage.extra)
        return snap

    def close(self) -> None:
        """Release resources. Idempotent; later calls raise ``StoreClosed``."""
        if self._closed:
            return
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def record_error(self, n: int = 1) -> None:
        """Count backend errors that a store turned into misses."""
        with self._stats_lock:
            self._stats.errors += n

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}{' closed' if self._closed else ''}>"

    # -- primitives (to implement) -------------------------------------------------
    @abstractmethod
    def _exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]: ...

    @abstractmethod
    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]: ...

    @abstractmethod
    def _delete(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def _clear(self) -> None: ...

    def _register_memory(self, address: int, nbytes: int) -> None:
        """Default: nothing to register."""

    def _usage(self) -> StoreUsage:
        return StoreUsage()

    def _close(self) -> None:
        """Default: nothing to release."""

    # -- helpers -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.name!r} is closed")

    @staticmethod
    def _check_batch(keys: Sequence[str], pages: Sequence[Page]) -> tuple[list[str], list[Page]]:
        keys = list(keys)
        pages = list(pages)
        if len(keys) != len(pages):
            raise ValueError(f"got {len(keys)} keys but {len(pages)} pages")
        for p in pages:
            if not p:
                raise ValueError("a page needs at least one (address, nbytes) segment")
        return keys, pages

    def _checked(self, op: str, keys: list[str], result: Sequence[bool]) -> list[bool]:
        result = [bool(r) for r in result]
        if len(result) != len(keys):
            raise RuntimeError(
                f"{type(self).__name__}.{op} returned {len(result)} results for {len(keys)} keys"
            )
        return result
