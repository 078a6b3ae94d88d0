"""Geometry of SGLang's host pools: which memory a page of a pool is, and how it maps to a
store's pages.

``describe_pool`` turns one registered host pool into a ``PoolIO``: its key space and store
view, the engine context of that pool (side pools may be TP-sharded where the KV is
rank-replicated), and how its pages become ``(address, nbytes)`` segments in the order of
SGLang's flat page (``get_data_page(flat=True)``) on every path, so pages written through
the zero-copy v1 path, the legacy tensor path and the v2 pool path are interchangeable.

A pool with no flat page format that offers ``get_page_buffer_meta`` (all SGLang's own
``MooncakeStore`` needs, with ``get_ksize_per_token`` for its metrics) is stored and loaded
through those segments, in their order, under a key space of its own class.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from kvconnect.connectors.base import Page, PageStore, Unsupported
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.sglang_shims import host_pool_classes, torch
from kvconnect.connectors.views import PrefixedStore
from kvconnect.namespace import KeySpace, resolve_kv_dtype

log = logging.getLogger("kvconnect.sglang_hicache")

ADAPTER = "kvconnect sglang hicache"

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# Side pools that are TP-sharded even when the model's KV is rank-replicated (SGLang's
# ``should_backup``: Mamba/KDA state is written by every TP rank).
RANK_SHARDED_POOLS = ("mamba",)


def tensor_segment(t: Any) -> tuple[int, int]:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a page tensor must be a contiguous CPU tensor")
    return (t.data_ptr(), t.numel() * t.element_size())



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
    not known to match the flat order (Mamba, indexer...). ``flat``: the pool has that flat
    page format (the legacy tensor path needs it to make its own page tensors); a pool
    without it is always ``zero_copy``.
    """

    name: str
    pool: Any
    keyspace: KeySpace
    context: EngineContext  # this pool's: is_writer applies the writer rule to it
    store: PrefixedStore  # the store under this pool's key space
    stride: int  # host token slots per key (SGLang's logical page size)
    page_nbytes: int
    zero_copy: bool
    segs_per_page: int = 1
    kv_interleaved: bool = False
    table: Optional["SegmentTable"] = None
    flat: bool = True

    @property
    def is_writer(self) -> bool:
        return self.context.is_writer

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
        """Pages from SGLang's ``get_page_buffer_meta``: in flat byte order, or (a pool
        without flat pages) in the pool's own segment order."""
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

        return [[tensor_segment(t)] for t in targets], finish

    def plan_write(self, keys: Sequence[str], host_indices: Any) -> tuple[List[Page], List[Any]]:
        """Pages to store; the second item keeps staged tensors alive during the call."""
        self.check_indices(keys, host_indices)
        if self.zero_copy:
            return self.zero_copy_pages(host_indices, len(keys)), []
        staged = [self.pool.get_data_page(s, flat=True).contiguous()
                  for s in host_indices[:: self.stride].tolist()]
        return [[tensor_segment(t)] for t in staged], staged


def sglang_kv_cache_dtype() -> Optional[str]:
    """The ``--kv-cache-dtype`` this SGLang process was started with (``auto``, ``fp8_e4m3``,
    ...), or None where SGLang published no server args (a host pool built outside a server).
    Host pools only know the dtype fp8 is stored in (``uint8``), never which fp8 it is."""
    try:
        from sglang.srt.runtime_context import get_server_args

        value = getattr(get_server_args(), "kv_cache_dtype", None)
    except Exception:  # noqa: BLE001 - older SGLang, or nothing published
        return None
    return str(value) if value else None


def _stored_dtype(pool: Any) -> Any:
    return getattr(pool, "dtype", None) or getattr(getattr(pool, "kv_buffer", None), "dtype", None)


def _flat_page_nbytes(pool: Any) -> int:
    t = pool.get_dummy_flat_data_page()
    return int(t.numel() * t.element_size())


def _flat_page_error(pool: Any) -> Optional[Exception]:
    """Why ``pool`` cannot hand out SGLang's flat pages, or None if it can."""
    try:
        _flat_page_nbytes(pool)
        pool.get_data_page(0, flat=True)
    except Exception as e:  # noqa: BLE001 - the pool has no flat page format
        return e
    return None


def _page_segments(pool: Any, stride: int) -> tuple[List[int], List[int]]:
    """``get_page_buffer_meta`` of the pool's first page: its segments' addresses and sizes."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(stride, dtype=torch.int64))
    ptrs, sizes = [int(p) for p in ptrs], [int(n) for n in sizes]
    if not ptrs or len(ptrs) != len(sizes) or min(sizes) <= 0:
        raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} addresses and sizes {sizes} for one page")
    return ptrs, sizes


def kv_geometry(kind: str, pool: Any) -> str:
    """The page geometry of an MHA (``kind`` "mha") or MLA ("mla") KV pool. SGLang's host and
    device pools name it alike, so the SGLang linker keys its device pages the same way."""
    if kind == "mha":
        return f"mha:L{pool.layer_num}:H{pool.head_num}:D{pool.head_dim}"
    return f"mla:L{pool.layer_num}:D{pool.kv_cache_dim}"


def pool_keyspace(base: KeySpace, name: str, *, layout: Any, page_size: int, stored_dtype: Any, geometry: str,
                  replicated: bool, is_kv: bool, kv_cache_dtype: Optional[str] = None) -> KeySpace:
    """The key space of pool ``name`` of the engine rank ``base`` describes (HiCache adapter and
    linker alike). ``is_kv``: an MHA / MLA KV pool, whose logical dtype and scales come from
    ``kv_cache_dtype`` (None: SGLang's server args, where published); other pools keep their
    buffers' dtype."""
    if is_kv:
        declared = kv_cache_dtype if kv_cache_dtype is not None else sglang_kv_cache_dtype()
        dtype, kv_scales = resolve_kv_dtype(stored_dtype, declared, where=ADAPTER)
    else:
        dtype, kv_scales = resolve_kv_dtype(stored_dtype, where=ADAPTER)
    return dataclasses.replace(base, pool=name, layout=str(layout or "none"), page_size=page_size, dtype=dtype,
                               kv_scales=kv_scales, geometry=geometry, rank_replicated=replicated)


def describe_pool(pool: Any, context: EngineContext, base: KeySpace, name: str, store: PageStore,
                  kv_cache_dtype: Optional[str] = None) -> PoolIO:
    """The ``PoolIO`` of one host pool of the engine process ``context`` describes, or
    ``Unsupported``.

    ``kv_cache_dtype``: the engine's KV dtype setting (``--kv-cache-dtype``; None: SGLang's own
    server args, where published). It names the logical dtype and stored scales of the MHA /
    MLA KV pools (``KeySpace.dtype`` / ``kv_scales``); other pools (Mamba state, indexers)
    keep their buffers' dtype."""
    mha_cls, mla_cls = host_pool_classes()
    layout = getattr(pool, "layout", None)
    page_size = int(getattr(pool, "page_size", 1) or 1)
    stride = int(getattr(pool, "logical_page_size", page_size) or page_size)
    what = f"host pool {name!r} ({type(pool).__name__}, layout {layout!r})"
    replicated = context.rank_replicated and name not in RANK_SHARDED_POOLS
    dcp_size = context.dcp_size
    if getattr(pool, "kv_buffer", 0) is None:
        raise Unsupported(f"{what}: it has no host buffer", ADAPTER)

    if _uses_page_methods_of(pool, mha_cls):
        if layout not in MHA_LAYOUTS:
            raise Unsupported(f"{what}: layout {layout!r}", ADAPTER, MHA_LAYOUTS)
        v_head_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_head_dim != pool.head_dim:
            raise Unsupported(f"{what}: head_dim {pool.head_dim} != v_head_dim {v_head_dim}", ADAPTER)
        geometry = kv_geometry("mha", pool)
        zero_copy, flat, is_kv = True, True, True
    elif _uses_page_methods_of(pool, mla_cls):
        if layout not in MLA_LAYOUTS:
            raise Unsupported(f"{what}: layout {layout!r}", ADAPTER, MLA_LAYOUTS)
        geometry = kv_geometry("mla", pool)
        zero_copy, flat, is_kv = True, True, True
    else:
        # Any other pool (Mamba state, DSA indexer, a subclass with its own page format):
        # through SGLang's flat pages where it has them, else through its own page
        # segments; under its class name so formats never mix.
        flat_error = _flat_page_error(pool)
        geometry = f"{type(pool).__module__}.{type(pool).__name__}"
        is_kv = False
        flat = flat_error is None
        zero_copy = not flat
        if not flat:
            try:
                _page_segments(pool, stride)
            except Exception as e:  # noqa: BLE001 - the pool cannot hand out pages at all
                raise Unsupported(
                    f"{what}: it has no storage page format (flat pages: {type(flat_error).__name__}: "
                    f"{flat_error}; get_page_buffer_meta: {type(e).__name__}: {e})",
                    ADAPTER, [f"MHA: {', '.join(MHA_LAYOUTS)}", f"MLA: {', '.join(MLA_LAYOUTS)}",
                              "pools with flat data pages", "pools with get_page_buffer_meta"]) from e
            geometry += ":segments"

    segs_per_page, interleaved = 1, False
    if zero_copy:
        ptrs, sizes = _page_segments(pool, stride)
        page_nbytes = sum(sizes)
        if flat and page_nbytes != _flat_page_nbytes(pool):
            raise Unsupported(f"{what}: its {len(sizes)} page segments hold {page_nbytes} bytes, "
                              f"its flat page {_flat_page_nbytes(pool)}", ADAPTER)
        segs_per_page = len(ptrs)
        # MHA layer_first segments come as k0, v0, k1, v1, ...; the flat page is all K
        # layers, then all V layers.
        interleaved = geometry.startswith("mha") and layout == "layer_first"
        if not flat:
            geometry += f":S{segs_per_page}"
    else:
        page_nbytes = _flat_page_nbytes(pool)
    geometry += f":B{page_nbytes}"
    fmt = getattr(pool, "storage_format_tag", None)
    if isinstance(fmt, str) and fmt:
        geometry += f":fmt[{fmt}]"  # SGLang's own name for a page byte format of its own
    if dcp_size > 1:
        geometry += f":dcp{context.dcp_rank}of{dcp_size}:tp{context.tp_size}:lp{stride}"
    ks = pool_keyspace(base, name, layout=layout, page_size=page_size, stored_dtype=_stored_dtype(pool),
                       geometry=geometry, replicated=replicated, is_kv=is_kv, kv_cache_dtype=kv_cache_dtype)
    io = PoolIO(name=name, pool=pool, keyspace=ks, context=context.for_pool(name, rank_replicated=replicated),
                store=PrefixedStore.for_keyspace(store, ks), stride=stride, page_nbytes=page_nbytes,
                zero_copy=zero_copy, segs_per_page=segs_per_page, kv_interleaved=interleaved, flat=flat)
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


def pool_buffers(pool: Any) -> List[Any]:
    """Host tensors a transport must register to move this pool's pages zero-copy."""
    buf = getattr(pool, "kv_buffer", None)
    if buf is None:
        return []
    return list(buf) if isinstance(buf, (list, tuple)) else [buf]


