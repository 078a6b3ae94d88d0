"""Any kvconnect ``PageStore`` as an L2 adapter of LMCache's multi-process server.

Load it with ``lmcache server ... --l2-adapter`` (LMCache 0.5.6)::

    {"type": "plugin", "module_path": "kvconnect.connectors.engines.lmcache_l2",
     "class_name": "KVConnectL2Adapter",
     "adapter_params": {"store": "hf3fs", "file_path_prefix": "/3fs/kv", ...}}

``adapter_params`` are the store's own options plus the adapter's keys (see
``KVConnectL2AdapterConfig``); LMCache finds the config class by the ``<class>Config``
convention.

How LMCache's contract maps onto the store:

* store / lookup-and-lock / load run on the adapter's own worker threads (one pool per
  task family, so a slow store backlog never delays lookups or loads); each family has its
  own event fd, notified whenever results are ready; each result is handed out once.
* A chunk's page is its L1 ``MemoryObj`` buffer, ``[(address, nbytes)]``: stores read
  straight from it and loads write straight into it (no intermediate copy here).
* ``ObjectKey`` (model, kv_rank, object group, chunk hash, cache salt) becomes a page of a
  ``KeySpace`` of the model, object group, tenant+salt and the group's L1 dtype (learned from
  the objects and layout descriptions LMCache hands over: ``ObjectKey`` has none), with the
  packed kv_rank and the chunk hash in the page hash: two models, ranks, groups, tenants or
  dtypes never share a key (LMCache's fp8 objects are ``uint8`` whatever the fp8). Each
  key space is a view of the store (``PrefixedStore``); a batch spanning several goes to
  the store in one call per operation.
* Lookup "locks" are reference counts that keep LMCache's own L2 eviction (``delete``) off
  the keys between lookup and load. The store's own eviction is not stopped by them: a
  page evicted in between is a failed load for that key, which LMCache recomputes.
* ``get_usage`` / ``lmcache describe`` report the store's own used and capacity bytes (all
  servers' pages of a shared store; the same after a restart for a durable one). LMCache's
  watermark eviction (``supports_global_eviction``) runs only over a private store of known
  capacity; a shared store evicts by itself. Details: ``KVConnectL2Adapter._init_usage``.
* Every store call is guarded: an exception is a failed store, a miss or a failed load,
  never an exception into LMCache's controller threads. A lookup that takes longer than
  ``lookup_timeout_s`` reports all misses (nothing stays locked). Stores and loads are not
  cut short by the adapter -- their buffers belong to LMCache and must not be touched after
  the result is reported -- so they rely on the store's own bounded timeouts.

API drift (0.4.x ... 0.5.x) is absorbed here: ``Bitmap`` location, ``L2StoreResult`` vs
``bool`` store results, event notifier vs ``os.eventfd``, constructor and lookup argument
shapes, older ``ObjectKey`` fields.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from kvconnect.connectors.base import Capability, ConfigError, Page, PageStore, StoreStats
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import (
    EngineOptions,
    ErrorCounter,
    RateLimitedLog,
    build_store,
    safe_call,
    split_engine_options,
)
from kvconnect.connectors.views import PrefixedStore, delete_many, exists_many, get_many, put_many
from kvconnect.namespace.dtypes import dtype_name
from kvconnect.namespace.keyspace import KeySpace, model_key

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

try:  # 0.4.3+
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
except ImportError:  # pragma: no cover - older layouts
    L2AdapterConfigBase = object  # type: ignore[assignment,misc]

try:  # 0.5.x
    from lmcache.lmcache_native import Bitmap
except ImportError:  # pragma: no cover - 0.4.x
    from lmcache.native_storage_ops import Bitmap  # type: ignore[no-redef]

try:  # after 0.4.5
    from lmcache.v1.distributed.internal_api import L2StoreResult
except ImportError:  # pragma: no cover - older: dict[int, bool]
    L2StoreResult = None  # type: ignore[assignment,misc]

try:  # 0.5.x: usage as a dataclass (older: a (fraction, ...) tuple from the base class)
    from lmcache.v1.distributed.l2_adapters.base import AdapterUsage
except ImportError:  # pragma: no cover - older
    AdapterUsage = None  # type: ignore[assignment,misc]

try:
    from lmcache.v1.platform import create_event_notifier
except ImportError:  # pragma: no cover - older: raw eventfds
    create_event_notifier = None  # type: ignore[assignment]

log = logging.getLogger("kvconnect.lmcache")

WHERE = "lmcache l2 adapter"
KEY_LAYOUT = "lmcache-mp"
"""Key-space layout of LMCache chunks: never the same keys as SGLang HiCache pages."""

OPS = ("store", "lookup", "load")

# Adapter keys in adapter_params, next to common's (store, store_options, tenant,
# model_fingerprint, metrics_port); everything else is a store option.
ENGINE_KEYS = ("num_workers", "per_op_workers", "lookup_timeout_s")
# LMCache-level keys that may reach adapter_params through older or raw-dict factories.
LMCACHE_KEYS = ("type", "eviction", "serde", "persist_enabled", "shared", "affinity_tag")

DEFAULT_WORKERS = {"store": 2, "lookup": 1, "load": 2}
DEFAULT_LOOKUP_TIMEOUT_S = 5.0  # a request waits at most this long on a stuck backend; a miss is a recompute
USAGE_TTL_S = 1.0
HEALTH_EVERY_S = 1.0  # backend_ok: the store's stats() checked this often; a failing store probed as often
HEALTH_PROBE_KEY = ".kvconnect-l2-health"  # outside every key space: the probe never hits a chunk
"""How long one snapshot of the store's usage is reused: LMCache's eviction loop and gauges ask
every second, and a remote store's figures cost a call (HF3FS: one index call per data
file). This adapter's own stores and deletes drop the snapshot at once."""


def _store_result(ok: bool, nbytes: int) -> Any:
    """``L2StoreResult`` where LMCache has it, else the older ``bool``."""
    if L2StoreResult is not None:
        return L2StoreResult(bool(ok), max(0, int(nbytes)))
    return bool(ok)


class _EventFd:
    """Fallback notifier for LMCache versions without ``create_event_notifier``."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        return self._fd

    def notify(self) -> None:
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:  # counter saturated: already signalled
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _new_notifier() -> Any:
    return create_event_notifier() if create_event_notifier is not None else _EventFd()


# ---------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, f"expected a positive integer, got {value!r}", None, WHERE)
    return value


class KVConnectL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc,valid-type]
    """``adapter_params`` of ``KVConnectL2Adapter``.

    Adapter keys:
      * ``store`` (required): registry name (``memory``, ``hf3fs``, ``mooncake``,
        ``peer_rdma``) or ``"pkg.mod:Class"`` for an out-of-tree ``PageStore``;
      * ``store_options``: the store's options as a nested object (or give them inline);
      * ``tenant``: isolates this server's pages from other tenants in a shared store;
      * ``model_fingerprint``: weights revision, to tell fine-tunes served under one name apart;
      * ``num_workers`` (int, default store 2 / lookup 1 / load 2): threads per task family;
      * ``per_op_workers`` (``{"store": n, "lookup": n, "load": n}``): per-family override;
      * ``lookup_timeout_s`` (default 5): a lookup slower than this reports all misses;
      * ``metrics_port``: serve the store's Prometheus ``/metrics`` (127.0.0.1) on this port.

    Store options are checked by the store's typed config when the adapter builds it.
    """

    def __init__(self, params: Mapping[str, Any] | None = None):
        params = {k: v for k, v in dict(params or {}).items() if k not in LMCACHE_KEYS}
        # Checks the adapter keys now (a typed error at parse time, naming the key); the
        # store's own options are checked when the store is built.
        eo = split_engine_options(params, where=WHERE, engine_keys=ENGINE_KEYS)
        self.params = params
        self.engine: EngineOptions = eo
        workers = dict(DEFAULT_WORKERS)
        if "num_workers" in eo.extra:
            n = _positive_int(eo.extra["num_workers"], "num_workers")
            workers = {op: n for op in OPS}
        per_op = eo.extra.get("per_op_workers")
        if per_op is not None:
            if not isinstance(per_op, Mapping):
                raise ConfigError("per_op_workers", f"expected an object, got {per_op!r}", OPS, WHERE)
            for op, n in per_op.items():
                if op not in OPS:
                    raise ConfigError("per_op_workers", f"unknown operation {op!r}", OPS, WHERE)
                workers[op] = _positive_int(n, f"per_op_workers.{op}")
        self.workers = workers
        timeout = eo.extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout <= 0:
            raise ConfigError("lookup_timeout_s", f"expected a positive number of seconds, got {timeout!r}",
                              None, WHERE)
        self.lookup_timeout_s = float(timeout)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVConnectL2AdapterConfig":
        return cls(d)

    @classmethod
    def help(cls) -> str:
        import sys

        return (cls.__doc__ or "") + "\n" + (sys.modules[__name__].__doc__ or "")


# ---------------------------------------------------------------------------------
# ObjectKey -> store key
# ---------------------------------------------------------------------------------


def _rank_tag(key: Any) -> str:
    """The packed kv_rank, exactly (its local/global split never aliases another rank)."""
    kv_rank = getattr(key, "kv_rank", None)
    if kv_rank is not None:
        return f"r{int(kv_rank) & 0xFFFFFFFFFFFFFFFF:x}"
    # LMCache < 0.4: ObjectKey(model_name, world_size, worker_id, chunk_hash: int)
    return f"w{int(getattr(key, 'world_size', 0))}.{int(getattr(key, 'worker_id', 0))}"


def _hash_hex(chunk_hash: Any) -> str:
    if isinstance(chunk_hash, (bytes, bytearray, memoryview)):
        return bytes(chunk_hash).hex()
    if isinstance(chunk_hash, int):
        return f"i{chunk_hash & ((1 << 256) - 1):x}"
    if isinstance(chunk_hash, str):
        return chunk_hash
    raise TypeError(f"unsupported chunk_hash type {type(chunk_hash).__name__}")


class ObjectKeyMapper:
    """``ObjectKey`` -> (key space, page hash); key spaces cached per (model, object group, salt).

    The key space carries the model, the pool (``kv`` for object group 0, ``kv.g<N>`` for
    the others), the tenant and the cache salt (separate fields of the key space: no pair
    of them shares a key space with another pair), the model fingerprint and the dtype of the
    group's L1 objects. The page hash is ``r<kv_rank hex>-<chunk hash hex>``.

    ``ObjectKey`` has no dtype: it is learned per (model, object group) from what LMCache
    hands over (``learn``): the memory objects of a store or load, the layout descriptions of
    a lookup. Before anything is learned a key's dtype is ``UNKNOWN_DTYPE`` (lookups miss).
    """

    UNKNOWN_DTYPE = "unknown"

    def __init__(self, tenant: str = "", model_fingerprint: str = "", max_spaces: int = 4096):
        self.tenant = tenant
        self.model_fingerprint = model_fingerprint
        self._max = max_spaces
        self._lock = threading.Lock()
        self._spaces: OrderedDict[tuple[str, int, str, str], KeySpace] = OrderedDict()
        self._dtypes: dict[tuple[str, int], str] = {}  # (model, object group) -> its L1 objects' dtype

    def learn(self, key: Any, dtype: str) -> None:
        """The dtype of ``key``'s (model, object group), from an object or layout LMCache gave."""
        if dtype:
            ident = (str(getattr(key, "model_name", "") or ""), int(getattr(key, "object_group_id", 0) or 0))
            if self._dtypes.get(ident) != dtype:
                with self._lock:
                    self._dtypes[ident] = dtype
                    while len(self._dtypes) > self._max:
                        self._dtypes.pop(next(iter(self._dtypes)))

    def space(self, model: str, group: int, salt: str) -> KeySpace:
        dtype = self._dtypes.get((model, group), self.UNKNOWN_DTYPE)
        ident = (model, group, salt, dtype)
        with self._lock:
            ks = self._spaces.get(ident)
            if ks is not None:
                self._spaces.move_to_end(ident)
                return ks
        ks = KeySpace(model=model_key(model), layout=KEY_LAYOUT, dtype=dtype,
                      weights=self.model_fingerprint, pool="kv" if group == 0 else f"kv.g{group}",
                      tenant=self.tenant, salt=salt)
        with self._lock:
            self._spaces[ident] = ks
            while len(self._spaces) > self._max:
                self._spaces.popitem(last=False)
        return ks

    def locate(self, key: Any) -> tuple[KeySpace, str]:
        """The key space and page hash of an ``ObjectKey``."""
        model = str(getattr(key, "model_name", "") or "")
        group = int(getattr(key, "object_group_id", 0) or 0)
        salt = str(getattr(key, "cache_salt", "") or "")
        return self.space(model, group, salt), f"{_rank_tag(key)}-{_hash_hex(key.chunk_hash)}"

    def key(self, key: Any) -> str:
        """The store key an ``ObjectKey`` ends up as (for bookkeeping and tests)."""
        space, page = self.locate(key)
        return space.key(page)

    def keys(self, keys: Sequence[Any]) -> list[str]:
        return [self.key(k) for k in keys]


class _Batch:
    """A batch of ``ObjectKey``s as calls on key-space views: one per key space, results
    put back in the batch's order."""

    def __init__(self, views: "_Views", keys: Sequence[Any]):
        self.n = len(keys)
        self.store_keys: list[str] = []
        groups: dict[int, tuple[PrefixedStore, list[int], list[str]]] = {}
        for i, k in enumerate(keys):
            space, page = views.mapper.locate(k)
            self.store_keys.append(space.key(page))
            view = views.view(space)
            group = groups.setdefault(id(view), (view, [], []))
            group[1].append(i)
            group[2].append(page)
        self.groups = list(groups.values())

    def run(self, many: Callable, pages: Sequence[Page] | None = None) -> list[bool]:
        calls = [(v, hashes) if pages is None else (v, hashes, [pages[i] for i in pos]) for v, pos, hashes in self.groups]
        out = [False] * self.n
        for (_, pos, _), res in zip(self.groups, many(calls) if calls else []):
            for i, ok in zip(pos, res):
                out[i] = ok
        return out


class _Views:
    """Key-space views of the adapter's store, made once per key space."""

    def __init__(self, store: PageStore, mapper: ObjectKeyMapper):
        self.store = store
        self.mapper = mapper
        self._lock = threading.Lock()
        self._views: dict[str, PrefixedStore] = {}

    def view(self, space: KeySpace) -> PrefixedStore:
        with self._lock:
            v = self._views.get(space.prefix)
            if v is None:
                v = self._views[space.prefix] = PrefixedStore.for_keyspace(self.store, space)
                while len(self._views) > 4 * 4096:  # bounded like the mapper's cache
                    self._views.pop(next(iter(self._views)))
            return v

    def batch(self, keys: Sequence[Any]) -> _Batch:
        return _Batch(self, keys)


# ---------------------------------------------------------------------------------
# MemoryObj -> page
# ---------------------------------------------------------------------------------


def _dtype_names(dtypes: Any) -> str:
    """One name for a list of torch dtypes (one per kernel group of an object), '' if none."""
    names = [dtype_name(d) for d in (dtypes or []) if d is not None]
    return "+".join(names)


def object_dtype(obj: Any) -> str:
    """The dtype(s) of an L1 memory object (``metadata.dtypes``, else ``metadata.dtype``)."""
    meta = getattr(obj, "metadata", None)
    return _dtype_names(getattr(meta, "dtypes", None) or [getattr(meta, "dtype", None)])


def layout_dtype(desc: Any) -> str:
    """The dtype(s) a lookup's ``MemoryLayoutDesc`` gives an object group ('' if none)."""
    return _dtype_names(getattr(desc, "dtypes", None))


def object_page(obj: Any) -> Page:
    """``[(address, nbytes)]`` of an L1 memory object's logical bytes (CPU memory only)."""
    raw = getattr(obj, "raw_data", None)
    if raw is not None and getattr(getattr(raw, "device", None), "type", "cpu") != "cpu":
        raise ValueError(f"L1 object on {raw.device}: kvconnect pages must be host memory")
    ptr = getattr(obj, "data_ptr", None)
    if callable(ptr):
        ptr = ptr()
    if not ptr:
        tensor = getattr(obj, "tensor", None)
        ptr = tensor.data_ptr() if tensor is not None else 0
    size = obj.get_size() if hasattr(obj, "get_size") else len(obj.byte_array)
    if not ptr or size <= 0:
        raise ValueError("L1 object without a buffer")
    return [(int(ptr), int(size))]


# ---------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------


class _Family:
    """One task family: its worker pool, its event fd, its finished results."""

    def __init__(self, op: str, workers: int):
        self.op = op
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvc-l2-{op}")
        self.notifier = _new_notifier()
        self.done: dict[int, Any] = {}
        self.in_flight = 0


class KVConnectL2Adapter(L2AdapterInterface):
    """LMCache ``L2AdapterInterface`` over a kvconnect ``PageStore``."""

    config_class_name = "KVConnectL2AdapterConfig"

    def __init__(self, config: KVConnectL2AdapterConfig | Mapping[str, Any] | None = None,
                 l1_memory_desc: Any = None, *args: Any, store: PageStore | None = None, **kwargs: Any):
        # The capacity is set below, once the store says what it holds (``_init_usage``).
        super().__init__(max_capacity_bytes=0)
        if not isinstance(config, KVConnectL2AdapterConfig):  # raw-dict factories
            if isinstance(config, str):
                config = json.loads(config)
            config = KVConnectL2AdapterConfig(config or ({} if store is None else {"store": store.name}))
        self.config = config
        eo = config.engine
        self._errors = ErrorCounter()
        self._rlog = RateLimitedLog(log)
        self._closed = False
        self._lock = threading.Lock()
        self._next_id = 0
        self._locks: dict[str, int] = {}  # store key -> lookup lock count
        # store key -> size of what this adapter stored (LMCache's byte accounting; bounded)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._max_sizes = 1 << 20
        self._lookup_deadlines: dict[int, tuple[float, int]] = {}
        self.lookup_timeouts = 0
        self._consecutive_failures = 0  # store calls that raised in a row
        self._last_failure = ""  # the latest of them: "<what>: <Exception>: <message>"
        self._last_call = time.monotonic()  # when a store call last finished
        self._stats_problem = ""  # why the latest stats() says the backend is not ok ("" if it is)

        # One LMCache server serves many engines and ranks (ObjectKey carries them): no rank here.
        self.context = EngineContext(engine="lmcache")
        self.store = store if store is not None else build_store(config.params, where=WHERE, engine_keys=ENGINE_KEYS,
                                                                 context=self.context)[0]
        self.mapper = ObjectKeyMapper(eo.tenant, eo.model_fingerprint)
        self.views = _Views(self.store, self.mapper)
        self._init_usage()
        try:
            self._register_l1(l1_memory_desc)
            self._families = {op: _Family(op, config.workers[op]) for op in OPS}
            if eo.metrics_port is not None:
                from kvconnect.connectors.engines.common import serve_store_metrics

                _export_health(self)
                serve_store_metrics(self.store, eo.metrics_port, eo.metrics_host, engine="lmcache")
        except BaseException:
            self.store.close()
            raise
        self._watchdog_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_lookups, name="kvc-l2-lookup-watchdog", daemon=True)
        self._watchdog.start()
        self._health = threading.Thread(target=self._watch_health, name="kvc-l2-health", daemon=True)
        self._health.start()
        log.info("kvconnect L2 adapter over store %r (workers %s, lookup timeout %.1fs)",
                 self.store.name, config.workers, config.lookup_timeout_s)

    def _register_l1(self, desc: Any) -> None:
        """Stores that need registered memory (Mooncake, RDMA) register LMCache's L1 arena
        once, so loads and stores move bytes without a bounce copy."""
        if desc is None or not self.store.supports(Capability.NEEDS_REGISTERED_MEMORY):
            return
        ptr, size = int(getattr(desc, "ptr", 0)), int(getattr(desc, "size", 0))
        if ptr and size > 0:
            safe_call(self.store.register_memory, ptr, size, default=None, what="lmcache.register_l1",
                      errors=self._errors, rlog=self._rlog)

    # -- event fds ------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._families["store"].notifier.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._families["lookup"].notifier.fileno()

    def get_load_event_fd(self) -> int:
        return self._families["load"].notifier.fileno()

    # -- bookkeeping ----------------------------------------------------------------
    def _new_task(self, op: str) -> int:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
            self._families[op].in_flight += 1
            return tid

    def _finish(self, op: str, tid: int, result: Any) -> None:
        fam = self._families[op]
        with self._lock:
            fam.done[tid] = result
            fam.in_flight -= 1
        try:
            fam.notifier.notify()
        except Exception:  # noqa: BLE001 - closed at shutdown
            pass
        # Hand the GIL to the thread waiting for this result: a worker going on to its next
        # task would otherwise keep it for up to the 5 ms switch interval, and a prompt's
        # first chunk would reach LMCache only with its last.
        time.sleep(0)

    def _submit(self, op: str, tid: int, fn: Callable[[], None], fail: Callable[[], None]) -> None:
        """Run ``fn`` on the family's workers; if it cannot run at all, ``fail`` reports it."""
        try:
            if self._closed:
                raise RuntimeError("adapter closed")
            self._families[op].pool.submit(self._run_guarded, op, fn, fail)
        except Exception as e:  # noqa: BLE001 - a rejected submit is a failed task
            self._errors.add(f"lmcache.{op}")
            self._rlog.error(f"submit:{op}", "kvconnect L2 %s task %d not run: %s", op, tid, e)
            fail()

    def _run_guarded(self, op: str, fn: Callable[[], None], fail: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every task reports exactly one result
            self._errors.add(f"lmcache.{op}")
            self._rlog.error(f"task:{op}:{type(e).__name__}", "kvconnect L2 %s task failed: %s: %s",
                             op, type(e).__name__, e, exc_info=True)
            fail()

    def _prepare(self, keys: Sequence[Any], objects: Sequence[Any] | None) -> tuple[list[Any], _Batch, list[Page] | None]:
        keys = list(keys)
        pages = None
        if objects is not None:
            objects = list(objects)
            if len(objects) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
            pages = [object_page(o) for o in objects]
            for k, o in zip(keys, objects):
                self.mapper.learn(k, object_dtype(o))
        batch = self.views.batch(keys)
        return keys, batch, pages

    def _guarded(self, what: str, fn: Callable[..., list[bool]], *args: Any, n: int) -> list[bool]:
        """``fn(*args)``; an exception is ``n`` failures (counted, rate-limited log)."""
        raised: list[str] = []

        def call(*a: Any) -> list[bool]:
            try:
                return fn(*a)
            except Exception as e:
                raised.append(f"{what}: {type(e).__name__}: {e}"[:300])
                raise

        def failed() -> list[bool]:
            return [False] * n

        out = safe_call(call, *args, default=failed, what=f"lmcache.{what}", errors=self._errors, rlog=self._rlog)
        self._note_call(raised[0] if raised else "")
        return list(out) if len(out) == n else [False] * n

    def _note_call(self, failure: str) -> None:
        """A store call finished: ``failure`` is why it failed ("" if it did not)."""
        with self._lock:
            self._last_call = time.monotonic()
            if failure:
                self._consecutive_failures += 1
                self._last_failure = failure
            else:
                self._consecutive_failures = 0

    # -- backend health (backend_ok, in report_status and as a metric) ------------------
    def _watch_health(self) -> None:
        """Every ``HEALTH_EVERY_S``: the store's ``stats()`` (shared with LMCache's usage
        polls), so a backend that goes down shows without traffic; and while store calls are
        failing and none ran for that long, one ``exists`` of a key no chunk uses, so a
        backend that comes back shows without traffic too."""
        while not self._watchdog_stop.wait(HEALTH_EVERY_S):
            try:
                self._check_health()
            except Exception as e:  # noqa: BLE001 - the health thread never dies
                self._rlog.error("health", "kvconnect L2 health check failed: %s", e)

    def _check_health(self) -> None:
        if self._closed or self.store.closed:
            return
        problem = ""
        try:
            stats = self.store.stats()
            if not stats.up:
                problem = "store reports its backend down (stats().up is false)"
        except Exception as e:  # noqa: BLE001
            problem = f"stats: {type(e).__name__}: {e}"[:300]
        with self._lock:
            self._stats_problem = problem
            probe = self._consecutive_failures > 0 and time.monotonic() - self._last_call >= HEALTH_EVERY_S
        if probe:
            self._guarded("health_probe", self.store.exists, [HEALTH_PROBE_KEY], n=1)

    def health(self) -> dict[str, Any]:
        """``backend_ok``, ``consecutive_failures`` and the reason (``backend_reason``: "" when
        ok; ``backend_reason_kind``: ``ok``, ``closed``, ``store_calls_failing``, ``stats_failing``)."""
        with self._lock:
            failing, last, stats_problem = self._consecutive_failures, self._last_failure, self._stats_problem
        if self._closed or self.store.closed:
            kind, reason = "closed", "adapter closed"
        elif failing:
            kind, reason = "store_calls_failing", f"{failing} store call(s) failed in a row, the latest {last}"
        elif stats_problem:
            kind, reason = "stats_failing", stats_problem
        else:
            kind, reason = "ok", ""
        return {"backend_ok": kind == "ok", "consecutive_failures": failing, "backend_reason": reason,
                "backend_reason_kind": kind}

    # -- store --------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any], *args: Any, **kwargs: Any) -> int:
        """Store the bytes of ``objects`` (read in place). The task succeeds only if every
        key is stored: LMCache treats a successful task as 'all keys are in L2'."""
        tid = self._new_task("store")
        fail = lambda: self._finish("store", tid, _store_result(False, 0))  # noqa: E731
        try:
            okeys, batch, pages = self._prepare(keys, objects)
        except Exception as e:  # noqa: BLE001
            self._errors.add("lmcache.store")
            self._rlog.error(f"store-args:{type(e).__name__}", "kvconnect L2 store: bad arguments: %s", e)
            fail()
            return tid
        if not batch.n:
            self._finish("store", tid, _store_result(True, 0))
            return tid
        self._submit("store", tid, lambda: self._run_store(tid, okeys, batch, pages), fail)
        return tid

    def _run_store(self, tid: int, okeys: list[Any], batch: _Batch, pages: list[Page]) -> None:
        skeys = batch.store_keys
        ok = self._guarded("store", batch.run, put_many, pages, n=len(skeys))
        sizes = [p[0][1] for p in pages]
        nbytes = sum(s for s, good in zip(sizes, ok) if good)
        new_keys, new_sizes = [], []
        with self._lock:
            for k, sk, size, good in zip(okeys, skeys, sizes, ok):
                if good and sk not in self._sizes:
                    new_keys.append(k)
                    new_sizes.append(size)
                if good:
                    self._sizes[sk] = size
                    self._sizes.move_to_end(sk)
            while len(self._sizes) > self._max_sizes:
                self._sizes.popitem(last=False)
        self._drop_usage_snapshot()
        self._notify("stored", new_keys, new_sizes)
        self._finish("store", tid, _store_result(all(ok), nbytes))

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        fam = self._families["store"]
        with self._lock:
            done, fam.done = fam.done, {}
        return done

    # -- lookup and lock ------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None,
                                    *args: Any, **kwargs: Any) -> int:
        """Which keys the store holds; the hits stay locked against ``delete`` until
        ``submit_unlock``. ``group_layout_descs`` names each object group's dtype (the key
        spaces': an engine of another KV dtype misses)."""
        tid = self._new_task("lookup")
        n = len(keys)
        try:
            if isinstance(group_layout_descs, Mapping):
                dtypes = {int(g): layout_dtype(d) for g, d in group_layout_descs.items()}
                for k in keys:
                    self.mapper.learn(k, dtypes.get(int(getattr(k, "object_group_id", 0) or 0), ""))
            _, batch, _ = self._prepare(keys, None)
        except Exception as e:  # noqa: BLE001
            self._errors.add("lmcache.lookup")
            self._rlog.error(f"lookup-args:{type(e).__name__}", "kvconnect L2 lookup: bad arguments: %s", e)
            self._finish("lookup", tid, Bitmap(n))
            return tid
        fail = lambda: self._finish_lookup(tid, n, [], [])  # noqa: E731
        with self._lock:
            self._lookup_deadlines[tid] = (time.monotonic() + self.config.lookup_timeout_s, n)
        self._submit("lookup", tid, lambda: self._run_lookup(tid, batch), fail)
        return tid

    def _run_lookup(self, tid: int, batch: _Batch) -> None:
        skeys = batch.store_keys
        present = self._guarded("exists", batch.run, exists_many, n=len(skeys)) if skeys else []
        self._finish_lookup(tid, len(skeys), skeys, present)

    def _finish_lookup(self, tid: int, n: int, skeys: list[str], present: list[bool]) -> None:
        bm = Bitmap(n)
        with self._lock:
            if self._lookup_deadlines.pop(tid, None) is None:
                return  # the watchdog already answered (all misses): take no locks
            for i, (sk, hit) in enumerate(zip(skeys, present)):
                if hit:
                    bm.set(i)
                    self._locks[sk] = self._locks.get(sk, 0) + 1
        self._finish("lookup", tid, bm)

    def _watch_lookups(self) -> None:
        """Answer lookups that overran ``lookup_timeout_s`` with all misses."""
        while not self._watchdog_stop.wait(0.05):
            now = time.monotonic()
            expired = []
            with self._lock:
                for tid, (deadline, n) in list(self._lookup_deadlines.items()):
                    if now >= deadline:
                        del self._lookup_deadlines[tid]
                        expired.append((tid, n))
            for tid, n in expired:
                self.lookup_timeouts += 1
                self._errors.add("lmcache.lookup_timeout")
                self._rlog.warning("lookup-timeout", "kvconnect L2 lookup task %d took over %.1fs: "
                                   "reported as all misses", tid, self.config.lookup_timeout_s)
                self._finish("lookup", tid, Bitmap(n))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        fam = self._families["lookup"]
        with self._lock:
            return fam.done.pop(task_id, None)

    def submit_unlock(self, keys: list[Any], *args: Any, **kwargs: Any) -> None:
        """Release lookup locks. Never raises, never blocks on the store."""
        try:
            skeys = self.mapper.keys(keys)
        except Exception as e:  # noqa: BLE001 - unlock must not fail
            self._rlog.error("unlock-args", "kvconnect L2 unlock: bad keys ignored: %s", e)
            return
        with self._lock:
            for sk in skeys:
                c = self._locks.get(sk, 0)
                if c <= 1:
                    self._locks.pop(sk, None)
                else:
                    self._locks[sk] = c - 1

    # -- load ---------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any], *args: Any, **kwargs: Any) -> int:
        """Fill ``objects`` (LMCache's L1 buffers) with the stored bytes; per-key bitmap."""
        tid = self._new_task("load")
        n = len(keys)
        fail = lambda: self._finish("load", tid, Bitmap(n))  # noqa: E731
        try:
            okeys, batch, pages = self._prepare(keys, objects)
        except Exception as e:  # noqa: BLE001
            self._errors.add("lmcache.load")
            self._rlog.error(f"load-args:{type(e).__name__}", "kvconnect L2 load: bad arguments: %s", e)
            fail()
            return tid
        if not batch.n:
            fail()
            return tid
        self._submit("load", tid, lambda: self._run_load(tid, okeys, batch, pages), fail)
        return tid

    def _run_load(self, tid: int, okeys: list[Any], batch: _Batch, pages: list[Page]) -> None:
        ok = self._guarded("load", batch.run, get_many, pages, n=batch.n)
        bm = Bitmap(batch.n)
        hits = []
        for i, good in enumerate(ok):
            if good:
                bm.set(i)
                hits.append(okeys[i])
        self._notify("accessed", hits)
        self._finish("load", tid, bm)

    def query_load_result(self, task_id: int) -> Any:
        fam = self._families["load"]
        with self._lock:
            return fam.done.pop(task_id, None)

    # -- usage and capacity ------------------------------------------------------------
    def _init_usage(self) -> None:
        """What ``get_usage`` and ``lmcache describe`` report, and who evicts.

        Used and capacity bytes are the store's own (``stats()``: the memory store's bytes and
        ``capacity``; HF3FS's indexed pages times their page size, of the data files it has
        open, from the metadata service; Mooncake's allocated and total bytes of the master's
        mounted segments, from its metrics endpoint; the peer pool's bytes in use and lent,
        over every live member), for every server over the store, and after a restart the
        same as before for a durable store. A store that reports no bytes (Mooncake without
        ``master_metrics``) gets this adapter's own accounting (bytes this server stored and
        did not delete), a store that reports no capacity 0 (unknown: usage fraction -1).
        ``bytes_by_cache_salt`` is always this server's own accounting.

        LMCache's watermark eviction (``supports_global_eviction``) runs only for a private
        store of known capacity: a shared store's bytes are not this server's to evict (other
        servers' chunks are in its figures), so it keeps eviction to itself while it reports
        its real usage.
        """
        self._usage_guard = threading.Lock()
        self._usage_snap: tuple[float, StoreStats | None] | None = None
        self._last_good: StoreStats | None = None
        self.shared = bool(self.store.supports(Capability.SHARED))
        cap = self.usage_figures()["capacity_bytes"]
        self._global_eviction = not self.shared and cap > 0
        self._max_capacity_bytes = cap

    @property
    def supports_global_eviction(self) -> bool:  # type: ignore[override]
        """Private store of known capacity: LMCache evicts. Shared store: the store does."""
        return self._global_eviction

    def _drop_usage_snapshot(self) -> None:
        with self._usage_guard:
            self._usage_snap = None

    def _store_stats(self, fresh: bool = False) -> StoreStats | None:
        """The store's ``stats()``, reused for ``USAGE_TTL_S`` unless ``fresh``; None if it raised."""
        now = time.monotonic()
        if not fresh:
            with self._usage_guard:
                snap = self._usage_snap
            if snap is not None and now - snap[0] < USAGE_TTL_S:
                return snap[1]
        stats = safe_call(self.store.stats, default=None, what="lmcache.stats", errors=self._errors, rlog=self._rlog)
        with self._usage_guard:
            self._usage_snap = (now, stats)
            if stats is not None and stats.up:
                self._last_good = stats
        return stats

    def usage_figures(self, stats: StoreStats | None = None) -> dict[str, Any]:
        """Used and capacity bytes, where each came from (``store``, ``adapter``,
        ``unknown``), and ``stale``: the backend is unreachable, so these are its last figures
        from when it answered (an unreachable index would under-count)."""
        if stats is None:
            stats = self._store_stats()
        stale = False
        if stats is None or not stats.up:
            with self._usage_guard:
                last = self._last_good
            if last is not None:
                stats, stale = last, True
        with self._usage_lock:  # the base class's accounting
            own = self._total_bytes_used
        if stats is not None and stats.bytes_used is not None:
            used, used_from = int(stats.bytes_used), "store"
        else:
            used, used_from = int(own), "adapter"
        if stats is not None and stats.capacity_bytes:
            cap, cap_from = int(stats.capacity_bytes), "store"
        else:
            cap, cap_from = 0, "unknown"
        return {"bytes_used": used, "capacity_bytes": cap, "bytes_used_from": used_from, "capacity_from": cap_from,
                "stale": stale, "keys": stats.keys if stats is not None else None}

    def get_usage(self) -> Any:
        """``AdapterUsage``: the store's used and capacity bytes (``usage_figures``); the
        per-cache_salt buckets are this server's own accounting."""
        base = super().get_usage()
        if AdapterUsage is None:  # pragma: no cover - older LMCache
            return base
        f = self.usage_figures()
        return AdapterUsage(total_bytes_used=f["bytes_used"], total_capacity_bytes=f["capacity_bytes"],
                            bytes_by_cache_salt=base.bytes_by_cache_salt)

    # -- eviction, status, close -------------------------------------------------------
    def delete(self, keys: list[Any], *args: Any, **kwargs: Any) -> None:
        """LMCache's L2 eviction: delete the keys no lookup holds locked."""
        try:
            pairs = list(zip(keys, self.mapper.keys(keys)))
        except Exception as e:  # noqa: BLE001
            self._rlog.error("delete-args", "kvconnect L2 delete: bad keys ignored: %s", e)
            return
        with self._lock:
            pairs = [(k, sk) for k, sk in pairs if sk not in self._locks]
        if not pairs or self._closed:
            return
        batch = self.views.batch([k for k, _ in pairs])
        gone = self._guarded("delete", batch.run, delete_many, n=len(pairs))
        deleted, sizes = [], []
        with self._lock:
            for (k, sk), g in zip(pairs, gone):
                size = self._sizes.pop(sk, None)
                if g and size is not None:
                    deleted.append(k)
                    sizes.append(size)
        self._drop_usage_snapshot()
        self._notify("deleted", deleted, sizes)

    def _notify(self, what: str, keys: list[Any], sizes: list[int] | None = None) -> None:
        """LMCache listeners and byte accounting; their failures never fail a task."""
        if not keys:
            return
        fn = getattr(self, f"_notify_keys_{what}", None)
        if fn is None:
            return
        args = (keys,) if sizes is None else (keys, sizes)
        safe_call(fn, *args, default=None, what=f"lmcache.notify_{what}", errors=self._errors, rlog=self._rlog)

    def report_status(self) -> dict:
        stats = self._store_stats(fresh=True)
        with self._lock:
            in_flight = {op: f.in_flight for op, f in self._families.items()}
            locked = len(self._locks)
        health = self.health()
        # is_healthy: the adapter works (LMCache ANDs it into the server's health). A failing
        # backend does not make it unhealthy -- the server goes on serving from L1, and a
        # restart would not bring the backend back -- it shows in backend_ok instead.
        status: dict[str, Any] = {
            "is_healthy": not self._closed and not self.store.closed,
            "backend_ok": health["backend_ok"],
            "consecutive_failures": health["consecutive_failures"],
            "backend_reason": health["backend_reason"],
            "type": type(self).__name__,
            "store": self.store.name,
            "in_flight": in_flight,
            "locked_keys": locked,
            "lookup_timeouts": self.lookup_timeouts,
            "errors": self._errors.as_dict(),
        }
        # what `lmcache describe` shows (stored objects, used / capacity): the figures of
        # get_usage (the store's own where it knows them, see _init_usage)
        f = self.usage_figures(stats)
        with self._lock:
            count = len(self._sizes)
        status["stored_object_count"] = f["keys"] if f["keys"] is not None else count
        status["current_size_bytes"] = f["bytes_used"]
        status["max_capacity_bytes"] = f["capacity_bytes"]
        status["usage"] = {
            "bytes_used_from": f["bytes_used_from"], "capacity_from": f["capacity_from"], "stale": f["stale"],
            "usage_fraction": f["bytes_used"] / f["capacity_bytes"] if f["capacity_bytes"] > 0 else -1.0,
            "shared": self.shared, "global_eviction": self._global_eviction,
            "eviction_by": "lmcache" if self._global_eviction else "store",
        }
        if stats is not None:
            d = stats.as_dict()
            status["store_stats"] = {k: d[k] for k in (
                "put_written", "put_failed", "put_bytes", "get_hits", "get_pages", "get_bytes",
                "exists_keys", "exists_hits", "deletes", "errors", "keys", "bytes_used", "capacity_bytes")}
        return status

    def close(self) -> None:
        """Stop the workers (running tasks finish: their buffers stay valid until then),
        then close the store and the event fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watchdog_stop.set()
        self._watchdog.join(timeout=5)
        self._health.join(timeout=5)
        _unexport_health(self)
        for fam in self._families.values():
            fam.pool.shutdown(wait=True, cancel_futures=True)
        safe_call(self.store.close, default=None, what="lmcache.close", errors=self._errors, rlog=self._rlog)
        for fam in self._families.values():
            try:
                fam.notifier.close()
            except Exception:  # noqa: BLE001
                pass


# -- backend_ok as Prometheus gauges (served with the store's metrics: ``metrics_port``) --
_health_lock = threading.Lock()
_health_adapters: list[KVConnectL2Adapter] = []
_health_registered = False


class _HealthCollector:
    def describe(self) -> list:
        return []  # see connectors/metrics.py: without it, registering would collect

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        ok = GaugeMetricFamily("kvconnect_lmcache_backend_ok",
                               "1 while the L2 adapter's store answers (its calls and its stats), else 0; "
                               "reason: ok, closed, store_calls_failing, stats_failing",
                               labels=["store", "engine", "reason"])
        failing = GaugeMetricFamily("kvconnect_lmcache_backend_consecutive_failures",
                                    "store calls of the L2 adapter that failed in a row", labels=["store", "engine"])
        with _health_lock:
            adapters = list(_health_adapters)
        for a in adapters:
            h = a.health()
            ok.add_metric([a.store.name, "lmcache", h["backend_reason_kind"]], 1.0 if h["backend_ok"] else 0.0)
            failing.add_metric([a.store.name, "lmcache"], float(h["consecutive_failures"]))
        yield ok
        yield failing


def _export_health(adapter: KVConnectL2Adapter) -> None:
    global _health_registered
    with _health_lock:
        _health_adapters.append(adapter)
        if not _health_registered:
            from prometheus_client import REGISTRY

            REGISTRY.register(_HealthCollector())
            _health_registered = True


def _unexport_health(adapter: KVConnectL2Adapter) -> None:
    with _health_lock:
        _health_adapters[:] = [a for a in _health_adapters if a is not adapter]
