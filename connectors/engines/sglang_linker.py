"""SGLang 0.5.23's unified-cache external linker over any kvconnect ``PageStore``.

The linker moves KV between SGLang's *device* pools and a store directly, with no HiCache
host pool in between; it is the path SGLang takes for hybrid models (Mamba state, SWA side
pools) and for rank-deduplicated MLA. Load it with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic \\
    --unified-cache-external-linker-config '{"linker": "KVConnectLinker",
        "linker_module_path": "kvconnect.connectors.engines.sglang_linker",
        "linker_extra_config": {"store": "memory", "capacity": "8gb"}}'

``linker_extra_config`` is the HiCache adapter's extra config without SGLang's backend keys:
``store`` (a registry name or ``"pkg.mod:Class"``), the store's options inline (or under
``store_options``), ``tenant``, ``model_fingerprint``, ``metrics_port``, ``metrics_host``, and
the linker's own ``layer_groups``, ``lookup_timeout_s`` and ``staging`` (see ``LinkerOptions``).

Pools: SGLang's ``resolve_hybrid_device_pool_group`` for the models it assembles (FULL +
Mamba, FULL + SWA + Mamba, DSA, DeepSeek-V4); for plain MHA / MLA KV and FULL + SWA, which
SGLang 0.5.23 assembles for no linker, the same ``DevicePoolEntry`` views built here
(``device_pool_group``). Every physical pool is its own key space (``kv``, ``swa``,
``mamba``, ...).

Keys: SGLang's own page hashes (the tree salts them with the request's ``extra_key`` /
``cache_salt``) under the HiCache adapter's key spaces (``sglang_pools.pool_keyspace``). A
KV page is its segments in ``get_page_buffer_meta`` order, all K layers then all V layers
(MLA: all layers), which is the flat page of a ``layer_first`` host pool: pages the linker
stores are the pages the HiCache adapter stores from a ``layer_first`` host pool of the same
model, geometry and dtype, and the other way round. Other host layouts order a page's bytes
differently and so are other key spaces. Side pools (SWA, Mamba) are keyed by the linker's
own device-row geometry and shared with linkers only.

Rank-replicated pools (MLA): the TP rank is left out of the key, the writer rank (TP rank 0)
offloads, every rank loads. A TP-sharded side pool (Mamba) keeps its rank.

Layer-wise load: with ``layer_groups`` = G > 1 a page is stored as G keys, one per group of
consecutive layers; a load reads the groups in order and releases each group's layers to
the forward (``layer_done_counter``) as soon as they land, over any store. G = 1 (default)
keeps one key per page, shared with the HiCache adapter; all layers land together.

Failures: nothing raises into SGLang's threads. A lookup runs under ``lookup_timeout_s``
(it is on the scheduler's thread): a store that raises or does not answer in time is a miss,
and while one lookup is stuck the next ones miss at once. A load that raises or misses a
page fails its batch (SGLang aborts those requests rather than use their KV). With host
staging a batch fails at ``load_timeout_s`` and late pages are dropped; without it the store
writes the slots itself, so its own I/O timeouts bound the load (SGLang may free the slots only
once nothing writes into them). An offload that fails is reported failed (the node stays
unstored).

Staging (``staging``): a store that cannot reach the pools' memory (on a GPU: one without
``device_memory``) reads and writes pages in reused host buffers, copied to and from the device
buffers (``HostStaging``); the pages are the same bytes as direct ones.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any, Dict, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
    DevicePoolEntry,
    DevicePoolGroup,
    resolve_hybrid_device_pool_group,
)
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from kvconnect.connectors.base import Capability, ConfigError, Page
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import ErrorCounter, RateLimitedLog, build_store, serve_store_metrics
from kvconnect.connectors.engines.kv_events import StoreEvents, events_config
from kvconnect.connectors.engines.sglang_hicache import base_keyspace, required_capabilities
from kvconnect.connectors.engines.sglang_pools import RANK_SHARDED_POOLS, kv_geometry, pool_keyspace
from kvconnect.connectors.engines.sglang_shims import pool_name
from kvconnect.connectors.views import PrefixedStore, exists_many, get_many, put_many
from kvconnect.namespace.hits import HitPolicy, restorable_prefixes

log = logging.getLogger("kvconnect.sglang_linker")

ADAPTER = "kvconnect sglang linker"
LINKER_KEYS = ("layer_groups", "lookup_timeout_s", "load_timeout_s", "staging", "kv_cache_dtype", "kv_events")
STAGING = ("auto", "host", "off")


@dataclass(frozen=True)
class LinkerOptions:
    """The linker's own keys of ``linker_extra_config``."""

    layer_groups: int = 1
    """Keys per page, one per group of consecutive layers (1: one key per page, shared with
    the HiCache adapter; G > 1: layer-wise loads, each group released as it lands)."""
    lookup_timeout_s: float = 1.0
    """How long a lookup (on SGLang's scheduler thread) waits for the store; then a miss."""
    load_timeout_s: float = 30.0
    """With staging, how long a load batch may take; then it fails (SGLang aborts its
    requests) and bytes the store delivers later are dropped, never copied to the device.
    Without staging the store writes the device slots itself: a load ends when the store's
    own I/O timeouts end it."""
    staging: str = "auto"
    """Where the store reads and writes pages: ``"off"``, straight in the device pools (on an
    accelerator the store needs ``device_memory``); ``"host"``, in host staging memory, copied
    to and from the pools one indexed copy per buffer; ``"auto"``, host staging only where the
    store cannot reach the pools' memory."""

    @classmethod
    def parse(cls, extra: dict, num_layers: int) -> "LinkerOptions":
        groups = extra.get("layer_groups", 1)
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_layers:
            raise ConfigError("layer_groups", f"expected an integer, got {groups!r}",
                              f"1..{num_layers} (the model's transfer layers)", ADAPTER)
        timeout = extra.get("lookup_timeout_s", 1.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
            raise ConfigError("lookup_timeout_s", f"expected seconds, got {timeout!r}", "a number in (0, 60]", ADAPTER)
        load_timeout = extra.get("load_timeout_s", 30.0)
        if isinstance(load_timeout, bool) or not isinstance(load_timeout, (int, float)) or not 0 < load_timeout <= 600:
            raise ConfigError("load_timeout_s", f"expected seconds, got {load_timeout!r}", "a number in (0, 600]",
                              ADAPTER)
        staging = extra.get("staging", "auto")
        if staging not in STAGING:
            raise ConfigError("staging", f"unknown value {staging!r}", ", ".join(STAGING), ADAPTER)
        return cls(groups, float(timeout), float(load_timeout), staging)


class LinkerCounts:
    """What the linkers of this process did: per linker (``counts[name]``) and as the process's
    Prometheus counters ``kvconnect_linker_<name>_total``."""

    HELP = {
        "lookups": "linker lookups the store answered",
        "lookup_hit_pages": "pages of the longest restorable prefix of each lookup",
        "lookup_timeouts": "linker lookups that missed because the store gave no answer in time",
        "loads": "linker load batches that landed",
        "loaded_pages": "pages (all pools and layer groups) linker loads brought into device slots",
        "failed_loads": "linker load batches that failed (SGLang aborts their requests)",
        "offloads": "linker offloads stored",
        "offloaded_pages": "pages (all pools and layer groups) linker offloads stored",
        "failed_offloads": "linker offloads that failed (the node stays unstored)",
    }

    def __init__(self) -> None:
        from kvconnect.connectors import metrics

        self._values = dict.fromkeys(self.HELP, 0)
        self._lock = threading.Lock()
        self._counters = {n: metrics.process_counter(f"kvconnect_linker_{n}", h) for n, h in self.HELP.items()}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n
        self._counters[name].inc(n)

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def as_dict(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._values)


# ---------------------------------------------------------------------------------
# Device pools
# ---------------------------------------------------------------------------------


def _kv_entry(name: Any, pool: Any, layer_mapping: Dict[int, int], page_size: int) -> DevicePoolEntry:
    """The linker view of one plain MHA or MLA device pool (``layer_mapping``: transfer layer
    -> the pool's layer)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
        raise ConfigError("kv_cache_dtype", "scaled (quantized with scales) KV caches are not supported by the linker",
                          "an unscaled KV cache dtype", ADAPTER)
    if isinstance(pool, MLATokenToKVPool):
        components, mapping = [list(pool.kv_buffer)], dict(layer_mapping)
    elif isinstance(pool, MHATokenToKVPool):
        n = len(pool.k_buffer)
        components = [[*pool.k_buffer, *pool.v_buffer]]
        mapping = {layer: (index, n + index) for layer, index in layer_mapping.items()}
    else:
        raise ConfigError("model", f"device pool {type(pool).__name__} is not a plain MHA or MLA pool",
                          "MHATokenToKVPool, MLATokenToKVPool", ADAPTER)
    return DevicePoolEntry(name=name, indices_from_pool=name, device_pool=pool, components=components,
                           layer_mapping=mapping, page_size=page_size, rows_are_pages=False)


def device_pool_group(kvcache: Any, params: Any, components: set) -> DevicePoolGroup:
    """The device pools the linker moves: SGLang's assembly where it has one, else plain KV
    (MHA / MLA) or FULL + SWA built from SGLang's ``DevicePoolEntry``."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    page_size = params.page_size
    if components == {ComponentType.FULL} and hasattr(kvcache, "layer_num") and not isinstance(kvcache, SWAKVPool):
        try:
            entry = _kv_entry(PoolName.KV, kvcache, {i: i for i in range(kvcache.layer_num)}, page_size)
        except ConfigError as e:
            if "not a plain" not in e.problem:
                raise
        else:
            return DevicePoolGroup([entry], kvcache.layer_num, page_size,
                                   rank_replicated=isinstance(kvcache, MLATokenToKVPool))
    if components == {ComponentType.FULL, ComponentType.SWA} and isinstance(kvcache, SWAKVPool):
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _swa_layer_mappings

        full, swa = _swa_layer_mappings(kvcache)
        entries = [_kv_entry(PoolName.KV, kvcache.full_kv_pool, full, page_size),
                   _kv_entry(PoolName.SWA, kvcache.swa_kv_pool, swa, page_size)]
        layers = max(layer for e in entries for layer in e.layer_mapping) + 1
        return DevicePoolGroup(entries, layers, page_size)
    try:
        return resolve_hybrid_device_pool_group(kvcache=kvcache, page_size=page_size, params=params,
                                                components=components)
    except (ValueError, AssertionError) as e:
        raise ConfigError("model", f"SGLang has no linker pool layout for this model: {e}",
                          "plain MHA / MLA, FULL + SWA, and the models SGLang's assembler supports",
                          ADAPTER) from e


@dataclass
class LinkedPool:
    """One physical device pool under its key space. ``groups[g]``: the transfer layers of
    this pool in layer group ``g`` (None where it has none; with one group, all its layers);
    ``segments[g]``: the buffers a page of group ``g`` is made of, in page order, each as
    ``(buffer, row stride bytes, bytes per page)``."""

    name: str
    entry: DevicePoolEntry
    store: PrefixedStore
    context: EngineContext
    groups: List[Optional[List[int]]]
    segments: List[List[tuple]]
    page_nbytes: int

    @property
    def is_writer(self) -> bool:
        return self.context.is_writer

    @property
    def row_span(self) -> int:
        """Buffer rows per page (token rows of a page, or 1 where a row is a page)."""
        return self.entry._row_span

    def group_keys(self, keys: Sequence[str], g: int, of: int) -> List[str]:
        return list(keys) if of == 1 else [f"{k}.lg{g}" for k in keys]

    def group_pages(self, rows: List[int], g: int) -> List[Page]:
        """The device segments of layer group ``g`` of the pages at ``rows`` (rows:
        ``prepare_locations``), computed with numpy rather than per segment."""
        import numpy as np

        segs = self.segments[g]
        bases = np.asarray([b.data_ptr() for b, _, _ in segs], dtype=np.int64)
        strides = np.asarray([stride for _, stride, _ in segs], dtype=np.int64)
        sizes = [size for _, _, size in segs]
        ptrs = (bases[None, :] + np.asarray(rows, dtype=np.int64)[:, None] * strides[None, :]).tolist()
        return [list(zip(row, sizes)) for row in ptrs]


def _group_segments(entry: DevicePoolEntry, layers: Optional[List[int]], of: int) -> List[tuple]:
    """The buffers of a page of one layer group, in page order: with one group SGLang's
    ``get_page_buffer_meta`` order (each component's buffers: all K layers, then all V);
    with several, ``get_prepared_layer_range_meta``'s (layer by layer)."""
    if of == 1:
        buffers = [b for comp in entry.components for b in comp]
    else:
        buffers = []
        for layer in layers or ():
            mapped = entry.layer_mapping[layer]
            for comp in entry.components:
                buffers += [comp[i] for i in ([mapped] if isinstance(mapped, int) else mapped)]
    span = entry._row_span
    return [(b, b.stride(0) * b.element_size(), b.nbytes // b.shape[0] * span) for b in buffers]


def _rows(buffer: Any) -> Any:
    """``buffer`` as a (rows, row bytes) byte tensor sharing its memory."""
    if not buffer.is_contiguous():
        raise ConfigError("staging", f"a device buffer of shape {tuple(buffer.shape)} is not contiguous",
                          "'off' (the store writes device memory itself)", ADAPTER)
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)


class StagingArena:
    """Host memory one thread's staged batches reuse: chunks kept across batches (grown to the
    largest batch seen), pinned on an accelerator; ``reset`` hands them out again."""

    CHUNK = 64 << 20

    def __init__(self, pin: bool):
        self.pin = pin
        self.chunks: List[Any] = []
        self._at = (0, 0)

    def reset(self) -> None:
        self._at = (0, 0)

    def take(self, nbytes: int) -> Any:
        c, off = self._at
        while c < len(self.chunks) and self.chunks[c].numel() - off < nbytes:
            c, off = c + 1, 0
        if c == len(self.chunks):
            self.chunks.append(torch.empty(max(nbytes, self.CHUNK), dtype=torch.uint8, pin_memory=self.pin))
        self._at = (c, off + nbytes)
        return self.chunks[c][off:off + nbytes]


class HostStaging:
    """One batch of one pool's pages of one layer group in host memory, where the store reads
    and writes them, copied to or from the device pool per buffer, one copy per run of
    consecutive slots. A staged page holds the bytes of the direct one, in the same order
    (the same key space)."""

    def __init__(self, pool: LinkedPool, rows: List[int], g: int, arena: StagingArena):
        self.segments = pool.segments[g]
        self.span = pool.row_span
        self.n = len(rows)
        # Per buffer, the batch's pages one after another.
        self.blocks = [arena.take(self.n * size).view(self.n * self.span, size // self.span)
                       for _, _, size in self.segments]
        # (buffer row, block row, rows): page i's rows start at rows[i] and block row i * span.
        self.runs: List[tuple] = []
        for i, row in enumerate(rows):
            last = self.runs[-1] if self.runs else None
            if last is not None and last[0] + last[2] == row and last[1] + last[2] == i * self.span:
                self.runs[-1] = (last[0], last[1], last[2] + self.span)
            else:
                self.runs.append((row, i * self.span, self.span))

    def pages(self) -> List[Page]:
        return [[(block.data_ptr() + i * size, size) for block, (_, _, size) in zip(self.blocks, self.segments)]
                for i in range(self.n)]

    def to_device(self) -> None:
        for block, (buffer, _, _) in zip(self.blocks, self.segments):
            dst = _rows(buffer)
            for at, src, n in self.runs:
                dst[at:at + n].copy_(block[src:src + n], non_blocking=True)

    def from_device(self) -> None:
        for block, (buffer, _, _) in zip(self.blocks, self.segments):
            src_rows = _rows(buffer)
            for at, src, n in self.runs:
                block[src:src + n].copy_(src_rows[at:at + n], non_blocking=True)


def _page_nbytes(entry: DevicePoolEntry) -> int:
    """Bytes of one page of a linker pool view (all its segments)."""
    return sum(size for comp in entry.buffer_meta for _, _, size in comp)


def _kv_kind(pool: Any) -> Optional[str]:
    """"mha" / "mla" for SGLang's plain KV device pools (keyed as the HiCache adapter keys
    their host pools), None for any other pool."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if type(pool) is MHATokenToKVPool:
        return "mha"
    if type(pool) is MLATokenToKVPool:
        return "mla"
    return None


def _layer_groups(num_layers: int, groups: int) -> List[range]:
    bounds = [round(i * num_layers / groups) for i in range(groups + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(groups)]


def _serve(queue: Queue, task: Any) -> None:
    """A worker thread: ``task(*item)`` for each item of ``queue`` until a None."""
    while True:
        item = queue.get()
        try:
            if item is None:
                return
            task(*item)
        finally:
            queue.task_done()


# ---------------------------------------------------------------------------------
# The linker
# ---------------------------------------------------------------------------------


class KVConnectLinker(UnifiedCacheLinker):
    """A SGLang ``UnifiedCacheLinker`` over a kvconnect ``PageStore`` (see module docstring)."""

    def __init__(self, server_args: Any, params: Any, *, components: set, extra_config: Optional[dict] = None,
                 forward_stream: Any = None):
        from sglang.srt.runtime_context import get_model, get_parallel, get_serving

        self.forward_stream = forward_stream
        self.page_size = params.page_size
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pool_group = device_pool_group(kvcache, params, set(components))
        self.pools = self.pool_group.entry_map
        self.num_layers = self.pool_group.num_layers
        self._errors = ErrorCounter()
        self._rlog = RateLimitedLog(log)

        tp_rank, tp_size = 0, get_parallel().tp_size
        group = params.attn_tp_cache_group or params.tp_cache_group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_rank = torch.distributed.get_rank(group=group)
            tp_size = torch.distributed.get_world_size(group=group)
        device = str(next(iter(self.pools.values())).kv_buffer[0].device.type)
        model = get_serving().served_model_name or get_model().model_path
        extra = dict(extra_config or {})
        self.options = LinkerOptions.parse(extra, self.num_layers)
        kv = self.pools.get(PoolName.KV)
        self.context = EngineContext(
            engine="sglang-linker", model=str(model or ""), tp_rank=tp_rank, tp_size=tp_size,
            pp_rank=params.pp_rank, pp_size=params.pp_size, cp_rank=params.attn_cp_rank,
            cp_size=params.attn_cp_size, rank_replicated=self.pool_group.rank_replicated, device=device,
            # the KV page size up front, so a store keeping one file per size finds its pages
            # before it wrote any (layer groups: several sizes, none told)
            page_bytes=_page_nbytes(kv) if kv is not None and self.options.layer_groups == 1 else None)
        require = dict(required_capabilities(self.context))
        if self.context.on_device and self.options.staging == "off":
            require[Capability.DEVICE_MEMORY] = (f'with "staging": "off" the store moves pages straight into '
                                                 f"SGLang's {device} pools")
        self.store, self.engine_options = build_store(extra, where=ADAPTER, engine_keys=LINKER_KEYS,
                                                      context=self.context, require=require)
        self.staged = self.options.staging == "host" or (
            self.options.staging == "auto" and self.context.on_device
            and not self.store.supports(Capability.DEVICE_MEMORY))
        try:
            if self.staged and self.store.supports(Capability.NEEDS_REGISTERED_MEMORY):
                raise ConfigError("staging", f"store {self.store.name!r} reads only into memory registered with it, "
                                  "and host staging memory is allocated per batch",
                                  "a store with device_memory (staging 'off'), or one that reads into any memory",
                                  ADAPTER)
            base = base_keyspace(self.context, tenant=self.engine_options.tenant,
                                 weights=self.engine_options.model_fingerprint)
            self._layer_ranges = _layer_groups(self.num_layers, self.options.layer_groups)
            self.linked = {pool_name(name): self._link(pool_name(name), entry, base)
                           for name, entry in self.pools.items()}
            self._register_buffers()
            self._events = self._start_events(extra.get("kv_events"))
        except Exception:
            self.store.close()
            raise
        for p in self.linked.values():
            log.info("kvconnect linker: pool %s keyed as %s", p.name, p.store.keyspace.describe())
        if getattr(server_args, "enable_linker_mla_dedup", False) and self.context.sharing_ranks > 1:
            log.warning("kvconnect linker: --enable-linker-mla-dedup is not implemented here; every TP rank "
                        "reads the replicated KV from the store")
        self._metrics_port = None
        if self.engine_options.metrics_port is not None:
            port = self.engine_options.metrics_port
            self._metrics_port = serve_store_metrics(self.store, port + self.context.rank_index if port else port,
                                                     self.engine_options.metrics_host, engine="sglang-linker")

        self._copy_stream = None
        self._arenas: Dict[int, StagingArena] = {}  # by thread: the load and the offload thread
        self._landing = threading.Lock()  # a staged group lands, or its batch is abandoned
        self._deadlines: Dict[int, threading.Timer] = {}
        self._abandoned: set = set()
        if self.staged and self.context.on_device:
            from sglang.srt.utils import get_device_module

            self._device_module = get_device_module()
            self._copy_stream = self._device_module.Stream()
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        if PoolName.MAMBA in self.pools:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.pending_loads: Dict[str, List[PoolTransfer]] = {}
        self._load_queue: Queue = Queue()
        self._offload_queue: Queue = Queue()
        self._offload_results: Queue = Queue()
        self._lookups = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvconnect-linker-lookup")
        self._stuck_lookup: Optional[concurrent.futures.Future] = None
        self.counts = LinkerCounts()
        self._closed = False
        self._threads = [threading.Thread(target=_serve, args=(self._load_queue, self._load_task), daemon=True,
                                          name="kvconnect-linker-load"),
                         threading.Thread(target=_serve, args=(self._offload_queue, self._offload_task), daemon=True,
                                          name="kvconnect-linker-offload")]
        for t in self._threads:
            t.start()
        log.info("kvconnect linker on store %r: %s, %d layer group(s)", self.store.name, self.context.describe(),
                 self.options.layer_groups)

    # -- setup ----------------------------------------------------------------------------
    def _start_events(self, option: Any) -> Optional[StoreEvents]:
        """KV events of the KV pool's pages (``kv_events``: SGLang's --kv-events-config schema),
        published by the rank SGLang publishes from; None where off."""
        config = events_config(option, where=ADAPTER)
        kv = self.linked.get(pool_name(PoolName.KV))
        if not config or kv is None:
            return None
        if self.options.layer_groups != 1:
            raise ConfigError("kv_events", "events name whole pages, and layer_groups > 1 stores each page as "
                              "several keys", "layer_groups 1 with kv_events", ADAPTER)
        c = self.context
        if (c.tp_rank, c.pp_rank, c.cp_rank) != (0, 0, 0):
            return None
        events = StoreEvents.create(config, dp_rank=c.dp_rank, where=ADAPTER)
        if events is not None:
            events.watch(kv.store, block_size=self.page_size)
        return events

    def _link(self, name: str, entry: DevicePoolEntry, base: Any) -> LinkedPool:
        replicated = self.pool_group.rank_replicated and name not in RANK_SHARDED_POOLS
        pool = entry.device_pool
        groups = self.options.layer_groups
        page_nbytes = _page_nbytes(entry)
        n_segments = sum(len(comp) for comp in entry.buffer_meta)
        kind = _kv_kind(pool)
        if kind is not None:
            geometry, layout = kv_geometry(kind, pool), "layer_first"
        else:
            # The linker's own row geometry: no host-pool format to match.
            geometry, layout = f"linker:{type(pool).__module__}.{type(pool).__name__}:S{n_segments}", "device_rows"
        geometry += f":B{page_nbytes}"
        if groups > 1:
            geometry += f":LG{groups}"
        stored = getattr(pool, "dtype", None) if kind is not None else entry.kv_buffer[0].dtype
        ks = pool_keyspace(base, name, layout=layout, page_size=entry.page_size, stored_dtype=stored,
                           geometry=geometry, replicated=replicated, is_kv=kind is not None,
                           kv_cache_dtype=self.engine_options.extra.get("kv_cache_dtype"))
        per_group: List[Optional[List[int]]] = []
        for layers in self._layer_ranges:
            mine = [layer for layer in layers if layer in entry.layer_mapping]
            per_group.append(mine or None)
        if groups == 1:
            per_group = [list(entry.layer_mapping)]
        segments = [_group_segments(entry, layers, groups) if layers else [] for layers in per_group]
        if self.staged:
            for seg in segments:
                for buffer, _, _ in seg:
                    _rows(buffer)  # a buffer staging cannot copy fails here, naming the key
        return LinkedPool(name=name, entry=entry, store=PrefixedStore.for_keyspace(self.store, ks),
                          context=self.context.for_pool(name, rank_replicated=replicated), groups=per_group,
                          segments=segments, page_nbytes=page_nbytes)

    def _register_buffers(self) -> None:
        if not self.store.supports(Capability.NEEDS_REGISTERED_MEMORY) or self.staged:
            return
        seen = set()
        for entry in self.pools.values():
            for buffer in entry.get_hybrid_pool_buffer():
                storage = buffer.untyped_storage()
                span = (int(storage.data_ptr()), int(storage.nbytes()))
                if span not in seen:
                    seen.add(span)
                    self.store.register_memory(*span)

    # -- lookup -----------------------------------------------------------------------------
    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        """Every restorable prefix length (pages), within ``lookup_timeout_s``; [] on any failure."""
        try:
            if self._closed:
                return []
            stuck = self._stuck_lookup
            if stuck is not None and not stuck.done():
                self.counts.add("lookup_timeouts")
                return []  # the store has not answered the last lookup yet
            future = self._lookups.submit(self._restorable, transfers)
            try:
                restorable = future.result(timeout=self.options.lookup_timeout_s)
            except concurrent.futures.TimeoutError:
                self._stuck_lookup = future
                self.counts.add("lookup_timeouts")
                self._rlog.warning("lookup-timeout", "kvconnect linker: store %r gave no lookup answer in %.2f s; "
                                   "a miss", self.store.name, self.options.lookup_timeout_s)
                return []
            self.counts.add("lookups")
            if restorable:
                self.counts.add("lookup_hit_pages", restorable[-1])
            return restorable
        except Exception as e:  # noqa: BLE001 - nothing raises into SGLang's scheduler
            self._failed("lookup", e)
            return []

    def _restorable(self, transfers: List[PoolTransfer]) -> List[int]:
        """SGLang 0.5.23's ``batch_exists_v2`` rule over the physical pools: the KV's leading
        run, less the stops a side pool cannot serve (TRAILING_PAGES: its window of
        ``len(transfer.keys)`` pages ending there must be complete)."""
        expanded = self.pool_group.resolve_transfers(transfers)
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if not expanded or kv is None or not kv.keys:
            return []
        keys = list(kv.keys)
        calls, owners = [], []
        for t in expanded:
            pool = self.linked.get(pool_name(t.name))
            if pool is None:
                return []
            for g in self._present_groups(pool):
                calls.append((pool.store, pool.group_keys(keys, g, self.options.layer_groups)))
                owners.append(t)
        found = exists_many(calls)
        present: Dict[int, List[bool]] = {}
        for t, hits in zip(owners, found):
            acc = present.setdefault(id(t), [True] * len(keys))
            present[id(t)] = [a and b for a, b in zip(acc, hits)]
        stops = None
        for t in expanded:
            pool_present = present.get(id(t), [False] * len(keys))
            if HitPolicy.parse(t.hit_policy) is HitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys or ()))
                own = set(restorable_prefixes(pool_present, HitPolicy.TRAILING_PAGES, window))
            else:
                own = set(restorable_prefixes(pool_present, HitPolicy.ALL_PAGES))
            stops = own if stops is None else stops & own
        return sorted(stops or ())

    def _present_groups(self, pool: LinkedPool) -> List[int]:
        return [g for g, layers in enumerate(pool.groups) if layers]

    # -- load --------------------------------------------------------------------------------
    def load(self, rid: str, transfers: List[PoolTransfer]) -> bool:
        try:
            if self._closed:
                return False
            expanded = self.pool_group.resolve_transfers(transfers, allow_partial=True, allow_missing_kv=True)
            if not expanded or rid in self.pending_loads:
                return False
            self.pending_loads[rid] = expanded
            return True
        except Exception as e:  # noqa: BLE001
            self._failed("load", e)
            return False

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        ready = self._ready_event()
        if self.staged:
            # The store writes only host buffers: past the deadline the batch can fail safely.
            timer = threading.Timer(self.options.load_timeout_s, self._abandon, (index,))
            timer.daemon = True
            self._deadlines[index] = timer
            timer.start()
        self._load_queue.put((index, list(pending.values()), ready))
        return index

    def _abandon(self, index: int) -> None:
        """The staged batch ``index`` ran past ``load_timeout_s``: fail it now."""
        with self._landing:
            futures = self.layer_done_counter.futures.get(index)
            if self._deadlines.pop(index, None) is None or not futures or all(f.done() for f in futures):
                return  # it landed or failed meanwhile
            self._abandoned.add(index)
            self.layer_done_counter.fail(index, TimeoutError(
                f"store {self.store.name!r} did not deliver the pages within {self.options.load_timeout_s} s"))
        self.counts.add("failed_loads")
        self._rlog.warning("load-timeout", "kvconnect linker: a load batch ran past load_timeout_s=%.1f s; its "
                           "requests are aborted and its late pages dropped", self.options.load_timeout_s)

    def _land(self, index: int, layers: Any, staged: List["HostStaging"]) -> bool:
        """Copy a group's staged pages to the device and release its layers, unless the batch
        was abandoned (then nothing touches the device); False when abandoned."""
        with self._landing:
            if index in self._abandoned:
                return False
            self._copy(staged, to_device=True)
            for layer in layers:
                self.layer_done_counter.complete(index, layer)
        return True

    def _settle(self, index: int) -> None:
        """The batch is done (landed or failed): its deadline no longer applies."""
        with self._landing:
            timer = self._deadlines.pop(index, None)
            self._abandoned.discard(index)
        if timer is not None:
            timer.cancel()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def _ready_event(self) -> Any:
        if not self.context.on_device:
            return None
        from sglang.srt.utils import get_device_module

        event = get_device_module().Event()
        event.record()
        return event

    def _load_task(self, index: int, request_transfers: List[List[PoolTransfer]], ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            self._load_batch(index, request_transfers)
        except BaseException as e:  # noqa: BLE001 - the batch fails, SGLang aborts its requests
            with self._landing:
                abandoned = index in self._abandoned
                if not abandoned:
                    self.layer_done_counter.fail(index, e)
            if not abandoned:
                self.counts.add("failed_loads")
                self._failed("load", e)
        finally:
            self._settle(index)

    def _load_batch(self, index: int, request_transfers: List[List[PoolTransfer]]) -> None:
        """Read every layer group of every page, in group order; each group's layers are
        released to the forward once all its pages landed."""
        groups = self.options.layer_groups
        batches: Dict[str, tuple] = {}
        for transfers in request_transfers:
            for t in transfers:
                pool = self.linked[pool_name(t.name)]
                keys, rows = batches.setdefault(pool.name, ([], []))
                keys.extend(t.keys or ())
                rows.extend(pool.entry.prepare_locations(t.host_indices))
        done = 0
        for g, layers in enumerate(self._layer_ranges if groups > 1 else [range(self.num_layers)]):
            calls, staged = [], []
            self._reset_arena()
            for name, (keys, rows) in batches.items():
                pool = self.linked[name]
                if pool.groups[g] and keys:
                    calls.append((pool.store, pool.group_keys(keys, g, groups), self._pages(pool, rows, g, staged)))
            results = get_many(calls) if calls else []
            missed = sum(r.count(False) for r in results)
            if missed:
                raise LookupError(f"{missed} page(s) of layer group {g} were not in the store any more")
            if not self._land(index, layers, staged):
                return  # abandoned: the forward went on, the requests are aborted
            done += sum(len(c[1]) for c in calls)
        kv = batches.get(pool_name(PoolName.KV))
        if self._events is not None and kv is not None:
            self._events.loaded(kv[0])
        self.counts.add("loads")
        self.counts.add("loaded_pages", done)

    def _pages(self, pool: LinkedPool, rows: List[int], g: int, staged: List[HostStaging]) -> List[Page]:
        """Where the store moves these pages: the device pool's own memory, or (staging) a
        host buffer appended to ``staged``."""
        if not self.staged:
            return pool.group_pages(rows, g)
        arena = self._arenas.setdefault(threading.get_ident(), StagingArena(pin=self.context.on_device))
        staging = HostStaging(pool, rows, g, arena)
        staged.append(staging)
        return staging.pages()

    def _reset_arena(self) -> None:
        arena = self._arenas.get(threading.get_ident())
        if arena is not None:
            arena.reset()

    def _copy(self, staged: List[HostStaging], *, to_device: bool) -> None:
        """Staged pages to (or from) the device pools; returns once the copies are done."""
        if not staged:
            return
        if self._copy_stream is None:
            for staging in staged:
                staging.to_device() if to_device else staging.from_device()
            return
        with self._device_module.stream(self._copy_stream):
            for staging in staged:
                staging.to_device() if to_device else staging.from_device()
        self._copy_stream.synchronize()

    # -- offload -------------------------------------------------------------------------------
    def offload(self, transfers: List[PoolTransfer], session_id: Optional[str] = None) -> bool:
        try:
            if self._closed:
                return False
            expanded = self.pool_group.resolve_transfers(transfers, allow_partial=True)
            if not expanded:
                return False
            mine = [t for t in expanded if self.linked[pool_name(t.name)].is_writer]
            if not mine:  # a reader rank of replicated KV: the writer rank stores it
                self._offload_results.put(True)
                return True
            self._offload_queue.put((mine, self.record_offload_ready() if self.context.on_device else []))
            return True
        except Exception as e:  # noqa: BLE001
            self._failed("offload", e)
            return False

    def _offload_task(self, transfers: List[PoolTransfer], events: List[Any]) -> None:
        ok = False
        try:
            for event in events:
                event.synchronize()
            ok = self._store_transfers(transfers)
        except Exception as e:  # noqa: BLE001 - a failed offload, reported as such
            self._failed("offload", e)
        self.counts.add("offloads" if ok else "failed_offloads")
        self._offload_results.put(ok)

    def _store_transfers(self, transfers: List[PoolTransfer]) -> bool:
        groups = self.options.layer_groups
        calls: list = []
        staged: List[HostStaging] = []
        announce = None  # (index of the KV pool's call, its page hashes, events token)
        self._reset_arena()
        for t in transfers:
            pool = self.linked[pool_name(t.name)]
            keys = list(t.keys or ())
            rows = pool.entry.prepare_locations(t.host_indices)
            # Only the pages the store lacks: a page already there is the same bytes.
            present = pool.store.exists(pool.group_keys(keys, self._present_groups(pool)[-1], groups))
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                continue
            keys, rows = [keys[i] for i in todo], [rows[i] for i in todo]
            if self._events is not None and pool.name == pool_name(PoolName.KV):
                announce = (len(calls), keys, self._events.begin(keys))  # layer_groups 1: one call
            for g in self._present_groups(pool):
                calls.append((pool.store, pool.group_keys(keys, g, groups), self._pages(pool, rows, g, staged)))
        self._copy(staged, to_device=False)
        # Lookups ask for every group of a page: one a failed put left out makes it a miss.
        results = put_many(calls) if calls else []
        if announce is not None:
            at, keys, token = announce
            self._events.stored(keys, results[at], token=token)
        ok = all(all(r) for r in results)
        if ok:
            self.counts.add("offloaded_pages", sum(len(c[1]) for c in calls))
        return ok

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # -- lifecycle ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.pending_loads.clear()
        self._load_queue.join()
        self._offload_queue.join()
        while True:
            try:
                self._offload_results.get_nowait()
            except Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pending_loads.clear()
        self._load_queue.put(None)
        self._offload_queue.put(None)
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._lookups.shutdown(wait=False, cancel_futures=True)
        stuck = self._stuck_lookup
        if stuck is not None:
            concurrent.futures.wait([stuck], timeout=max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()] + (["a lookup"] if stuck and not stuck.done() else [])
        log.info("kvconnect linker: %s", self.counts.as_dict())
        if self._events is not None:
            self._events.close()  # what is pending goes out; the store's evictions no longer do
        if busy:
            # A store call is still running (a load may still write device memory): the
            # store stays open for it rather than be freed under it.
            log.warning("kvconnect linker: %s still inside store %r at close; leaving it open", busy, self.store.name)
            return
        try:
            from kvconnect.connectors import metrics

            metrics.unexport_store(self.store)
            self.store.close()
        except Exception as e:  # noqa: BLE001 - close never raises into SGLang
            log.error("kvconnect linker: closing store %r failed: %s", self.store.name, e)

    # -- reporting ----------------------------------------------------------------------------
    def _failed(self, what: str, e: BaseException) -> None:
        self._errors.add(what)
        self._rlog.error(f"{what}:{type(e).__name__}", "kvconnect linker %s failed: %s: %s", what,
                         type(e).__name__, e)

    def kvconnect_stats(self) -> dict:
        return {"store": self.store.stats().as_dict(), "linker": self.counts.as_dict(),
                "kv_events": dict(self._events.counts) if self._events else None,
                "errors": self._errors.as_dict(), "context": self.context.describe(),
                "keyspaces": {n: p.store.keyspace.describe() for n, p in self.linked.items()}}

    def __repr__(self) -> str:
        return f"<KVConnectLinker store={self.store.name!r} pools={sorted(self.linked)}>"
