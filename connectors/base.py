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
  ``_clear`` primitives (and optionally ``_clear_prefix``, ``_register_memory``), declares
  its ``capabilities`` and is built as ``Store(config, context)``: its typed config and the
  engine's ``EngineContext`` (None when no engine built it).
* Optional: a store that evicts pages in this process declares ``EVICTION_EVENTS`` and calls
  ``_report_evicted(keys)`` as it evicts; callers subscribe with ``add_eviction_listener``.

Contract for every store:
  * every call is batched and thread-safe; results keep the order of ``keys``;
  * ``get_into`` returns False for a page it did not fill completely and correctly:
    a read never yields another key's bytes or a torn page (validate, then report a miss);
  * ``put_from`` is idempotent: a key already present is not rewritten and reports True;
    a write becomes visible only once all its bytes landed;
  * a failed or timed-out backend call is a miss / failed write, not a hang.

Keys (checked here, once, for every store): a non-empty ``str``, UTF-8 encodable, without
newline or NUL, at most ``MAX_KEY_BYTES`` bytes encoded. A batch holding a key that breaks
this raises ``InvalidKey`` (naming the key and the rule) before the store is called: a bad
key is a caller's bug, not a miss, and no store may accept a key another store would refuse.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

if TYPE_CHECKING:
    from kvconnect.connectors.context import EngineContext

_log = logging.getLogger("kvconnect.store")

Segment = tuple[int, int]

MAX_KEY_BYTES = 4096
"""The longest key (UTF-8 bytes) any store takes."""


def _check_keys(keys: Sequence[str]) -> list[str]:
    """The key contract (module docstring); ``InvalidKey`` naming the first key that breaks it.

    Every lookup passes here (``batch_exists`` is on SGLang's scheduler path), so a batch of
    ASCII keys is checked at C speed in one pass over their join; anything else (and any
    batch that breaks the contract, for the message) takes the key-by-key loop."""
    keys = list(keys)
    if not keys:
        return keys
    try:
        joined = "\n".join(keys)
    except TypeError:  # a key that is not a str: the loop names it
        joined = None
    if (joined is not None and joined.isascii() and joined.count("\n") == len(keys) - 1
            and "\x00" not in joined and "" not in keys
            and (len(joined) <= MAX_KEY_BYTES or max(map(len, keys)) <= MAX_KEY_BYTES)):
        return keys
    for k in keys:
        if not isinstance(k, str):
            raise InvalidKey(f"keys are str, got {type(k).__name__} {k!r:.80}")
        if k.isascii():
            n = len(k)
        else:
            try:
                n = len(k.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidKey(f"key {k!r:.80} is not UTF-8 encodable") from None
        if not 0 < n <= MAX_KEY_BYTES:
            raise InvalidKey(f"key {k!r:.80} has {n} bytes; keys have 1..{MAX_KEY_BYTES}")
        if "\n" in k or "\x00" in k:
            raise InvalidKey(f"key {k!r:.80} holds a newline or NUL")
    return keys
"""``(address, nbytes)`` of one contiguous host-memory region."""

Page = Sequence[Segment]
"""A page: its segments, in byte order."""


# Errors live in ``errors`` (the ground floor's ground floor: config imports it too); they
# are re-exported here, where store authors look for them.
from kvconnect.connectors.errors import (  # noqa: E402,F401
    BackendUnavailable,
    ConfigError,
    InvalidKey,
    KVStoreError,
    MissingCapability,
    MissingDependency,
    NotFound,
    PageSizeMismatch,
    StoreClosed,
    UnknownConfigKey,
    UnknownStore,
    Unsupported,
)


# ---------------------------------------------------------------------------------
# Capabilities
# ---------------------------------------------------------------------------------


class Capability(str, Enum):
    """What a store can do beyond the interface, and what a caller must do for it. A store
    declares its capabilities (``capabilities``, narrowed by ``capabilities_of(config)``); an
    integration names the ones it needs and the factory refuses a store without them
    (``MissingCapability``), and asks ``supports()`` for the rest, so no integration ever asks
    which store it was given."""

    SHARED = "shared"
    """Pages one process writes, other processes (on other hosts, where the store spans
    hosts) read."""
    DURABLE = "durable"
    """Pages outlive the process that wrote them (an engine restart finds them again)."""
    DEVICE_MEMORY = "device_memory"
    """Page segments may be accelerator (GPU) memory addresses, not only host memory."""
    ZERO_COPY = "zero_copy"
    """Bytes move straight between the caller's segments and the medium, no staging copy
    (into memory registered with ``register_memory`` where the store needs that)."""
    ANY_PAGE_SIZE = "any_page_size"
    """Pages of many different sizes cost nothing extra (a store that keeps one file or
    slot table per page size lacks it: callers should keep to a few sizes)."""
    EVICTION_EVENTS = "eviction_events"
    """The store tells ``add_eviction_listener`` listeners which keys it evicted, as it
    evicts them (a store whose evictions happen in another process, unseen here, lacks it)."""
    NEEDS_REGISTERED_MEMORY = "needs_registered_memory"
    """Zero-copy I/O needs the caller's pages inside memory given to ``register_memory`` first
    (RDMA): a caller registers its pools or staging buffers once, at start. A trait callers
    read with ``supports()``, never one to require."""

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Capability.SHARED: "lets other processes read the pages one writes",
    Capability.DURABLE: "keeps pages after the process that wrote them exits",
    Capability.DEVICE_MEMORY: "reads and writes pages in accelerator (GPU) memory",
    Capability.ZERO_COPY: "moves bytes without a staging copy",
    Capability.ANY_PAGE_SIZE: "takes pages of any size at no extra cost",
    Capability.EVICTION_EVENTS: "reports the pages it evicts to listeners in this process",
    Capability.NEEDS_REGISTERED_MEMORY: "moves bytes without a copy only in memory registered with it",
}


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
    misses: dict[str, dict[str, int]] = field(default_factory=dict)
    """op (``exists``, ``get``) -> cause (``MISS_CAUSES``) -> keys that missed."""
    latency: dict[str, list[int]] = field(default_factory=dict)
    """op (``exists``, ``get``, ``put``) -> calls per ``LATENCY_BUCKETS`` bucket (+ one over the last)."""
    latency_sum: dict[str, float] = field(default_factory=dict)
    """op -> seconds spent in its calls."""
    up: bool = True
    """False while the backend is unreachable (the last call met an ``unavailable`` miss) or closed."""
    keys: int | None = None
    bytes_used: int | None = None
    capacity_bytes: int | None = None
    evictions: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MISS_CAUSES = ("not_found", "evicted", "deadline", "corrupt", "unavailable", "mismatch")
"""Why a key missed: never stored (or deleted); evicted; the call ran out of time; the bytes
failed validation (checksum, identity, lease); the backend (peer, service, master) was down;
the key exists with another layout or page size."""

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the per-call latency histograms: 100 us (a local hit) to 10 s."""


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

    Subclasses set ``name`` (the registry name), ``config_class`` (a
    ``kvconnect.connectors.config.StoreConfig`` dataclass) and ``capabilities``, take
    ``(config, context)`` in their constructor and implement the underscore primitives.
    Build stores with ``kvconnect.connectors.registry.create_store(name, options, context=...)``.
    """

    name: ClassVar[str] = "abstract"
    config_class: ClassVar[type] = type(None)
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    """What every instance can do; ``capabilities_of(config)`` says what a configured one can."""
    metric_prefix: ClassVar[str] = ""
    """Prometheus name prefix of the store's own figures (``stats().extra``); default ``kvconnect_<name>``."""
    metric_counters: ClassVar[frozenset[str]] = frozenset()
    """Which of those figures only grow (exported as counters; the others as gauges)."""

    def __init__(self, context: "EngineContext | None" = None) -> None:
        self.context = context
        self._stats_lock = threading.Lock()
        self._stats = StoreStats(store=self.name)
        self._closed = False
        self._call_causes = threading.local()  # the causes of the current call's misses (``_miss``)
        self._eviction_listeners: tuple = ()  # replaced, never mutated: reporters iterate without a lock

    # -- construction -------------------------------------------------------------
    @classmethod
    def config_from_options(cls, options: Mapping[str, Any] | None = None) -> Any:
        """The typed config of a plain options mapping (JSON), validated by ``config_class``.
        Stores that also read files or the environment (SGLang's own) override this."""
        from kvconnect.connectors.config import parse_config

        return parse_config(cls.config_class, options or {}, where=f"store {cls.name!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None,
                     context: "EngineContext | None" = None) -> "PageStore":
        """Build from a plain options mapping (use ``registry.create_store`` to check capabilities)."""
        return cls(cls.config_from_options(options), context)  # type: ignore[call-arg]

    @classmethod
    def capabilities_of(cls, config: Any) -> frozenset[Capability]:
        """The capabilities of a store built with ``config`` (default: the declared ones)."""
        return cls.capabilities

    @classmethod
    def capability_hint(cls, capability: Capability, config: Any) -> str:
        """How a configuration of this store would get ``capability``, if it can ('' if not)."""
        return ""

    def supports(self, capability: Capability | str) -> bool:
        return Capability(capability) in type(self).capabilities_of(getattr(self, "config", None))

    # -- public API (final) -------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether a complete page is stored (LRU order untouched)."""
        self._check_open()
        keys = _check_keys(keys)
        if not keys:
            return []
        result, dt, causes = self._run_op("exists", keys, self._exists, keys)
        hits = sum(result)
        with self._stats_lock:
            s = self._stats
            self._account(s, "exists", len(keys) - hits, dt, causes)
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
        result, dt, causes = self._run_op("get_into", keys, self._get_into, keys, pages)
        nbytes = sum(page_nbytes(p) for p, ok in zip(pages, result) if ok)
        hits = sum(result)
        with self._stats_lock:
            s = self._stats
            self._account(s, "get", len(keys) - hits, dt, causes)
            s.get_calls += 1
            s.get_pages += len(keys)
            s.get_hits += hits
            s.get_bytes += nbytes
            s.get_seconds += dt
        return result

    def put_from(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Store each caller page under its key. Idempotent: a present key reports True."""
        self._check_open()
        keys, pages = self._check_batch(keys, pages)
        if not keys:
            return []
        result, dt, causes = self._run_op("put_from", keys, self._put_from, keys, pages)
        nbytes = sum(page_nbytes(p) for p, ok in zip(pages, result) if ok)
        written = sum(result)
        with self._stats_lock:
            s = self._stats
            self._account(s, "put", len(keys) - written, dt, causes)
            s.put_calls += 1
            s.put_pages += len(keys)
            s.put_written += written
            s.put_failed += len(keys) - written
            s.put_bytes += nbytes
            s.put_seconds += dt
        return result

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; True where a key was present."""
        self._check_open()
        keys = _check_keys(keys)
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

    def clear_prefix(self, prefix: str) -> None:
        """Remove every key that starts with ``prefix`` (a key space's whole contents)."""
        self._check_open()
        if not prefix:
            raise ValueError("clear_prefix needs a non-empty prefix (clear() removes everything)")
        _check_keys([prefix])
        self._clear_prefix(prefix)

    def register_memory(self, address: int, nbytes: int) -> None:
        """Declare caller memory that pages will live in (needed by RDMA / Mooncake)."""
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"register_memory: nbytes must be > 0, got {nbytes}")
        self._register_memory(address, nbytes)

    def add_eviction_listener(self, listener: Callable[[list[str]], None]) -> Callable[[], None]:
        """Call ``listener(keys)`` with the keys this store evicts (to make room) from now on,
        soon after each eviction; returns the function that removes the listener.

        Only stores with ``Capability.EVICTION_EVENTS`` (others raise ``Unsupported``). Deletes
        and clears a caller asked for are not evictions: the caller knows of them. A listener
        may run on a store thread under the store's locks: it must be quick, must not block and
        must not call the store; whatever it raises is logged and dropped."""
        if not self.supports(Capability.EVICTION_EVENTS):
            raise Unsupported("reporting evictions (Capability.EVICTION_EVENTS)", self.name)
        with self._stats_lock:
            self._eviction_listeners = self._eviction_listeners + (listener,)

        def remove() -> None:
            with self._stats_lock:
                self._eviction_listeners = tuple(x for x in self._eviction_listeners if x is not listener)

        return remove

    def _report_evicted(self, keys: Sequence[str]) -> None:
        """Stores call this with the keys they just evicted (see ``add_eviction_listener``)."""
        for listener in self._eviction_listeners:
            try:
                listener(list(keys))
            except Exception:  # noqa: BLE001 - a listener never breaks the store's write
                _log.exception("kvconnect: eviction listener of store %r failed", self.name)

    def stats(self) -> StoreStats:
        with self._stats_lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items()})
            snap.misses = {op: dict(c) for op, c in snap.misses.items()}
            snap.latency = {op: list(b) for op, b in snap.latency.items()}
            snap.latency_sum = dict(snap.latency_sum)
        snap.up = snap.up and not self._closed and self._backend_ok()
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

    def describe(self) -> str:
        """The start-up log line's details (after ``kvconnect <name>:``): where pages go, the
        endpoints (files, service, master, peers), auth on/off, transport, key space."""
        return ""

    def record_error(self, n: int = 1) -> None:
        """Count backend errors that a store turned into misses."""
        with self._stats_lock:
            self._stats.errors += n

    def _miss(self, cause: str, n: int | None = None) -> None:
        """Say why keys of the current call missed: ``n`` of them, or (None) every miss of
        the call not otherwise explained. Misses nobody explains count as ``not_found``.
        ``unavailable`` marks the store down (``stats().up``) until a call meets none."""
        if cause not in MISS_CAUSES:
            raise ValueError(f"miss cause {cause!r}: expected one of {', '.join(MISS_CAUSES)}")
        if n is not None and n <= 0:
            return
        if cause == "unavailable":
            with self._stats_lock:
                self._stats.up = False
        call = getattr(self._call_causes, "causes", None)
        if call is None:
            return  # outside a data-path call (a background thread): nothing to explain
        if n is None:
            call[None] = cause
        else:
            call[cause] = call.get(cause, 0) + n

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

    def _clear_prefix(self, prefix: str) -> None:
        raise Unsupported("removing the keys of a prefix", self.name)

    def _register_memory(self, address: int, nbytes: int) -> None:
        """Default: nothing to register."""

    def _usage(self) -> StoreUsage:
        return StoreUsage()

    def _backend_ok(self) -> bool:
        """A store that tracks its backend's health itself says so here (``stats().up``)."""
        return True

    def _close(self) -> None:
        """Default: nothing to release."""

    # -- helpers -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.name!r} is closed")

    @staticmethod
    def _check_batch(keys: Sequence[str], pages: Sequence[Page]) -> tuple[list[str], list[Page]]:
        keys = _check_keys(keys)
        pages = list(pages)
        if len(keys) != len(pages):
            raise ValueError(f"got {len(keys)} keys but {len(pages)} pages")
        for p in pages:
            if not p:
                raise ValueError("a page needs at least one (address, nbytes) segment")
        return keys, pages

    def _run_op(self, op: str, keys: list[str], fn: Any, *args: Any) -> tuple[list[bool], float, dict]:
        """Run one primitive: its results checked, timed, with the causes it gave for misses."""
        local = self._call_causes
        outer = getattr(local, "causes", None)  # a store calling its own public API
        local.causes = causes = {}
        t0 = time.perf_counter()
        try:
            result = self._checked(op, keys, fn(*args))
        finally:
            local.causes = outer
        return result, time.perf_counter() - t0, causes

    @staticmethod
    def _account(s: StoreStats, op: str, misses: int, dt: float, causes: dict) -> None:
        """Latency bucket, health and misses by cause of one call (under ``_stats_lock``)."""
        hist = s.latency.get(op)
        if hist is None:
            hist = s.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1)
        hist[bisect.bisect_left(LATENCY_BUCKETS, dt)] += 1
        s.latency_sum[op] = s.latency_sum.get(op, 0.0) + dt
        if "unavailable" not in causes and causes.get(None) != "unavailable":
            s.up = True
        if op != "put" and misses:
            by = s.misses.setdefault(op, {})
            default = causes.pop(None, "not_found")
            for cause, n in causes.items():
                n = min(n, misses)
                by[cause] = by.get(cause, 0) + n
                misses -= n
            if misses:
                by[default] = by.get(default, 0) + misses

    def _checked(self, op: str, keys: list[str], result: Sequence[bool]) -> list[bool]:
        result = list(map(bool, result))
        if len(result) != len(keys):
            raise RuntimeError(
                f"{type(self).__name__}.{op} returned {len(result)} results for {len(keys)} keys"
            )
        return result
