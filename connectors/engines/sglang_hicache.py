"""SGLang HiCache L3 storage over any kvconnect ``PageStore``.

Load it into SGLang (0.5.23; imports cleanly with 0.5.17) with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"kvconnect",
        "module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage",
        "interface_v1":1,"store":"memory","capacity":"8gb"}'

The extra config holds ``store`` (a registry name, or ``"pkg.mod:Class"``), the store's
options inline (or nested under ``store_options``), and optionally ``tenant``,
``model_fingerprint`` and ``metrics_port``. SGLang's own keys are ignored.

What this adapter adds to SGLang's bare page hashes is a ``KeySpace``: model (+ weights
fingerprint), host layout, page size, dtype, page geometry, tp/pp/attn-cp ranks and pool,
so two engines whose pages mean different bytes never read each other's. MLA KV (SGLang's
``is_mla_model``: rank-replicated) leaves the TP rank out: SGLang's storage writer
(``is_storage_writer``: TP rank 0, or the DCP rank's first replica) writes, every rank reads.

Byte order: a page's bytes are stored in the order of SGLang's flat page
(``get_data_page(flat=True)``) on every path, so pages written through the zero-copy v1
path, the legacy tensor path and the v2 pool path are interchangeable. The v1 path hands
the store the host pool's own addresses (``get_page_buffer_meta``), reordered where the
layout's segment order differs from the flat order (MHA ``layer_first``: all K layers,
then all V layers).

Nothing raises into SGLang's threads: data-path methods catch, count and log (rate-limited)
every exception and answer a miss / failed write. Configuration errors (unknown store, bad
option, unsupported layout) raise at construction / registration, naming the key and the
accepted values.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from kvconnect.connectors.base import MissingDependency, Page, PageStore, Unsupported
from kvconnect.connectors.engines.common import (
    ErrorCounter,
    RateLimitedLog,
    build_store,
    guarded,
    serve_store_metrics,
)
from kvconnect.namespace import KeySpace
from kvconnect.namespace.hits import HitPolicy, leading_hits, restorable_prefixes

log = logging.getLogger("kvconnect.sglang_hicache")

ADAPTER = "kvconnect sglang hicache"

# Keys of the extra config that belong to SGLang (it reads or pops them itself in 0.5.17 -
# 0.5.23); never passed to the store.
SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "file_storage_path", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "enable_metadata_cache", "metadata_ttl",
)

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# Side pools that are TP-sharded even when the model's KV is rank-replicated (SGLang's
# ``should_backup``: Mamba/KDA state is written by every TP rank).
RANK_SHARDED_POOLS = ("mamba",)

# ---------------------------------------------------------------------------------
# SGLang imports, guarded: names moved between releases.
# ---------------------------------------------------------------------------------

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: F401

    SGLANG_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as _e:  # sglang (or torch) not installed: the module still imports
    SGLANG_IMPORT_ERROR = _e
    torch = None  # type: ignore[assignment]

    class HiCacheStorage:  # type: ignore[no-redef]
        """Stand-in so this module imports without sglang; constructing raises."""


def _first_attr(modules: Sequence[str], name: str) -> Any:
    for m in modules:
        try:
            mod = importlib.import_module(m)
        except Exception:  # noqa: BLE001 - a module missing or failing in this version
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


_POOL_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",      # 0.5.17 - 0.5.23
    "sglang.srt.mem_cache.memory_pool_host",     # 0.5.10
)
PoolName = _first_attr(_POOL_MODULES, "PoolName")
PoolHitPolicy = _first_attr(_POOL_MODULES, "PoolHitPolicy")
PoolTransferResult = _first_attr(_POOL_MODULES, "PoolTransferResult")

_KV = PoolName.KV if PoolName is not None else "kv"


def _host_pool_classes() -> tuple[Any, Any]:
    """(MHATokenToKVPoolHost, MLATokenToKVPoolHost) of the installed sglang."""
    mha = _first_attr(("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host",
                       "sglang.srt.mem_cache.memory_pool_host"), "MHATokenToKVPoolHost")
    mla = _first_attr(("sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host",
                       "sglang.srt.mem_cache.memory_pool_host"), "MLATokenToKVPoolHost")
    return mha, mla


def _storage_metrics_class() -> Any:
    return _first_attr(("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"),
                       "StorageMetrics")


def _pool_result(kv_hit_pages: int, hits: dict, restorable: Optional[List[int]]) -> Any:
    """A ``PoolTransferResult``; 0.5.17's has no ``restorable_prefix_pages``."""
    fields = {f.name for f in dataclasses.fields(PoolTransferResult)}
    if "restorable_prefix_pages" in fields:
        return PoolTransferResult(kv_hit_pages, hits, restorable)
    return PoolTransferResult(kv_hit_pages, hits)


def _name(pool_name: Any) -> str:
    return str(getattr(pool_name, "value", pool_name))


def _tensor_segment(t: Any) -> tuple[int, int]:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a page tensor must be a contiguous CPU tensor")
    return (t.data_ptr(), t.numel() * t.element_size())


# ---------------------------------------------------------------------------------
# One registered host pool: its key space and how its pages map to segments.
# ---------------------------------------------------------------------------------

_PAGE_METHODS = ("get_page_buffer_meta", "get_data_page", "set_from_flat_data_page",
                 "get_dummy_flat_data_page", "init_kv_buffer")


def _uses_page_methods_of(pool: Any, cls: Any) -> bool:
    """True when ``pool``'s class keeps ``cls``'s page layout (overrides none of it)."""
    return cls is not None and isinstance(pool, cls) and all(
        getattr(type(pool), m, None) is getattr(cls, m, None) for m in _PAGE_METHODS)


@dataclass
class PoolIO:
    """Moves one host pool's pages to and from the store under its key space.

    ``zero_copy``: segments straight from ``get_page_buffer_meta`` (``kv_interleaved``:
    its per-layer K, V pairs are put in flat byte order, all K then all V). For the MHA and
    MLA pools, ``table`` computes the same segments with numpy instead of SGLang's loop over
    pages and layers (checked against ``get_page_buffer_meta`` at registration).
    Otherwise pages go through SGLang's flat page tensors (``get_data_page`` /
    ``set_from_flat_data_page``): one copy per page, used for pools whose segment order is
    not known to match the flat order (Mamba, indexer...).
    """

    name: str
    pool: Any
    keyspace: KeySpace
    stride: int  # host token slots per key (SGLang's logical page size)
    page_nbytes: int
    zero_copy: bool
    segs_per_page: int = 1
    kv_interleaved: bool = False
    table: Optional["SegmentTable"] = None

    @property
    def is_writer(self) -> bool:
        return self.keyspace.is_writer

    def check_indices(self, keys: Sequence[str], host_indices: Any) -> None:
        n = int(host_indices.numel()) if host_indices is not None else 0
        if n != len(keys) * self.stride:
            raise ValueError(f"pool {self.name!r}: {n} host indices for {len(keys)} keys "
                             f"(expected {len(keys) * self.stride})")

    def zero_copy_pages(self, host_indices: Any, n: int) -> List[Page]:
        if self.table is not None:
            return self.table.pages(host_indices[:: self.stride])
        return self.meta_pages(host_indices, n)

    def meta_pages(self, host_indices: Any, n: int) -> List[Page]:
        """Pages from SGLang's ``get_page_buffer_meta``, in flat byte order."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per = self.segs_per_page
        if len(ptrs) != n * per or len(sizes) != len(ptrs):
            raise RuntimeError(f"pool {self.name!r}: get_page_buffer_meta gave {len(ptrs)} segments "
                               f"for {n} pages, expected {n * per}")
        pairs = list(zip(ptrs, sizes))
        if per == 1:
            return [[p] for p in pairs]
        if self.kv_interleaved:
            return [pairs[i:i + per:2] + pairs[i + 1:i + per:2] for i in range(0, len(pairs), per)]
        return [pairs[i:i + per] for i in range(0, len(pairs), per)]

    def plan_read(self, keys: Sequence[str], host_indices: Any
                  ) -> tuple[List[Page], Callable[[List[bool]], None]]:
        """Pages to fill and what to do once filled (flat path: copy into the pool)."""
        self.check_indices(keys, host_indices)
        n = len(keys)
        if self.zero_copy:
            return self.zero_copy_pages(host_indices, n), lambda ok: None
        targets = [self.pool.get_dummy_flat_data_page() for _ in range(n)]
        starts = host_indices[:: self.stride].tolist()

        def finish(ok: List[bool]) -> None:
            for start, page, good in zip(starts, targets, ok):
                if good:
                    self.pool.set_from_flat_data_page(start, page)

        return [[_tensor_segment(t)] for t in targets], finish

    def plan_write(self, keys: Sequence[str], host_indices: Any) -> tuple[List[Page], List[Any]]:
        """Pages to store; the second item keeps staged tensors alive during the call."""
        self.check_indices(keys, host_indices)
        if self.zero_copy:
            return self.zero_copy_pages(host_indices, len(keys)), []
        staged = [self.pool.get_data_page(s, flat=True).contiguous()
                  for s in host_indices[:: self.stride].tolist()]
        return [[_tensor_segment(t)] for t in staged], staged


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"


def _flat_page_nbytes(pool: Any) -> int:
    t = pool.get_dummy_flat_data_page()
    return int(t.numel() * t.element_size())


def _describe_pool(pool: Any, config: Any, base: KeySpace, name: str) -> PoolIO:
    """Build the ``PoolIO`` of one host pool, or raise ``Unsupported``."""
    mha_cls, mla_cls = _host_pool_classes()
    layout = getattr(pool, "layout", None)
    page_size = int(getattr(pool, "page_size", 1) or 1)
    stride = int(getattr(pool, "logical_page_size", page_size) or page_size)
    what = f"host pool {name!r} ({type(pool).__name__}, layout {layout!r})"
    replicated = bool(config.is_mla_model) and name not in RANK_SHARDED_POOLS
    dcp_size = int(getattr(config, "dcp_size", 1) or 1)

    if _uses_page_methods_of(pool, mha_cls):
        if layout not in MHA_LAYOUTS:
            raise Unsupported(f"{what}: layout {layout!r}", ADAPTER, MHA_LAYOUTS)
        v_head_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_head_dim != pool.head_dim:
            raise Unsupported(f"{what}: head_dim {pool.head_dim} != v_head_dim {v_head_dim}", ADAPTER)
        geometry = f"mha:L{pool.layer_num}:H{pool.head_num}:D{pool.head_dim}"
        zero_copy = True
    elif _uses_page_methods_of(pool, mla_cls):
        if layout not in MLA_LAYOUTS:
            raise Unsupported(f"{what}: layout {layout!r}", ADAPTER, MLA_LAYOUTS)
        geometry = f"mla:L{pool.layer_num}:D{pool.kv_cache_dim}"
        zero_copy = True
    else:
        # Any other pool (Mamba state, DSA indexer, a subclass with its own page format):
        # through SGLang's flat pages, under its class name so formats never mix.
        try:
            _flat_page_nbytes(pool)
            pool.get_data_page(0, flat=True)
        except Exception as e:  # noqa: BLE001 - the pool cannot hand out pages at all
            raise Unsupported(f"{what}: it has no storage page format ({type(e).__name__}: {e})",
                              ADAPTER, [f"MHA: {', '.join(MHA_LAYOUTS)}", f"MLA: {', '.join(MLA_LAYOUTS)}",
                                        "pools with flat data pages"]) from e
        geometry = f"{type(pool).__module__}.{type(pool).__name__}"
        zero_copy = False

    if getattr(pool, "kv_buffer", 0) is None:
        raise Unsupported(f"{what}: it has no host buffer", ADAPTER)
    page_nbytes = _flat_page_nbytes(pool)
    segs_per_page, interleaved = 1, False
    if zero_copy:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(stride, dtype=torch.int64))
        if sum(sizes) != page_nbytes:
            raise Unsupported(f"{what}: its {len(sizes)} page segments hold {sum(sizes)} bytes, "
                              f"its flat page {page_nbytes}", ADAPTER)
        segs_per_page = len(ptrs)
        # MHA layer_first segments come as k0, v0, k1, v1, ...; the flat page is all K
        # layers, then all V layers.
        interleaved = geometry.startswith("mha") and layout == "layer_first"
    geometry += f":B{page_nbytes}"
    if dcp_size > 1:
        geometry += f":dcp{config.dcp_rank}of{dcp_size}:tp{config.tp_size}:lp{stride}"
    ks = dataclasses.replace(
        base, pool=name, layout=str(layout or "none"), page_size=page_size,
        dtype=_dtype_name(getattr(pool, "dtype", None)), geometry=geometry,
        rank_replicated=replicated)
    io = PoolIO(name=name, pool=pool, keyspace=ks, stride=stride, page_nbytes=page_nbytes,
                zero_copy=zero_copy, segs_per_page=segs_per_page, kv_interleaved=interleaved)
    if zero_copy and dcp_size == 1 and segs_per_page > 2:
        # With one or two segments a page SGLang's loop is as cheap as numpy.
        io.table = SegmentTable.checked(io, geometry.split(":")[0])
    return io


class SegmentTable:
    """Segments of standard MHA / MLA host pools, computed with numpy in flat byte order.

    Page starting at token slot ``s``: segment ``j`` is at ``base + s * per_token + offsets[j]``
    and ``sizes[j]`` long. Mirrors ``get_page_buffer_meta`` (whose Python loop over pages and
    layers costs ~12 ms per 128-page batch of a 61-layer ``layer_first`` pool) and is
    compared with it at registration; on any difference the adapter uses SGLang's.
    """

    def __init__(self, base: int, per_token: int, offsets: List[int], sizes: List[int]):
        import numpy as np

        self.base = base
        self.per_token = per_token
        self.offsets = np.asarray(offsets, dtype=np.int64) + base
        self.sizes = list(sizes)

    @classmethod
    def for_pool(cls, pool: Any, kind: str) -> Optional["SegmentTable"]:
        layout, size, P, L = pool.layout, pool.size, pool.page_size, pool.layer_num
        isz = pool.dtype.itemsize
        base = pool.kv_buffer.data_ptr()
        if kind == "mha":
            row = pool.head_num * pool.head_dim * isz  # one token of one layer, K or V
            v_off = L * size * row
            if layout in ("page_first", "page_first_direct", "page_head"):
                return cls(base, L * row, [0, v_off], [L * P * row] * 2)
            if layout == "layer_first":
                ks = [layer * size * row for layer in range(L)]
                return cls(base, row, ks + [k + v_off for k in ks], [P * row] * (2 * L))
        elif kind == "mla":
            row = pool.kv_cache_dim * isz
            if layout in ("page_first", "page_first_direct"):
                return cls(base, L * row, [0], [L * P * row])
            if layout == "layer_first":
                return cls(base, row, [layer * size * row for layer in range(L)], [P * row] * L)
        return None

    @classmethod
    def checked(cls, io: "PoolIO", kind: str) -> Optional["SegmentTable"]:
        """The table if it reproduces ``get_page_buffer_meta`` on probe pages, else None."""
        try:
            table = cls.for_pool(io.pool, kind)
            if table is None:
                return None
            pages = io.pool.size // io.stride
            probe = sorted({0, 1 % pages, pages // 2, pages - 1})
            idx = torch.cat([torch.arange(p * io.stride, (p + 1) * io.stride, dtype=torch.int64) for p in probe])
            if table.pages(idx[:: io.stride]) == io.meta_pages(idx, len(probe)):
                return table
            log.warning("kvconnect: %s segment table differs from get_page_buffer_meta; using SGLang's",
                        io.name)
        except Exception as e:  # noqa: BLE001 - the fast path is optional
            log.warning("kvconnect: no segment table for %s: %s", io.name, e)
        return None

    def pages(self, starts: Any) -> List[Page]:
        import numpy as np

        s = np.asarray(starts.numpy() if hasattr(starts, "numpy") else starts, dtype=np.int64)
        ptrs = (s[:, None] * self.per_token + self.offsets[None, :]).tolist()
        sizes = self.sizes
        return [list(zip(row, sizes)) for row in ptrs]


def _pool_buffers(pool: Any) -> List[Any]:
    """Host tensors a transport must register to move this pool's pages zero-copy."""
    buf = getattr(pool, "kv_buffer", None)
    if buf is None:
        return []
    return list(buf) if isinstance(buf, (list, tuple)) else [buf]


def base_keyspace(config: Any, *, tenant: str = "", weights: str = "") -> KeySpace:
    """The engine rank's key space before a pool is known (model, ranks, tenant)."""
    model = config.model_name
    if not model:
        log.warning("kvconnect: SGLang gave no model_name; keying pages on 'unnamed-model'")
        model = "unnamed-model"
    writer_rank = int(getattr(config, "dcp_rank", 0) or 0)  # is_storage_writer: tp_rank == dcp_rank
    return KeySpace(
        model=model, weights=weights, tenant=tenant,
        tp_rank=config.tp_rank, tp_size=config.tp_size,
        pp_rank=config.pp_rank, pp_size=config.pp_size,
        cp_rank=getattr(config, "attn_cp_rank", 0), cp_size=getattr(config, "attn_cp_size", 1),
        rank_replicated=bool(config.is_mla_model), writer_rank=writer_rank)


# ---------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------


def _misses(self, keys, *a, **k) -> List[bool]:
    return [False] * len(keys)


def _none_per_key(self, keys, *a, **k) -> List[None]:
    return [None] * len(keys)


def _per_pool_misses(self, transfers, *a, **k) -> dict:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


class KVConnectStorage(HiCacheStorage):
    """A SGLang ``HiCacheStorage`` over a kvconnect ``PageStore`` (see module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        if SGLANG_IMPORT_ERROR is not None:
            raise MissingDependency("sglang hicache adapter", "sglang", SGLANG_IMPORT_ERROR)
        self.storage_config = storage_config
        self._errors = ErrorCounter()
        self._rlog = RateLimitedLog(log)
        self.store, self.options = build_store(storage_config.extra_config or {}, where=ADAPTER,
                                               ignore=SGLANG_KEYS)
        try:
            self.base_keyspace = base_keyspace(storage_config, tenant=self.options.tenant,
                                               weights=self.options.model_fingerprint)
        except ValueError:
            self.store.close()
            raise
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer) if writer is not None else self.base_keyspace.is_writer
        self._pools: dict[str, PoolIO] = {}
        self.kv: Optional[PoolIO] = None
        self.logical_anchor = False
        self._registered: set[tuple[int, int]] = set()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []
        self._closed = False
        self._metrics_port = None
        if self.options.metrics_port is not None:
            port = self.options.metrics_port
            if port:
                port += self._rank_index()
            self._metrics_port = serve_store_metrics(
                self.store, port, engine="sglang",
                rank=f"tp{storage_config.tp_rank}pp{storage_config.pp_rank}")
        log.info("kvconnect: SGLang HiCache storage on store %r (tp %d/%d, %s)", self.store.name,
                 storage_config.tp_rank, storage_config.tp_size,
                 "MLA: writer" if storage_config.is_mla_model and self.is_writer
                 else "MLA: reader" if storage_config.is_mla_model else "MHA")

    def _rank_index(self) -> int:
        c = self.storage_config
        cp, cps = getattr(c, "attn_cp_rank", 0), getattr(c, "attn_cp_size", 1)
        return ((getattr(c, "dp_rank", 0) * c.pp_size + c.pp_rank) * cps + cp) * c.tp_size + c.tp_rank

    # -- registration -------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", 0) is None:
            # DeepSeek-V4's logical anchor: no KV bytes of its own, side pools carry data.
            self.logical_anchor = True
            self.kv = None
            return
        self.kv = _describe_pool(mem_pool_host, self.storage_config, self.base_keyspace, "kv")
        self._pools["kv"] = self.kv
        self._register_buffers(mem_pool_host)
        log.info("kvconnect: KV pages keyed as %s", self.kv.keyspace.describe())

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _name(host_pool_name)
        if name == "kv" and self.kv is not None and host_pool is self.kv.pool:
            return
        if name == "kv" and self.logical_anchor and getattr(host_pool, "kv_buffer", 0) is None:
            return
        io = _describe_pool(host_pool, self.storage_config, self.base_keyspace, name)
        self._pools[name] = io
        self._register_buffers(host_pool)
        log.info("kvconnect: %s pages keyed as %s", name, io.keyspace.describe())

    def on_host_pools_registered(self) -> None:
        log.info("kvconnect: pools registered: %s", ", ".join(sorted(self._pools)) or "none")

    def _register_buffers(self, pool: Any) -> None:
        if not self.store.needs_registered_memory:
            return
        for t in _pool_buffers(pool):
            span = (t.data_ptr(), t.numel() * t.element_size())
            if span[1] and span not in self._registered:
                self.store.register_memory(*span)
                self._registered.add(span)

    def _pool(self, name: Any) -> PoolIO:
        io = self._pools.get(_name(name))
        if io is None:
            raise KeyError(f"pool {_name(name)!r} was never registered")
        return io

    def _kv_io(self) -> PoolIO:
        if self.kv is None:
            raise RuntimeError("no KV host pool registered")
        return self.kv

    # -- zero-copy v1 ---------------------------------------------------------------
    @guarded(_misses)
    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if self.logical_anchor:
            return [True] * len(keys)
        kv = self._kv_io()
        t0 = time.perf_counter()
        pages, finish = kv.plan_read(keys, host_indices)
        ok = self.store.get_into(kv.keyspace.keys(keys), pages)
        finish(ok)
        self._record(True, leading_hits(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    @guarded(_misses)
    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if self.logical_anchor:
            return [True] * len(keys)
        kv = self._kv_io()
        if not kv.is_writer:
            return [True] * len(keys)  # rank-replicated KV: the writer rank stores it
        t0 = time.perf_counter()
        pages, _keep = kv.plan_write(keys, host_indices)
        ok = self.store.put_from(kv.keyspace.keys(keys), pages)
        self._record(False, sum(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    # -- legacy tensor path ---------------------------------------------------------
    def _read_tensors(self, keys: List[str], targets: List[Any]) -> List[bool]:
        kv = self._kv_io()
        work = [t if t.is_contiguous() else t.contiguous() for t in targets]
        t0 = time.perf_counter()
        ok = self.store.get_into(kv.keyspace.keys(keys), [[_tensor_segment(t)] for t in work])
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
        ok = self.store.put_from(kv.keyspace.keys(keys), [[_tensor_segment(v)] for v in work])
        self._record(False, sum(ok), kv.page_nbytes, time.perf_counter() - t0)
        return ok

    def _targets(self, n: int, given: Any) -> List[Any]:
        if given is not None and len(given) == n and all(t is not None for t in given):
            return list(given)
        kv = self._kv_io()
        return [kv.pool.get_dummy_flat_data_page() if given is None or given[i] is None else given[i]
                for i in range(n)]

    @guarded(lambda self, key, *a, **k: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        target = self._targets(1, None if target_location is None else [target_location])[0]
        return target if self._read_tensors([key], [target])[0] else None

    @guarded(_none_per_key)
    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        if not keys:
            return []
        targets = self._targets(len(keys), target_locations)
        ok = self._read_tensors(list(keys), targets)
        return [t if good else None for t, good in zip(targets, ok)]

    @guarded(lambda self, *a, **k: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            return False
        return self._write_tensors([key], [value])[0]

    @guarded(lambda self, *a, **k: False)
    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if values is None or len(values) != len(keys) or any(v is None for v in values):
            return False
        return all(self._write_tensors(list(keys), list(values)))

    @guarded(lambda self, *a, **k: False)
    def exists(self, key: str) -> bool:
        return self.store.exists(self._kv_io().keyspace.keys([key]))[0]

    @guarded(lambda self, *a, **k: 0)
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not keys or self.logical_anchor:
            return 0
        return leading_hits(self.store.exists(self._kv_io().keyspace.keys(keys)))

    # -- v2 pools ---------------------------------------------------------------------
    @guarded(lambda self, *a, **k: _pool_result(0, {}, []))
    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Usable prefix across KV and side pools: SGLang 0.5.23 ``HiCacheFile`` semantics.

        KV: leading hits. Each side pool then removes the stop points it cannot serve
        (ALL_PAGES: past its own leading run; TRAILING_PAGES: where the window of
        ``len(transfer.keys)`` pages ending there is incomplete). BLOCK_GROUPS pools
        report their own verdict and gate nothing. ``kv_hit_pages`` is the longest stop
        point left; ``restorable_prefix_pages`` lists them all.
        """
        transfers = list(pool_transfers or [])
        gating = [t for t in transfers if _name(t.name) in self._pools]
        # One store round trip for KV and every side pool.
        lookups: List[str] = []
        if not self.logical_anchor and keys:
            lookups += self._kv_io().keyspace.keys(keys)
        for t in gating:
            lookups += self._pools[_name(t.name)].keyspace.keys(keys)
        present = self.store.exists(lookups) if lookups else []
        off = 0
        if self.logical_anchor:
            kv_pages = len(keys)
        else:
            kv_pages = leading_hits(present[: len(keys)])
            off = len(keys)

        hit_count: dict = {_KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        per_pool = {}
        for t in gating:
            per_pool[id(t)] = present[off: off + len(keys)][:kv_pages]
            off += len(keys)
        for t in transfers:
            if not restorable:
                break
            policy = HitPolicy.parse(t.hit_policy)
            pool_present = per_pool.get(id(t), [False] * kv_pages)  # unregistered pool: nothing
            if policy is HitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                stops = restorable_prefixes(pool_present, policy, window)
            elif policy is HitPolicy.BLOCK_GROUPS:
                group = max(1, int(getattr(t, "group_pages", 0) or 1))
                stops = restorable_prefixes(pool_present, policy, group_pages=group)
                if stops:
                    hit_count[t.name] = stops[-1]
                continue  # never gates the KV hit
            else:
                stops = restorable_prefixes(pool_present, HitPolicy.ALL_PAGES)
            if stops:
                hit_count[t.name] = stops[-1]
            keep = set(stops)
            restorable = [p for p in restorable if p in keep]
        final = restorable[-1] if restorable else 0
        return _pool_result(final, hit_count, restorable)

    @guarded(_per_pool_misses)
    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        results: dict = {}
        all_keys: List[str] = []
        all_pages: List[Page] = []
        plans = []
        for t in transfers:
            keys = list(t.keys or [])
            io = self._pools.get(_name(t.name))
            plan = None
            if io is not None and keys:
                plan = self._safe_plan(io.plan_read, keys, t.host_indices, t.name)
            if plan is None:
                results[t.name] = [False] * len(keys)
                continue
            pages, finish = plan
            plans.append((t.name, len(all_keys), len(keys), finish))
            all_keys += io.keyspace.keys(keys)
            all_pages += pages
        ok = self.store.get_into(all_keys, all_pages) if all_keys else []
        for name, start, n, finish in plans:
            res = ok[start: start + n]
            finish(res)
            results[name] = res
        return results

    @guarded(_per_pool_misses)
    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        results: dict = {}
        all_keys: List[str] = []
        all_pages: List[Page] = []
        keep: List[Any] = []
        spans = []
        for t in transfers:
            keys = list(t.keys or [])
            io = self._pools.get(_name(t.name))
            if io is not None and keys and not io.is_writer:
                results[t.name] = [True] * len(keys)  # replicated pool: the writer rank stores it
                continue
            plan = None
            if io is not None and keys:
                plan = self._safe_plan(io.plan_write, keys, t.host_indices, t.name)
            if plan is None:
                results[t.name] = [False] * len(keys)
                continue
            pages, staged = plan
            keep.append(staged)
            spans.append((t.name, len(all_keys), len(keys)))
            all_keys += io.keyspace.keys(keys)
            all_pages += pages
        ok = self.store.put_from(all_keys, all_pages) if all_keys else []
        for name, start, n in spans:
            results[name] = ok[start: start + n]
        return results

    def _safe_plan(self, plan: Callable, keys: List[str], host_indices: Any, name: Any) -> Any:
        """A pool's plan, or None (that pool misses; the other pools still run)."""
        try:
            return plan(keys, host_indices)
        except Exception as e:  # noqa: BLE001 - one bad transfer fails only itself
            self._errors.add("plan")
            self._rlog.error(f"plan:{_name(name)}", "kvconnect: pool %r transfer rejected: %s", _name(name), e)
            return None

    # -- management -------------------------------------------------------------------
    @guarded(lambda self, *a, **k: False)
    def clear(self) -> bool:
        self.store.clear()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            from kvconnect.connectors import metrics

            metrics.unexport_store(self.store)
            self.store.close()
        except Exception as e:  # noqa: BLE001 - close never raises into SGLang
            log.error("kvconnect: closing store %r failed: %s", self.store.name, e)

    @guarded(lambda self, *a, **k: None)
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call)."""
        cls = _storage_metrics_class()
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
