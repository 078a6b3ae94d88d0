"""SGLang HiCache L3 storage over any kvconnect ``PageStore``.

Load it into SGLang (0.5.23; imports cleanly with 0.5.17) with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"kvconnect",
        "module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage",
        "interface_v1":1,"store":"memory","capacity":"8gb"}'

The extra config holds ``store`` (a registry name, or ``"pkg.mod:Class"``), the store's
options inline (or nested under ``store_options``), and optionally ``tenant``,
``model_fingerprint``, ``metrics_port``, ``metrics_host``, ``kv_cache_dtype`` (the server's
``--kv-cache-dtype``, where SGLang's own server args cannot be read; see Keys) and
``write_behind`` (a size, e.g.
``"4gb"``: KV page writes are staged in a buffer that large and stored in the background, so a
store slower than the engine's write-through sheds pages instead of holding SGLang's host pool;
see ``write_behind``). SGLang's own keys are ignored.

The rank: ``engine_context`` reads SGLang's ``HiCacheStorageConfig`` (TP, PP, attention CP,
decode CP and DP ranks, MLA) into the ``EngineContext`` the store is built with; its
writer rule (SGLang's ``is_storage_writer``) decides which ranks write rank-replicated KV,
and clear / delete touch only what this rank writes. With rank-replicated KV on more than
one TP rank the store must be shared across processes (``Capability.SHARED``): the other
ranks read what the writer wrote.

Keys: what this adapter adds to SGLang's bare page hashes is a ``KeySpace`` per pool: model
(+ weights fingerprint), host layout, page size, the logical KV dtype and stored scale format
(from ``--kv-cache-dtype``: host pools keep every fp8 variant as ``uint8``), page geometry,
tp/pp/attn-cp ranks and pool, so two engines whose pages mean different bytes never read each
other's: an fp8 engine misses bf16 pages, an ``fp8_e5m2`` one ``fp8_e4m3`` pages. Each
pool holds a view of the store under its key space (``PrefixedStore``); MLA KV leaves the
TP rank out. Pool geometry is ``sglang_pools``; SGLang names that moved between releases
are ``sglang_shims``.

Legacy calls take pages as tensors (SGLang's flat pages: ``_generic_page_get`` /
``_generic_page_set``) or, as SGLang's ``MooncakeStore`` does, as addresses and sizes
(``target_location`` / ``target_sizes``: an int each, or lists of a page's segments), which
must lie inside a registered host pool's memory. In that form ``get`` answers a bool and
``batch_get`` the number of leading hits.

Nothing raises into SGLang's threads: data-path methods catch, count and log (rate-limited)
every exception and answer a miss / failed write. Configuration errors (unknown store, bad
option, unsupported layout, a store without a needed capability) raise at construction /
registration, naming the key and the accepted values.
"""

from __future__ import annotations

import functools
import logging
import numbers
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

from kvconnect.connectors.base import (
    Capability, ConfigError, MissingDependency, Page, StoreClosed, Unsupported, page_nbytes)
from kvconnect.connectors.config import parse_size
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import (
    ErrorCounter,
    RateLimitedLog,
    build_store,
    guarded,
    serve_store_metrics,
    start_stack_dumps,
    stop_stack_dumps,
)
from kvconnect.connectors.engines.kv_events import StoreEvents, events_config
from kvconnect.connectors.engines.sglang_pools import ADAPTER, PoolIO, describe_pool, pool_buffers, tensor_segment
from kvconnect.connectors.engines.sglang_shims import (
    KV,
    SGLANG_IMPORT_ERROR,
    HiCacheStorage,
    pool_name,
    pool_result,
    storage_metrics_class,
)
from kvconnect.connectors.engines.write_behind import WriteBehind
from kvconnect.connectors.views import exists_many, get_many, put_many
from kvconnect.namespace import KeySpace, logical_kv_dtype
from kvconnect.namespace.hits import HitPolicy, block_group_pages, leading_hits, restorable_prefixes
from kvconnect.namespace.keyspace import model_key

log = logging.getLogger("kvconnect.sglang_hicache")


class LookupToLoad:
    """Seconds from SGLang's lookup of a prefix (``batch_exists``) to the load of its first page
    (``batch_get_v1``/``_v2``): the prefetch's queueing between the two, inside SGLang, which
    SGLang does not report. Keyed by the prefix's first page; the newest ``keep`` lookups kept."""

    METRIC = "kvconnect_hicache_lookup_to_load_seconds"

    NOT_LOADED = "kvconnect_hicache_reported_not_loaded_pages"

    def __init__(self, keep: int = 4096):
        from collections import OrderedDict

        from kvconnect.connectors import metrics

        self._at: "OrderedDict[str, list]" = OrderedDict()  # first key -> [lookup time, pages reported]
        self._keep = keep
        self._lock = threading.Lock()
        self._hist = metrics.process_histogram(self.METRIC, "SGLang's wait from an L3 lookup to its load")
        self._not_loaded = metrics.process_counter(
            self.NOT_LOADED, "pages batch_exists reported that the following batch_get_v1 could not load "
                             "(deleted, evicted or failed in between: SGLang recomputes them)")
        self.not_loaded = 0  # this backend's share of that counter

    def looked_up(self, keys: List[str], hits: int = 0, at: Optional[float] = None) -> None:
        """A lookup of ``keys`` made at ``at`` (``perf_counter``; default now) that reported
        ``hits`` leading pages: one locked update per lookup."""
        if keys:
            with self._lock:
                self._at[keys[0]] = [time.perf_counter() if at is None else at, hits]
                self._at.move_to_end(keys[0])
                if len(self._at) > self._keep:
                    self._at.popitem(last=False)

    def loading(self, keys: List[str]) -> int:
        """Observe the wait; the pages the lookup of this prefix reported (0: none known)."""
        if keys:
            with self._lock:
                entry = self._at.pop(keys[0], None)
            if entry is not None:
                self._hist.observe(time.perf_counter() - entry[0])
                return entry[1]
        return 0

    def loaded(self, reported: int, ok: List[bool]) -> None:
        """Count the reported pages a load did not bring in as SGLang uses them (leading)."""
        missed = min(reported, len(ok)) - leading_hits(ok[:reported])
        if missed > 0:
            with self._lock:
                self.not_loaded += missed
            self._not_loaded.inc(missed)

# Keys of the extra config that belong to SGLang (it reads or pops them itself in 0.5.17 -
# 0.5.23); never passed to the store.
SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "file_storage_path", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "enable_metadata_cache", "metadata_ttl",
)


def engine_context(config: Any) -> EngineContext:
    """The ``EngineContext`` of the rank a SGLang ``HiCacheStorageConfig`` describes (fields
    a release lacks take their single-rank values)."""
    return EngineContext(
        engine="sglang-hicache", model=config.model_name or "",
        tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank, pp_size=config.pp_size,
        cp_rank=getattr(config, "attn_cp_rank", 0) or 0, cp_size=getattr(config, "attn_cp_size", 1) or 1,
        dcp_rank=getattr(config, "dcp_rank", 0) or 0, dcp_size=getattr(config, "dcp_size", 1) or 1,
        dp_rank=getattr(config, "dp_rank", 0) or 0, rank_replicated=bool(config.is_mla_model),
        pool="kv", device="cpu")  # the store moves host-pool pages


def base_keyspace(context: EngineContext, *, tenant: str = "", weights: str = "") -> KeySpace:
    """The engine rank's key space before a pool is known (model, ranks, tenant)."""
    if not context.model:
        log.warning("kvconnect: SGLang gave no model_name; keying pages on %r", model_key(""))
    return KeySpace(
        model=model_key(context.model), weights=weights, tenant=tenant,
        tp_rank=context.tp_rank, tp_size=context.tp_size, pp_rank=context.pp_rank, pp_size=context.pp_size,
        cp_rank=context.cp_rank, cp_size=context.cp_size, rank_replicated=context.rank_replicated)


def required_capabilities(context: EngineContext) -> dict[Capability, str]:
    """What a store must be able to do for this rank, and why."""
    if context.sharing_ranks > 1:
        return {Capability.SHARED: f"rank-replicated (MLA) KV needs: TP rank {context.writer_rank} writes it and "
                                   f"all {context.tp_size} TP ranks, each its own process, read it"}
    return {}


# ---------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------


def _misses(self, keys, *a, **k) -> List[bool]:
    return [False] * len(keys)


def _needs_store(method: Callable[..., List[bool]]) -> Callable[..., List[bool]]:
    """A v1 data call answered without the store where it needs none: no keys, none done;
    on a logical anchor (no host pool of its own), every key done."""

    @functools.wraps(method)
    def call(self, keys: List[str], *args: Any, **kwargs: Any) -> List[bool]:
        if not keys:
            return []
        if self.logical_anchor:
            return [True] * len(keys)
        return method(self, keys, *args, **kwargs)

    return call


def _none_per_key(self, keys, *a, **k) -> Any:
    """A failed legacy ``batch_get``: no page per key (tensor form) or 0 leading hits
    (address form)."""
    return 0 if _address_form(k.get("target_locations", a[0] if a else None)) else [None] * len(keys)


def _address_form(locations: Any) -> bool:
    """True where a legacy call's locations are addresses (ints, or lists of a page's
    segment addresses), not tensors."""
    return bool(locations) and all(isinstance(x, (numbers.Integral, list, tuple)) and not isinstance(x, bool)
                                   for x in locations)


def _mean_nbytes(pages: List[Any]) -> int:
    return sum(page_nbytes(p) for p in pages) // max(1, len(pages))


def _per_pool_misses(self, transfers, *a, **k) -> dict:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


CLOSE_WAIT_S = 1.0
"""How long ``close()`` waits for data-path calls still inside the store."""


def _in_flight(method: Callable[..., Any]) -> Callable[..., Any]:
    """A call that uses the store: refused (``StoreClosed``: a miss) once ``close()`` began,
    counted while it runs, so the store is never released under it (a store's mapped file or
    buffers would be freed under its copy)."""

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        with self._idle:
            if self._closed:
                raise StoreClosed(f"kvconnect backend on store {self.store.name!r} is closed")
            self._inflight += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._idle:
                self._inflight -= 1
                last = self._inflight == 0 and self._close_when_idle
                self._close_when_idle = self._close_when_idle and not last
                if self._closed:  # only close() waits (it sets _closed under this lock first)
                    self._idle.notify_all()
            if last:
                self._close_store()

    return call


class KVConnectStorage(HiCacheStorage):
    """A SGLang ``HiCacheStorage`` over a kvconnect ``PageStore`` (see module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        if SGLANG_IMPORT_ERROR is not None:
            raise MissingDependency(ADAPTER, "sglang", SGLANG_IMPORT_ERROR, kind="integration")
        self.storage_config = storage_config
        self._errors = ErrorCounter()
        self._rlog = RateLimitedLog(log)
        self.context = engine_context(storage_config)
        self.store, self.options = build_store(storage_config.extra_config or {}, where=ADAPTER,
                                               ignore=SGLANG_KEYS,
                                               engine_keys=("write_behind", "kv_cache_dtype", "kv_events"),
                                               context=self.context,
                                               require=required_capabilities(self.context))
        try:
            self.base_keyspace = base_keyspace(self.context, tenant=self.options.tenant,
                                               weights=self.options.model_fingerprint)
            self.kv_cache_dtype = self.options.extra.get("kv_cache_dtype")
            logical_kv_dtype(self.kv_cache_dtype, where=ADAPTER)  # a bad name fails here, naming the key
            self._events_config = events_config(self.options.extra.get("kv_events"), where=ADAPTER)
            wb = self.options.extra.get("write_behind", 0)
            self._write_behind_bytes = parse_size(0 if wb in (None, "", False) else wb, "write_behind", ADAPTER)
        except (ValueError, ConfigError):
            self.store.close()
            raise
        self._write_behind: Optional[WriteBehind] = None
        self._events: Optional[StoreEvents] = None  # KV events of the KV pool (kv_events.py)
        self.is_writer = self.context.is_writer
        self._pools: dict[str, PoolIO] = {}
        self.kv: Optional[PoolIO] = None
        self.logical_anchor = False
        self._registered: set[tuple[int, int]] = set()
        self._host_spans: List[tuple[int, int]] = []  # (start, end) of every registered pool buffer
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []
        self._closed = False
        self._idle = threading.Condition()
        self._inflight = 0
        self._close_when_idle = False
        self._lookups = LookupToLoad()
        self._metrics_port = None
        if self.options.metrics_port is not None:
            port = self.options.metrics_port
            if port:
                port += self.context.rank_index  # one endpoint per rank process
            self._metrics_port = serve_store_metrics(
                self.store, port, self.options.metrics_host, engine="sglang")
        log.info("kvconnect: SGLang HiCache storage on store %r: %s", self.store.name, self.context.describe())
        self._stack_dump = start_stack_dumps()

    # -- registration -------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", 0) is None:
            # DeepSeek-V4's logical anchor: no KV bytes of its own, side pools carry data.
            self.logical_anchor = True
            self.kv = None
            return
        self.kv = describe_pool(mem_pool_host, self.context, self.base_keyspace, "kv", self.store,
                                self.kv_cache_dtype)
        self._pools["kv"] = self.kv
        self._register_buffers(mem_pool_host)
        log.info("kvconnect: KV pages keyed as %s", self.kv.keyspace.describe())
        if self._events_config and self._events is None and self.context.tp_rank == 0 \
                and self.context.pp_rank == 0 and self.context.cp_rank == 0:  # SGLang's publisher ranks
            self._events = StoreEvents.create(self._events_config, dp_rank=self.context.dp_rank, where=ADAPTER)
            self._events.watch(self.kv.store, block_size=self.kv.pool.page_size)
        if self._write_behind_bytes and self.kv.is_writer and self._write_behind is None:
            self._write_behind = WriteBehind(self.kv.store, self._write_behind_bytes, self.kv.page_nbytes,
                                             put_from=self._put_fn(self.kv))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if name == "kv" and self.kv is not None and host_pool is self.kv.pool:
            return
        if name == "kv" and self.logical_anchor and getattr(host_pool, "kv_buffer", 0) is None:
            return
        io = describe_pool(host_pool, self.context, self.base_keyspace, name, self.store, self.kv_cache_dtype)
        self._pools[name] = io
        self._register_buffers(host_pool)
        log.info("kvconnect: %s pages keyed as %s", name, io.keyspace.describe())

    def on_host_pools_registered(self) -> None:
        """SGLang 0.5.23 calls this once every pool is registered; raising fails the attach.
        A backend with no KV pool (and no logical anchor standing for one) would answer
        every lookup with a miss: refuse the attach instead."""
        if self.kv is None and not self.logical_anchor:
            raise Unsupported("attaching without a KV host pool (register_mem_pool_host was never called)", ADAPTER)
        log.info("kvconnect: pools registered: %s", "; ".join(
            f"{n} ({'writer' if io.is_writer else 'reader'}) {io.keyspace.describe()}"
            for n, io in sorted(self._pools.items())) or "none")

    def _register_buffers(self, pool: Any) -> None:
        for t in pool_buffers(pool):
            span = (t.data_ptr(), t.numel() * t.element_size())
            if not span[1] or span in self._registered:
                continue
            if self.store.supports(Capability.NEEDS_REGISTERED_MEMORY):
                self.store.register_memory(*span)
            self._registered.add(span)
            self._host_spans.append((span[0], span[0] + span[1]))


    def _kv_io(self) -> PoolIO:
        if self.kv is None:
            raise RuntimeError("no KV host pool registered")
        return self.kv

    def _put_fn(self, io: PoolIO, parent: Optional[str] = None) -> Callable[[List[str], List[Page]], List[bool]]:
        """``io.store.put_from``, announcing what it stored where this pool's events are on."""
        if self._events is None or io is not self.kv:
            return io.store.put_from
        return lambda keys, pages: self._events.put(io.store.put_from, keys, pages, parent)

    def _get_fn(self, io: PoolIO) -> Callable[[List[str], List[Page]], List[bool]]:
        if self._events is None or io is not self.kv:
            return io.store.get_into
        return lambda keys, pages: self._events.get(io.store.get_into, keys, pages)

    # -- zero-copy v1 ---------------------------------------------------------------
    @guarded(_misses)
    @_in_flight
    @_needs_store
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        kv = self._kv_io()
        reported, ok = self._lookups.loading(keys), [False] * len(keys)
        t0 = time.perf_counter()
        try:
            pages, finish = kv.plan_read(keys, host_indices)
            ok = self._get_fn(kv)(keys, pages)
            finish(ok)
        finally:
            self._lookups.loaded(reported, ok)  # a load that raised counts as not loaded too
        self._record(True, leading_hits(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    @guarded(_misses)
    @_in_flight
    @_needs_store
    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        kv = self._kv_io()
        if not kv.is_writer:
            return [True] * len(keys)  # rank-replicated KV: the writer rank stores it
        t0 = time.perf_counter()
        pages, _keep = kv.plan_write(keys, host_indices)
        prefix = getattr(extra_info, "prefix_keys", None)
        ok = (self._write_behind.submit if self._write_behind else self._put_fn(kv, prefix[-1] if prefix else None))(
            keys, pages)
        self._record(False, sum(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    # -- legacy tensor path ---------------------------------------------------------
    def _read_tensors(self, keys: List[str], targets: List[Any]) -> List[bool]:
        kv = self._kv_io()
        work = [t if t.is_contiguous() else t.contiguous() for t in targets]
        t0 = time.perf_counter()
        ok = self._get_fn(kv)(keys, [[tensor_segment(t)] for t in work])
        for t, w, good in zip(targets, work, ok):
            if good and w is not t:
                t.copy_(w)
        self._record(True, leading_hits(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    def _write_tensors(self, keys: List[str], values: List[Any]) -> List[bool]:
        kv = self._kv_io()
        if not kv.is_writer:
            return [True] * len(keys)
        work = [v.contiguous() for v in values]
        t0 = time.perf_counter()
        ok = self._put_fn(kv)(keys, [[tensor_segment(v)] for v in work])
        self._record(False, sum(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    def _targets(self, n: int, given: Any) -> List[Any]:
        if given is not None and len(given) == n and all(t is not None for t in given):
            return list(given)
        kv = self._kv_io()
        if not kv.flat:
            raise Unsupported(f"a legacy read without targets into host pool {type(kv.pool).__name__}, which has "
                              "no flat page format", ADAPTER, ["target tensors", "target addresses and sizes"])
        return [kv.pool.get_dummy_flat_data_page() if given is None or given[i] is None else given[i]
                for i in range(n)]

    def _address_pages(self, n: int, locations: Any, sizes: Any) -> Optional[List[Page]]:
        """The pages of a legacy call given as addresses and sizes (``n`` of each; a page's
        location an int, or a list of its segments' addresses with a list of sizes), None
        where the call gives tensors or nothing. Every segment must lie inside a registered
        host pool buffer: an address elsewhere raises (the call then fails), it is never
        read or written."""
        if not _address_form(locations):
            return None
        if sizes is None or len(locations) != n or len(sizes) != n:
            raise ValueError(f"{n} pages given as addresses need {n} addresses and {n} sizes")
        pages: List[Page] = []
        for loc, size in zip(locations, sizes):
            if isinstance(loc, (list, tuple)):
                if not isinstance(size, (list, tuple)) or len(size) != len(loc):
                    raise ValueError(f"a page of {len(loc)} segment addresses needs as many sizes, got {size!r}")
                page = [(int(a), int(b)) for a, b in zip(loc, size)]
            else:
                page = [(int(loc), int(size))]
            for addr, nbytes in page:
                if nbytes <= 0 or not any(lo <= addr and addr + nbytes <= hi for lo, hi in self._host_spans):
                    raise ValueError(f"segment ({addr:#x}, {nbytes}) is not inside a registered host pool buffer")
            pages.append(page)
        return pages

    def _read_addresses(self, keys: List[str], pages: List[Page]) -> List[bool]:
        kv = self._kv_io()
        t0 = time.perf_counter()
        ok = self._get_fn(kv)(keys, pages)
        self._record(True, leading_hits(ok), _mean_nbytes(pages), time.perf_counter() - t0)
        return ok

    def _write_addresses(self, keys: List[str], pages: List[Page]) -> List[bool]:
        kv = self._kv_io()
        if not kv.is_writer:
            return [True] * len(keys)  # rank-replicated KV: the writer rank stores it
        t0 = time.perf_counter()
        ok = self._put_fn(kv)(keys, pages)
        self._record(False, sum(ok), _mean_nbytes(pages), time.perf_counter() - t0)
        return ok

    @guarded(lambda self, key, *a, **k: None)
    @_in_flight
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        pages = self._address_pages(1, None if target_location is None else [target_location],
                                    None if target_sizes is None else [target_sizes])
        if pages is not None:
            return self._read_addresses([key], pages)[0]
        target = self._targets(1, None if target_location is None else [target_location])[0]
        return target if self._read_tensors([key], [target])[0] else None

    @guarded(_none_per_key)
    @_in_flight
    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        if not keys:
            return []
        pages = self._address_pages(len(keys), target_locations, target_sizes)
        if pages is not None:
            return leading_hits(self._read_addresses(list(keys), pages))
        targets = self._targets(len(keys), target_locations)
        ok = self._read_tensors(list(keys), targets)
        return [t if good else None for t, good in zip(targets, ok)]

    @guarded(lambda self, *a, **k: False)
    @_in_flight
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            pages = self._address_pages(1, None if target_location is None else [target_location],
                                        None if target_sizes is None else [target_sizes])
            return pages is not None and self._write_addresses([key], pages)[0]
        return self._write_tensors([key], [value])[0]

    @guarded(lambda self, *a, **k: False)
    @_in_flight
    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if values is None:
            pages = self._address_pages(len(keys), target_locations, target_sizes)
            return pages is not None and all(self._write_addresses(list(keys), pages))
        if len(values) != len(keys) or any(v is None for v in values):
            return False
        return all(self._write_tensors(list(keys), list(values)))

    @guarded(lambda self, *a, **k: False)
    @_in_flight
    def exists(self, key: str) -> bool:
        return self._kv_io().store.exists([key])[0]

    @guarded(lambda self, *a, **k: 0)
    @_in_flight
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not keys or self.logical_anchor:
            return 0
        at = time.perf_counter()
        view = self._kv_io().store
        # the view's store asked for the view's keys (as exists_many does): one PageStore layer
        # on SGLang's lookup path, not two (the inner store checks the keys it is given)
        hits = leading_hits(view.inner.exists(view.inner_keys(keys)))
        self._lookups.looked_up(keys, hits, at)
        return hits

    # -- v2 pools ---------------------------------------------------------------------
    @guarded(lambda self, *a, **k: pool_result(0, {}, []))
    @_in_flight
    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Usable prefix across KV and side pools: SGLang 0.5.23 ``HiCacheFile`` semantics.

        KV: leading hits. Each side pool then removes the stop points it cannot serve
        (ALL_PAGES: past its own leading run; TRAILING_PAGES: where the window of
        ``len(transfer.keys)`` pages ending there is incomplete). BLOCK_GROUPS pools look up
        their own keys, in groups of ``group_pages`` per block of ``block_pages`` FULL pages,
        and report the FULL pages their leading complete groups cover; they gate nothing.
        ``kv_hit_pages`` is the longest stop point left; ``restorable_prefix_pages`` lists
        them all. One store round trip for the KV and every side pool.
        """
        transfers = list(pool_transfers or [])
        self._lookups.looked_up(keys)
        gating = [t for t in transfers if pool_name(t.name) in self._pools]
        calls = []
        if not self.logical_anchor and keys:
            calls.append((self._kv_io().store, keys))
        for t in gating:
            own = HitPolicy.parse(t.hit_policy) is HitPolicy.BLOCK_GROUPS
            calls.append((self._pools[pool_name(t.name)].store, list(t.keys or []) if own else keys))
        found = exists_many(calls) if calls else []
        if self.logical_anchor:
            kv_pages = len(keys)
        else:
            kv_pages = leading_hits(found.pop(0))

        hit_count: dict = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        per_pool = {id(t): present for t, present in zip(gating, found)}
        for t in transfers:
            if not restorable:
                break
            policy = HitPolicy.parse(t.hit_policy)
            if policy is HitPolicy.BLOCK_GROUPS:
                covered = block_group_pages(per_pool.get(id(t), []), int(getattr(t, "group_pages", 0) or 1),
                                            int(getattr(t, "block_pages", 0) or 0), span_pages=len(keys))
                if covered:
                    hit_count[t.name] = covered
                continue  # never gates the KV hit
            pool_present = per_pool.get(id(t), [False] * kv_pages)[:kv_pages]  # unregistered pool: nothing
            if policy is HitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                stops = restorable_prefixes(pool_present, policy, window)
            else:
                stops = restorable_prefixes(pool_present, HitPolicy.ALL_PAGES)
            if stops:
                hit_count[t.name] = stops[-1]
            keep = set(stops)
            restorable = [p for p in restorable if p in keep]
        final = restorable[-1] if restorable else 0
        return pool_result(final, hit_count, restorable)

    @guarded(_per_pool_misses)
    @_in_flight
    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        results: dict = {}
        calls, plans = [], []
        for t in transfers:
            if pool_name(t.name) == KV:
                self._lookups.loading(list(t.keys or []))
        for name, io, keys, (pages, finish) in self._planned(transfers, results, write=False):
            calls.append((io.store, keys, pages))
            plans.append((name, finish, io))
        token = self._events_begin(calls)
        for (_, keys, _), (name, finish, io), ok in zip(calls, plans, get_many(calls) if calls else []):
            finish(ok)
            results[name] = ok
            if io is self.kv and self._events is not None:
                self._events.loaded(list(keys), ok, token=token)
        return results

    @guarded(_per_pool_misses)
    @_in_flight
    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        results: dict = {}
        calls, names, keep = [], [], []
        for name, io, keys, (pages, staged) in self._planned(transfers, results, write=True):
            keep.append(staged)  # staged tensors live until the store call returned
            calls.append((io.store, keys, pages))
            names.append(name)
        token = self._events_begin(calls)
        prefix = getattr(extra_info, "prefix_keys", None)
        for (view, keys, _), name, ok in zip(calls, names, put_many(calls) if calls else []):
            results[name] = ok
            if self.kv is not None and view is self.kv.store and self._events is not None:
                self._events.stored(list(keys), ok, prefix[-1] if prefix else None, token=token)
        return results

    def _events_begin(self, calls: List[tuple]) -> Optional[list]:
        """``begin`` of the KV pool's call among a v2 batch's (None: no events or no KV call)."""
        if self._events is None or self.kv is None:
            return None
        for view, keys, _ in calls:
            if view is self.kv.store:
                return self._events.begin(list(keys))
        return None

    def _planned(self, transfers: List[Any], results: dict, write: bool) -> Iterator[tuple]:
        """(name, pool I/O, keys, plan) of each transfer its pool planned; the answers of the
        others go to ``results``: misses, or (a write to a replicated pool on a rank that is not
        its writer) all done, the writer rank stores it."""
        for t in transfers:
            keys = list(t.keys or [])
            io = self._pools.get(pool_name(t.name))
            if write and io is not None and keys and not io.is_writer:
                results[t.name] = [True] * len(keys)
                continue
            plan = None
            if io is not None and keys:
                plan = self._safe_plan(io.plan_write if write else io.plan_read, keys, t.host_indices, t.name)
            if plan is None:
                results[t.name] = [False] * len(keys)
                continue
            yield t.name, io, keys, plan

    def _safe_plan(self, plan: Callable, keys: List[str], host_indices: Any, name: Any) -> Any:
        """A pool's plan, or None (that pool misses; the other pools still run)."""
        try:
            return plan(keys, host_indices)
        except Exception as e:  # noqa: BLE001 - one bad transfer fails only itself
            self._errors.add("plan")
            self._rlog.error(f"plan:{pool_name(name)}", "kvconnect: pool %r transfer rejected: %s", pool_name(name), e)
            return None

    # -- management -------------------------------------------------------------------
    @guarded(lambda self, *a, **k: False)
    @_in_flight
    def clear(self) -> bool:
        """Remove what this rank owns: its pools' key spaces, where it writes them (a reader
        of rank-replicated KV leaves it to the writer). Other engines, tenants and ranks
        sharing the store keep their pages."""
        for io in self._pools.values():
            if io.is_writer:
                io.store.clear()
                if io is self.kv and self._events is not None:
                    self._events.cleared()
        return True

    @guarded(lambda self, keys, *a, **k: [False] * len(keys))
    @_in_flight
    def batch_delete(self, keys: List[str]) -> List[bool]:
        """Delete these page hashes from every pool this rank writes; True where a pool held one."""
        gone = [False] * len(keys)
        for io in self._pools.values():
            if io.is_writer and keys:
                deleted = io.store.delete(keys)
                if io is self.kv and self._events is not None:
                    self._events.removed(keys, deleted)
                gone = [a or b for a, b in zip(gone, deleted)]
        return gone

    def delete(self, key: str) -> bool:
        """One page hash (SGLang's ``HiCacheHF3FS.delete`` form)."""
        return self.batch_delete([key])[0]

    def close(self) -> None:
        """Refuse new calls (they miss), wait up to ``CLOSE_WAIT_S`` for those in flight, then
        release the store; where calls are still inside it, the last one out releases it."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout=CLOSE_WAIT_S):
                self._close_when_idle = True
                log.warning("kvconnect: %d call(s) still inside store %r at close; it closes when they return",
                            self._inflight, self.store.name)
                return
        self._close_store()

    def _close_store(self) -> None:
        try:
            from kvconnect.connectors import metrics

            if self._write_behind is not None:
                self._write_behind.close()
            if self._events is not None:
                self._events.close()
            stop_stack_dumps(self._stack_dump)

            metrics.unexport_store(self.store)
            self.store.close()
        except Exception as e:  # noqa: BLE001 - close never raises into SGLang
            log.error("kvconnect: closing store %r failed: %s", self.store.name, e)

    @guarded(lambda self, *a, **k: None)
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call)."""
        cls = storage_metrics_class()
        if cls is None:
            return None
        m = cls()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            self._prefetch_pgs.clear()
            self._backup_pgs.clear()
            self._prefetch_bw.clear()
            self._backup_bw.clear()
        return m

    def kvconnect_stats(self) -> dict:
        """The store's counters plus the errors this adapter turned into misses."""
        return {"store": self.store.stats().as_dict(), "adapter_errors": self._errors.as_dict(),
                "write_behind": self._write_behind.stats() if self._write_behind else None,
                "kv_events": dict(self._events.counts) if self._events else None,
                "reported_not_loaded_pages": self._lookups.not_loaded,
                "context": self.context.describe(),
                "keyspaces": {n: io.keyspace.describe() for n, io in self._pools.items()}}

    def _record(self, is_get: bool, pages: int, page_nbytes: int, seconds: float) -> None:
        if not getattr(self.storage_config, "enable_storage_metrics", False) or pages <= 0:
            return
        gbps = pages * page_nbytes / (1 << 30) / max(seconds, 1e-9)
        with self._metrics_lock:
            (self._prefetch_pgs if is_get else self._backup_pgs).append(pages)
            (self._prefetch_bw if is_get else self._backup_bw).append(gbps)

    def __repr__(self) -> str:
        return f"<KVConnectStorage store={self.store.name!r} pools={sorted(self._pools)}>"
