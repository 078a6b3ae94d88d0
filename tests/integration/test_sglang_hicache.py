"""KVConnectStorage inside real SGLang 0.5.23 HiCache pieces, on CPU.

Real: sglang's ``StorageBackendFactory`` (dynamic loading from the extra-config JSON),
``HiCacheStorageConfig``, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` host pools
built over real CPU device pools (``kvconnect.connectors.testing.sglang``), SGLang's own
``HiCacheFile`` as the v2 reference, and kvconnect's memory store.

Not real, and why: the ``HiCacheController`` (its GPU<->host copies need CUDA); the tests
call the backend the way the controller's ``_page_get_zero_copy`` / ``_generic_page_get`` /
``_generic_page_set`` / hybrid ``batch_*_v2`` do (those few lines are copied below). Several
SGLang ranks sharing one backend are several adapter instances in one process over a
``SharedMemoryStore`` (``kvconnect.connectors.testing.stores``: memory stores with the same
``space`` share pages), standing in for a shared backend such as HF3FS or Mooncake; the
multi-process version over the real shared stores is ``test_ranks.py``.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch", reason="needs torch (installed by scripts/install.sh)")
pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvconnect.connectors.base import Capability, ConfigError, Page, Unsupported, UnknownStore  # noqa: E402
from kvconnect.connectors.config import StoreConfig  # noqa: E402
from kvconnect.connectors.engines.sglang_hicache import KVConnectStorage  # noqa: E402
from kvconnect.connectors.testing.sglang import (  # noqa: E402
    SUPPORTED_LAYOUTS_MHA,
    SUPPORTED_LAYOUTS_MLA,
    MinimalHostPool,
    SegmentsOnlyPool,
    fill_pages,
    make_cpu_host_pool,
    make_cpu_mamba_pool,
    page_bytes,
    segment_bytes,
    storage_page_keys,
)
from kvconnect.connectors.testing.stores import SharedMemoryConfig, SharedMemoryStore, clear_spaces  # noqa: E402

ISSUE_JSON = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
              "class_name": "KVConnectStorage", "interface_v1": 1}
SHARED = "kvconnect.connectors.testing.stores:SharedMemoryStore"
RAISING = "kvconnect.connectors.testing.stores:RaisingStore"
REGISTERING = f"{__name__}:RegisteringStore"  # an out-of-tree store, named by module path


# ---------------------------------------------------------------------------------
# Test stores (out-of-tree stores, named "module:Class" in the extra config)
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisteringConfig(StoreConfig):
    space: str = "registering"


class RegisteringStore(SharedMemoryStore):
    """A store that needs registered memory; it refuses pages outside registered spans."""

    name = "registering"
    config_class = RegisteringConfig
    capabilities = SharedMemoryStore.capabilities | {Capability.NEEDS_REGISTERED_MEMORY}
    spans: list = []

    def __init__(self, config: RegisteringConfig, context=None):
        super().__init__(SharedMemoryConfig(space=config.space), context)
        self.spans = []

    def _register_memory(self, address, nbytes):
        self.spans.append((address, nbytes))

    def _covered(self, page: Page) -> bool:
        return all(any(a <= addr and addr + n <= a + size for a, size in self.spans) for addr, n in page)

    def _get_into(self, keys, pages):
        return [ok and self._covered(p) for ok, p in zip(super()._get_into(keys, pages), pages)]

    def _put_from(self, keys, pages):
        if not all(self._covered(p) for p in pages):
            return [False] * len(keys)
        return super()._put_from(keys, pages)


@pytest.fixture(autouse=True)
def _fresh_spaces():
    clear_spaces()
    yield
    clear_spaces()


# ---------------------------------------------------------------------------------
# Helpers: configs, backends, SGLang's own call sequences
# ---------------------------------------------------------------------------------


def storage_config(extra: dict, *, tp_rank=0, tp_size=1, mla=False, model="tiny/model",
                   metrics=False, layout="page_first", dp_rank=0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=dict(extra), dp_rank=dp_rank)


def backend(host, store=SHARED, space="s", **kw) -> KVConnectStorage:
    """Build exactly as SGLang's controller does: factory, then register the host pool."""
    extra = {**ISSUE_JSON, "store": store, **({"space": space} if store in (SHARED,) else {})}
    extra.update(kw.pop("extra", {}))
    cfg = storage_config(extra, layout=host.layout, **kw)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


def hashes(n: int, tag: str = "") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def alloc_pages(host, n: int, skip: int = 0):
    """Page-aligned host slots for n pages, after ``skip`` pages (so reads land elsewhere)."""
    if skip:
        host.alloc(skip * host.page_size)
    return host.alloc(n * host.page_size)


def pages_of(host, idx) -> list[bytes]:
    ps = host.page_size
    return [page_bytes(host, idx[i * ps]) for i in range(len(idx) // ps)]


def sglang_generic_page_get(b, host, keys, idx) -> int:
    """``CacheController._generic_page_get`` (0.5.23), minus logging."""
    dummy = [host.get_dummy_flat_data_page() for _ in keys]
    data = b.batch_get(keys, dummy)
    if data is None:
        return 0
    count = 0
    for i in range(len(keys)):
        if data[i] is None:
            break
        host.set_from_flat_data_page(idx[i * host.page_size], data[i])
        count += 1
    return count


def sglang_generic_page_set(b, host, keys, idx) -> bool:
    """``CacheController._generic_page_set`` (0.5.23)."""
    data = [host.get_data_page(idx[i * host.page_size]) for i in range(len(keys))]
    return b.batch_set(keys, data)


def leading(results) -> int:
    n = 0
    for r in results:
        if not r:
            break
        n += 1
    return n


POOL_CASES = [(False, lay) for lay in SUPPORTED_LAYOUTS_MHA] + [(True, lay) for lay in SUPPORTED_LAYOUTS_MLA]


def pool_id(case):
    return f"{'mla' if case[0] else 'mha'}-{case[1]}"


# ---------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------


def test_factory_builds_from_the_issue_json():
    host = make_cpu_host_pool("page_first")
    extra = {**ISSUE_JSON, "store": "memory", "capacity": "8mb",
             # SGLang's own keys that reach the backend: ignored, never passed to the store.
             "allocator": "default", "file_storage_path": "/nonexistent", "tenant": "team-a"}
    cfg = storage_config(extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    try:
        assert type(b) is KVConnectStorage
        assert b.store.name == "memory" and b.store.config.capacity == 8 << 20
        b.register_mem_pool_host(host)
        ks = b.kv.keyspace
        assert (ks.model, ks.layout, ks.page_size, ks.dtype, ks.tenant) == (
            "tiny/model", "page_first", 4, "bfloat16", "team-a")
        assert ks.geometry.startswith("mha:L3:H2:D8:B")
        idx = alloc_pages(host, 2)
        fill_pages(host, idx, seed=3)
        want = pages_of(host, idx)
        keys = hashes(2)
        assert b.batch_set_v1(keys, idx) == [True, True]
        assert b.batch_exists(keys) == 2
        # the bytes in the store are the flat pages, byte for byte
        assert [b.store._pages[k] for k in ks.keys(keys)] == want
    finally:
        b.close()


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_pages_round_trip_byte_exact_into_a_fresh_pool(case):
    """Written from one real host pool, read into a fresh one, through every path."""
    mla, layout = case
    src = make_cpu_host_pool(layout, mla=mla)
    writer = backend(src, mla=mla)
    idx = alloc_pages(src, 5)
    fill_pages(src, idx, seed=11)
    want = pages_of(src, idx)
    assert len(set(want)) == 5
    keys = hashes(5, layout)
    assert writer.batch_set_v1(keys[:3], idx[: 3 * src.page_size]) == [True] * 3
    # the legacy path writes the other two; both paths store the same byte order
    assert sglang_generic_page_set(writer, src, keys[3:], idx[3 * src.page_size:]) is True

    # v1 into a fresh pool, at other slots
    dst = make_cpu_host_pool(layout, mla=mla)
    reader = backend(dst, mla=mla)
    didx = alloc_pages(dst, 5, skip=3)
    assert reader.batch_exists(keys) == 5
    assert reader.batch_get_v1(keys, didx) == [True] * 5
    assert pages_of(dst, didx) == want

    # legacy path into another fresh pool
    dst2 = make_cpu_host_pool(layout, mla=mla)
    reader2 = backend(dst2, mla=mla)
    didx2 = alloc_pages(dst2, 5, skip=1)
    assert sglang_generic_page_get(reader2, dst2, keys, didx2) == 5
    assert pages_of(dst2, didx2) == want
    # single-key legacy calls
    t = reader2.get(keys[0], dst2.get_dummy_flat_data_page())
    assert t is not None and t.view(torch.uint8).numpy().tobytes() == want[0]
    assert reader2.exists(keys[4]) and not reader2.exists(hashes(1, "absent")[0])
    for b in (writer, reader, reader2):
        b.close()


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_segment_table_equals_get_page_buffer_meta(case):
    """The numpy segment table gives SGLang's own segments, in flat byte order."""
    from kvconnect.connectors.engines.sglang_pools import SegmentTable

    mla, layout = case
    host = make_cpu_host_pool(layout, mla=mla, layer_num=5, host_tokens=4 * 40)
    b = backend(host, mla=mla)
    io = b.kv
    assert (io.table is not None) == (io.segs_per_page > 2)
    table = io.table or SegmentTable.for_pool(host, "mla" if mla else "mha")
    rng = random.Random(5)
    pages = rng.sample(range(host.size // host.page_size), 17)
    idx = torch.cat([torch.arange(p * host.page_size, (p + 1) * host.page_size) for p in pages])
    got = table.pages(idx[:: host.page_size])
    assert got == io.meta_pages(idx, len(pages))
    # and the flat byte order: gathering a page's segments gives get_data_page's bytes
    from kvconnect.connectors.buffers import gather

    fill_pages(host, idx, seed=9)
    for i, p in enumerate(pages):
        assert bytes(gather(got[i])) == page_bytes(host, p * host.page_size)
    b.close()


def test_batch_exists_counts_leading_hits_and_misses_stop_reads():
    host = make_cpu_host_pool("page_first_direct")
    b = backend(host)
    idx = alloc_pages(host, 10)
    fill_pages(host, idx, seed=5)
    keys = hashes(10)
    ps = host.page_size
    assert b.batch_set_v1(keys[:6], idx[: 6 * ps]) == [True] * 6
    assert b.batch_set_v1(keys[7:8], idx[7 * ps: 8 * ps]) == [True]
    assert b.batch_exists(keys) == 6
    assert b.batch_exists(keys[6:]) == 0
    assert b.batch_exists(keys[7:8]) == 1
    assert b.batch_exists([]) == 0
    fresh = make_cpu_host_pool("page_first_direct")
    r = backend(fresh)
    didx = alloc_pages(fresh, 10)
    got = r.batch_get_v1(keys, didx)
    assert got == [True] * 6 + [False, True, False, False]
    assert leading(got) == 6
    assert pages_of(fresh, didx[: 6 * ps]) == pages_of(host, idx[: 6 * ps])
    b.close()
    r.close()


def test_two_tp_ranks_never_read_each_others_pages():
    hosts = [make_cpu_host_pool("page_first") for _ in range(2)]
    ranks = [backend(h, tp_rank=r, tp_size=2) for r, h in enumerate(hosts)]
    keys = hashes(4, "tp")
    idx = [alloc_pages(h, 4) for h in hosts]
    fill_pages(hosts[0], idx[0], seed=100)
    assert ranks[0].batch_set_v1(keys, idx[0]) == [True] * 4
    # rank 1 sees none of rank 0's pages, on any path
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[1].batch_get_v1(keys, idx[1]) == [False] * 4
    assert ranks[1].batch_get(keys, [hosts[1].get_dummy_flat_data_page() for _ in keys]) == [None] * 4
    assert not ranks[1].exists(keys[0])
    # both ranks write the same hashes with different bytes; each reads back its own
    fill_pages(hosts[1], idx[1], seed=200)
    assert ranks[1].batch_set_v1(keys, idx[1]) == [True] * 4
    mine = [pages_of(h, i) for h, i in zip(hosts, idx)]
    assert mine[0] != mine[1]
    for r, h in enumerate(hosts):
        fresh = make_cpu_host_pool("page_first")
        fb = backend(fresh, tp_rank=r, tp_size=2)
        fidx = alloc_pages(fresh, 4)
        assert fb.batch_get_v1(keys, fidx) == [True] * 4
        assert pages_of(fresh, fidx) == mine[r]
        fb.close()
    assert ranks[0].kv.keyspace.prefix != ranks[1].kv.keyspace.prefix
    for b in ranks:
        b.close()


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS_MLA)
def test_mla_rank1_reads_what_rank0_wrote_and_never_writes(layout):
    hosts = [make_cpu_host_pool(layout, mla=True) for _ in range(2)]
    ranks = [backend(h, tp_rank=r, tp_size=2, mla=True) for r, h in enumerate(hosts)]
    assert [b.storage_config.is_storage_writer for b in ranks] == [True, False]
    assert ranks[0].kv.keyspace.prefix == ranks[1].kv.keyspace.prefix
    store = ranks[0].store
    keys = hashes(3, "mla")
    idx = [alloc_pages(h, 3) for h in hosts]
    fill_pages(hosts[1], idx[1], seed=7)
    # rank 1 reports success (the writer rank stores it) but writes nothing, on any path
    assert ranks[1].batch_set_v1(keys, idx[1]) == [True] * 3
    assert sglang_generic_page_set(ranks[1], hosts[1], keys, idx[1]) is True
    assert store.stats().keys == 0 and store.stats().put_pages == 0
    assert ranks[1].batch_exists(keys) == 0
    # rank 0 writes; rank 1 reads it byte-exact
    fill_pages(hosts[0], idx[0], seed=8)
    assert ranks[0].batch_set_v1(keys, idx[0]) == [True] * 3
    assert ranks[1].batch_exists(keys) == 3
    assert ranks[1].batch_get_v1(keys, idx[1]) == [True] * 3
    assert pages_of(hosts[1], idx[1]) == pages_of(hosts[0], idx[0])
    assert store.stats().keys == 3
    for b in ranks:
        b.close()


def _dcp_mla_pool(dcp_rank: int, dcp_size: int = 2):
    """A real MLA host pool of one decode-context-parallel rank (pages widened x dcp_size)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(64, 4, torch.bfloat16, 8, 4, 2, "cpu", False, start_layer=0, end_layer=2)
    with host_memory_budget_scope(64 << 20):
        return MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, 4 * dcp_size, "page_first", pin_memory=False,
            device="cpu", dcp_size=dcp_size, dcp_rank=dcp_rank, device_capacity_tokens=dev.size, start_layer=0,
            end_layer=2, target_layer_num=2, host_token_capacity=64)


def test_mla_with_decode_context_parallel_shards():
    """TP 4 x DCP 2: TP ranks 0 and 1 write DCP shards 0 and 1; ranks 2 and 3 read them."""
    hosts = [_dcp_mla_pool(r % 2) for r in range(4)]
    ranks = []
    for r, h in enumerate(hosts):
        extra = {**ISSUE_JSON, "store": SHARED, "space": "dcp"}
        cfg = HiCacheStorageConfig(
            tp_rank=r, tp_size=4, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny/mla", extra_config=extra,
            dcp_size=2, dcp_rank=r % 2, logical_page_size=8)
        b = StorageBackendFactory.create_backend("dynamic", cfg, h)
        b.register_mem_pool_host(h)
        ranks.append(b)
    assert [b.kv.is_writer for b in ranks] == [True, True, False, False]
    assert ranks[0].kv.keyspace.prefix == ranks[2].kv.keyspace.prefix != ranks[1].kv.keyspace.prefix
    keys = hashes(3, "dcp")
    lps = 8  # host indices are logical: 8 slots per key, 4 physical rows on each DCP rank
    idx = [h.alloc(3 * lps) for h in hosts]
    for r in (0, 1):
        for i in range(3):
            page = torch.randint(0, 256, (hosts[r].get_dummy_flat_data_page().numel() * 2,),
                                 dtype=torch.uint8, generator=torch.Generator().manual_seed(10 * r + i))
            hosts[r].set_from_flat_data_page(int(idx[r][i * lps]), page.view(torch.bfloat16))
        assert ranks[r].batch_set_v1(keys, idx[r]) == [True] * 3
    assert ranks[3].batch_set_v1(keys, idx[3]) == [True] * 3  # a reader: nothing written
    assert ranks[0].store.stats().keys == 6
    for reader, writer in ((2, 0), (3, 1)):
        assert ranks[reader].batch_get_v1(keys, idx[reader]) == [True] * 3
        got = [page_bytes(hosts[reader], idx[reader][i * lps]) for i in range(3)]
        assert got == [page_bytes(hosts[writer], idx[writer][i * lps]) for i in range(3)]
    assert pages_of_dcp(hosts[0], idx[0]) != pages_of_dcp(hosts[1], idx[1])
    for b in ranks:
        b.close()


def pages_of_dcp(host, idx, lps=8):
    return [page_bytes(host, idx[i * lps]) for i in range(len(idx) // lps)]


# -- v2 pools -------------------------------------------------------------------------


def _v2_pair(tmp_path, space):
    """Our backend and SGLang's HiCacheFile over KV + an SWA side pool (real MHA pools)."""
    kv = make_cpu_host_pool("page_first", page_size=2)
    swa = make_cpu_host_pool("page_first", page_size=2, layer_num=1)
    ours = backend(kv, space=space)
    ours.register_mem_host_pool_v2(kv, PoolName.KV)
    ours.register_mem_host_pool_v2(swa, PoolName.SWA)
    cfg = storage_config({"file_storage_path": str(tmp_path)})
    ref = HiCacheFile(cfg, file_path=str(tmp_path))
    ref.register_mem_pool_host(kv)
    ref.register_mem_host_pool_v2(kv, PoolName.KV)
    ref.register_mem_host_pool_v2(swa, PoolName.SWA)
    return kv, swa, ours, ref


def test_v2_trailing_pages_side_pool_matches_sglang_hicachefile(tmp_path):
    """batch_exists_v2 / batch_set_v2 / batch_get_v2 against SGLang's own v2 reference.

    Random presence patterns of KV pages and SWA-state pages are written to both
    kvconnect and ``HiCacheFile``; the hit results (kv_hit_pages, per-pool hits and the
    restorable stop points, holes included) must be identical.
    """
    rng = random.Random(1234)
    kv, swa, ours, ref = _v2_pair(tmp_path, "v2")
    n = 8
    ps = kv.page_size
    kidx = alloc_pages(kv, n)
    sidx = alloc_pages(swa, n)
    fill_pages(kv, kidx, seed=1)
    fill_pages(swa, sidx, seed=2)
    for trial in range(12):
        keys = hashes(n, f"trial{trial}")
        kv_present = [rng.random() < 0.85 for _ in range(n)]
        swa_present = [rng.random() < 0.6 for _ in range(n)]
        for b in (ours, ref):
            for i in range(n):
                if kv_present[i]:
                    assert b.batch_set_v2([PoolTransfer(PoolName.KV, kidx[i * ps:(i + 1) * ps], keys=[keys[i]])]) \
                        == {PoolName.KV: [True]}
                if swa_present[i]:
                    got = b.batch_set_v2([PoolTransfer(PoolName.SWA, sidx[i * ps:(i + 1) * ps], keys=[keys[i]],
                                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)])
                    assert got == {PoolName.SWA: [True]}
        for window in (1, 2, 3):
            transfers = [PoolTransfer(PoolName.SWA, keys=keys[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
            a, r = ours.batch_exists_v2(keys, transfers), ref.batch_exists_v2(keys, transfers)
            assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == (
                r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages), (kv_present, swa_present, window)
        # ALL_PAGES side pool too
        transfers = [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        a, r = ours.batch_exists_v2(keys, transfers), ref.batch_exists_v2(keys, transfers)
        assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == (
            r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages)
    # a case with a hole: SWA state at pages 2 and 5 only, window 1 -> stop points {3, 6}
    keys = hashes(n, "hole")
    for i in range(n):
        ours.batch_set_v2([PoolTransfer(PoolName.KV, kidx[i * ps:(i + 1) * ps], keys=[keys[i]])])
    for i in (2, 5):
        ours.batch_set_v2([PoolTransfer(PoolName.SWA, sidx[i * ps:(i + 1) * ps], keys=[keys[i]])])
    res = ours.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-1:],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (6, [3, 6])
    assert res.extra_pool_hit_pages == {PoolName.KV: 8, PoolName.SWA: 6}
    ours.close()


def test_v2_side_pool_pages_round_trip_into_fresh_pools(tmp_path):
    kv, swa, ours, _ref = _v2_pair(tmp_path, "v2rt")
    ps = kv.page_size
    keys = hashes(4, "rt")
    kidx, sidx = alloc_pages(kv, 4), alloc_pages(swa, 2)
    fill_pages(kv, kidx, seed=9)
    fill_pages(swa, sidx, seed=10)
    # backup as the hybrid controller does: side pool (trailing keys) first, then KV
    res = ours.batch_set_v2([PoolTransfer(PoolName.SWA, sidx, keys=keys[-2:],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res == {PoolName.SWA: [True, True]}
    assert ours.batch_set_v1(keys, kidx) == [True] * 4
    hit = ours.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-2:],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert hit.kv_hit_pages == 4 and hit.restorable_prefix_pages == [4]
    # fresh pools, fresh backend over the same shared store
    kv2 = make_cpu_host_pool("page_first", page_size=2)
    swa2 = make_cpu_host_pool("page_first", page_size=2, layer_num=1)
    b2 = backend(kv2, space="v2rt")
    b2.register_mem_host_pool_v2(kv2, PoolName.KV)
    b2.register_mem_host_pool_v2(swa2, PoolName.SWA)
    k2, s2 = alloc_pages(kv2, 4, skip=1), alloc_pages(swa2, 2, skip=2)
    # a KV sidecar read (CacheController._page_transfer_kv_batch) plus the SWA read
    got = b2.batch_get_v2([PoolTransfer(PoolName.SWA, s2, keys=keys[-2:]),
                           PoolTransfer(PoolName.KV, k2, keys=keys)])
    assert got == {PoolName.SWA: [True, True], PoolName.KV: [True] * 4}
    assert pages_of(swa2, s2) == pages_of(swa, sidx)
    assert pages_of(kv2, k2) == pages_of(kv, kidx)
    # a wrong index count fails that pool only
    bad = b2.batch_get_v2([PoolTransfer(PoolName.SWA, s2[:1], keys=keys[-2:]),
                           PoolTransfer(PoolName.KV, k2, keys=keys)])
    assert bad == {PoolName.SWA: [False, False], PoolName.KV: [True] * 4}
    # an unregistered pool misses
    assert b2.batch_get_v2([PoolTransfer(PoolName.MAMBA, s2, keys=keys[-2:])]) == {PoolName.MAMBA: [False, False]}
    ours.close()
    b2.close()


def test_v2_pool_without_zero_copy_goes_through_flat_pages():
    """A pool whose class changes the page methods is moved through SGLang's flat pages.

    ``MambaPoolHost`` needs a Mamba device pool that is not constructible here without
    model buffers; the closest real thing is a real MHA host pool subclass that, like
    Mamba with side states, refuses zero-copy metadata.
    """
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    class NoMetaPool(MHATokenToKVPoolHost):
        def get_page_buffer_meta(self, indices):
            raise NotImplementedError("no zero-copy for this pool")

    def no_meta(layout):
        pool = make_cpu_host_pool(layout, page_size=1, layer_num=2)
        pool.__class__ = NoMetaPool
        return pool

    kv = make_cpu_host_pool("page_first")
    mamba = no_meta("layer_first")
    b = backend(kv, space="flat", mla=True)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    io = b._pools["mamba"]
    assert not io.zero_copy and not io.keyspace.rank_replicated  # Mamba is TP-sharded under MLA
    keys = hashes(3, "mamba")
    idx = alloc_pages(mamba, 3)
    fill_pages(mamba, idx, seed=4)
    assert b.batch_set_v2([PoolTransfer(PoolName.MAMBA, idx, keys=keys)]) == {PoolName.MAMBA: [True] * 3}
    fresh = no_meta("layer_first")
    b2 = backend(make_cpu_host_pool("page_first"), space="flat", mla=True)
    b2.register_mem_host_pool_v2(fresh, PoolName.MAMBA)
    fidx = alloc_pages(fresh, 3, skip=2)
    assert b2.batch_get_v2([PoolTransfer(PoolName.MAMBA, fidx, keys=keys)]) == {PoolName.MAMBA: [True] * 3}
    assert pages_of(fresh, fidx) == pages_of(mamba, idx)
    b.close()
    b2.close()


# -- pools that offer only get_page_buffer_meta ----------------------------------------


def _meta_page(pool, start):
    """(addresses, sizes) of the page at token slot ``start``: an address-form legacy target."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(start, start + pool.page_size))
    return list(ptrs), list(sizes)


@pytest.mark.parametrize("entries", [1, 2], ids=["one-segment", "two-segments"])
def test_the_minimal_pool_of_sglangs_mooncake_test_moves_pages_on_every_path(entries):
    """The host pool of SGLang 0.5.23's ``test_mooncake_store.py``: only ``get_page_buffer_meta``
    and ``get_ksize_per_token``, no flat pages. Zero-copy v1 both ways, the address-form legacy
    calls (SGLang's ``MooncakeStore`` form) both ways and across paths, byte-exact; an address
    outside the registered buffer is refused without reading or writing it; a legacy read that
    would need the flat format answers misses. Mocked: the pool (upstream's mock, the thing under
    test); the store is the in-process memory store."""
    buf = torch.randint(-1000, 1000, (64 * entries * 32,), dtype=torch.int32).float()
    pool = MinimalHostPool(buf, entries_per_page=entries, page_elements=32)
    b = backend(pool, store="memory")
    try:
        io = b.kv
        assert io.zero_copy and not io.flat and io.segs_per_page == entries and io.page_nbytes == entries * 128
        assert io.keyspace.geometry == f"kvconnect.connectors.testing.sglang.MinimalHostPool:segments:S{entries}:B{entries * 128}"
        assert io.keyspace.dtype == "float32"
        keys = hashes(6, f"minimal{entries}")
        src = [segment_bytes(pool, i) for i in range(6)]
        assert len(set(src)) == 6
        assert b.batch_set_v1(keys[:4], torch.arange(4)) == [True] * 4
        assert b.batch_exists(keys) == 4
        assert b.batch_get_v1(keys[:4], torch.arange(20, 24)) == [True] * 4
        assert [segment_bytes(pool, i) for i in range(20, 24)] == src[:4]
        # address form: pages 4, 5 written as (addresses, sizes), read back by v1 and by address
        metas = [_meta_page(pool, i) for i in (4, 5)]
        assert b.batch_set(keys[4:], target_locations=[m[0] for m in metas], target_sizes=[m[1] for m in metas])
        assert b.batch_get_v1(keys[4:], torch.arange(30, 32)) == [True] * 2
        assert [segment_bytes(pool, i) for i in (30, 31)] == src[4:]
        dst = [_meta_page(pool, i) for i in range(40, 46)]
        assert b.batch_get(keys, target_locations=[m[0] for m in dst], target_sizes=[m[1] for m in dst]) == 6
        assert [segment_bytes(pool, i) for i in range(40, 46)] == src
        # single-key address form with one segment of the page: what upstream's test_single_operation does
        seg_addr, seg_size = _meta_page(pool, 7)[0][0], _meta_page(pool, 7)[1][0]
        assert b.set("one", target_location=seg_addr, target_sizes=seg_size) is True
        assert b.get("one", target_location=_meta_page(pool, 50)[0][0], target_sizes=seg_size) is True
        assert segment_bytes(pool, 50)[:seg_size] == segment_bytes(pool, 7)[:seg_size]
        # an address outside every registered pool buffer: refused, nothing stored or read
        outside = torch.zeros(32)
        assert b.set("outside", target_location=outside.data_ptr(), target_sizes=128) is False
        assert not b.exists("outside")
        before = bytes(outside.numpy().tobytes())
        assert b.get(keys[0], target_location=outside.data_ptr(), target_sizes=128) is None
        assert b.batch_get(keys[:1], target_locations=[outside.data_ptr()], target_sizes=[128]) == 0
        assert outside.numpy().tobytes() == before
        # the legacy tensor path without targets needs the flat format: misses, no exception
        assert b.batch_get(keys[:2]) == [None, None]
        assert b.get(keys[0]) is None
        assert b.kvconnect_stats()["adapter_errors"]["batch_get"] >= 2
    finally:
        b.close()


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_a_real_pool_seen_only_through_its_page_segments_round_trips_byte_exact(case):
    """A real SGLang MHA / MLA host pool behind ``SegmentsOnlyPool`` (only
    ``get_page_buffer_meta`` / ``get_ksize_per_token``): v1 written, read into a fresh pool at
    other slots, read again through the address-form legacy call, and as a v2 side pool; the
    real pools' flat bytes match. Such a pool is keyed apart from the same pool class's own
    format (the adapter does not know the segment order of a class it does not know), so a
    backend on the unwrapped pool finds none of its pages. Mocked: only the view hiding the
    flat page methods; two backends share pages through ``SharedMemoryStore`` (one process)."""
    mla, layout = case
    src = make_cpu_host_pool(layout, mla=mla)
    w = backend(SegmentsOnlyPool(src), space="segments", mla=mla)
    dst = make_cpu_host_pool(layout, mla=mla)
    r = backend(SegmentsOnlyPool(dst), space="segments", mla=mla)
    own = backend(make_cpu_host_pool(layout, mla=mla), space="segments", mla=mla)
    try:
        assert w.kv.zero_copy and not w.kv.flat and w.kv.page_nbytes == own.kv.page_nbytes
        assert w.kv.keyspace.geometry.startswith("kvconnect.connectors.testing.sglang.SegmentsOnlyPool:segments:S")
        idx = alloc_pages(src, 5)
        fill_pages(src, idx, seed=21)
        want = pages_of(src, idx)
        keys = hashes(5, f"segments-{layout}")
        assert w.batch_set_v1(keys, idx) == [True] * 5
        assert r.batch_exists(keys) == 5 and own.batch_exists(keys) == 0
        didx = alloc_pages(dst, 5, skip=3)
        assert r.batch_get_v1(keys, didx) == [True] * 5
        assert pages_of(dst, didx) == want
        ps = dst.page_size
        didx2 = alloc_pages(dst, 5)
        metas = [_meta_page(dst, int(didx2[i * ps])) for i in range(5)]
        assert r.batch_get(keys, target_locations=[m[0] for m in metas], target_sizes=[m[1] for m in metas]) == 5
        assert pages_of(dst, didx2) == want
        # v2: the same view as a side pool
        w.register_mem_host_pool_v2(SegmentsOnlyPool(src), PoolName.SWA)
        r.register_mem_host_pool_v2(SegmentsOnlyPool(dst), PoolName.SWA)
        assert w._pools["swa"].zero_copy and not w._pools["swa"].flat
        skeys = hashes(2, f"swa-{layout}")
        assert w.batch_set_v2([PoolTransfer(PoolName.SWA, idx[: 2 * ps], keys=skeys)]) == {PoolName.SWA: [True] * 2}
        didx3 = alloc_pages(dst, 2)
        assert r.batch_get_v2([PoolTransfer(PoolName.SWA, didx3, keys=skeys)]) == {PoolName.SWA: [True] * 2}
        assert pages_of(dst, didx3) == want[:2]
    finally:
        for b in (w, r, own):
            b.close()


def test_a_pool_with_neither_page_format_is_refused_naming_both():
    """A pool with a host buffer but neither SGLang's flat pages nor ``get_page_buffer_meta``:
    refused at registration, naming what each lacks and what is accepted. Mocked: the pool
    (a class with only ``kv_buffer``, ``layout``, ``page_size``: nothing real is that bare)."""

    class BarePool:
        kv_buffer = torch.zeros(64)
        layout = "page_first"
        page_size = 1

    b = _create({"store": "memory"}, make_cpu_host_pool("page_first"))
    try:
        with pytest.raises(Unsupported) as e:
            b.register_mem_pool_host(BarePool())
        msg = str(e.value)
        assert "no storage page format" in msg and "get_page_buffer_meta: AttributeError" in msg
        assert "pools with flat data pages" in msg and "pools with get_page_buffer_meta" in msg
    finally:
        b.close()


# -- salted keys (SGLang's extra_key / cache_salt) -------------------------------------


def test_requests_share_pages_only_under_the_same_extra_key_and_cache_salt():
    """Page keys come from SGLang's own derivation (``storage_page_keys``:
    ``get_storage_hash_str`` over a ``RadixKey``, seeded by ``storage_namespace_seed``). Server 1
    writes a prompt's pages under ``cache_salt`` A; server 2 (its own host pool and adapter, same
    store) finds and loads them byte-exact under A, and a longer prompt under A hits their
    prefix; under every other namespace (salt B, no salt, the same string as ``extra_key``, an
    added ``extra_key``, an empty ``extra_key``) it finds none and loads none, its pool bytes
    untouched. Mocked: nothing; the two servers are two adapters in one process over
    ``SharedMemoryStore`` (memory stores sharing a space), standing in for a shared store."""
    src, dst = make_cpu_host_pool("page_first"), make_cpu_host_pool("page_first")
    ps = src.page_size
    tokens = list(range(1000, 1000 + 6 * ps))
    one, two = backend(src, space="salted"), backend(dst, space="salted")
    try:
        keys = storage_page_keys(tokens, ps, cache_salt="tenant-a")
        idx = alloc_pages(src, 6)
        fill_pages(src, idx, seed=31)
        assert one.batch_set_v1(keys, idx) == [True] * 6

        same = storage_page_keys(tokens, ps, cache_salt="tenant-a")
        assert two.batch_exists(same) == 6
        didx = alloc_pages(dst, 6)
        assert two.batch_get_v1(same, didx) == [True] * 6
        assert pages_of(dst, didx) == pages_of(src, idx)
        longer = storage_page_keys(tokens + list(range(7, 7 + 2 * ps)), ps, cache_salt="tenant-a")
        assert longer[:6] == keys and two.batch_exists(longer) == 6

        others = {"salt B": dict(cache_salt="tenant-b"), "no salt": {}, "as extra_key": dict(extra_key="tenant-a"),
                  "extra_key added": dict(extra_key="lora-1", cache_salt="tenant-a"), "empty extra_key": dict(extra_key="")}
        oidx = alloc_pages(dst, 6)
        zeros = pages_of(dst, oidx)
        assert len(set(zeros)) == 1
        for what, ns in others.items():
            other = storage_page_keys(tokens, ps, **ns)
            assert not set(other) & set(keys), what
            assert two.batch_exists(other) == 0, what
            assert two.batch_get_v1(other, oidx) == [False] * 6, what
            assert pages_of(dst, oidx) == zeros, what
    finally:
        one.close()
        two.close()


# -- configuration errors -------------------------------------------------------------


def _create(extra, host=None):
    host = host or make_cpu_host_pool("page_first")
    return StorageBackendFactory.create_backend("dynamic", storage_config({**ISSUE_JSON, **extra}), host)


def test_bad_config_fails_at_construction_naming_key_and_accepted_values():
    with pytest.raises(UnknownStore) as e:
        _create({"store": "nosuchstore"})
    assert "'store'" in str(e.value) and "nosuchstore" in str(e.value) and "'memory'" in str(e.value)

    with pytest.raises(ConfigError) as e:
        _create({})
    assert "'store'" in str(e.value) and "is required" in str(e.value) and "'memory'" in str(e.value)

    with pytest.raises(ConfigError) as e:
        _create({"store": "memory", "capacity": "lots"})
    assert "'capacity'" in str(e.value) and "4gb" in str(e.value)

    with pytest.raises(ConfigError) as e:
        _create({"store": "memory", "capcity": "1gb"})
    assert "'capcity'" in str(e.value) and "'capacity'" in str(e.value) and "'tenant'" in str(e.value)

    with pytest.raises(ConfigError) as e:
        _create({"store": "memory", "metrics_port": "http"})
    assert "'metrics_port'" in str(e.value)

    with pytest.raises(ConfigError) as e:
        _create({"store": "memory", "store_options": "capacity=1"})
    assert "'store_options'" in str(e.value)

    # nested store options are the same as inline ones
    b = _create({"store": "memory", "store_options": {"capacity": "2mb"}})
    assert b.store.config.capacity == 2 << 20
    b.close()


def test_unsupported_layout_fails_at_registration_naming_supported_layouts():
    host = make_cpu_host_pool("page_first")
    b = _create({"store": "memory"}, host)
    host.layout = "page_first_kv_split"  # the NPU-only layout SGLang can select
    with pytest.raises(Unsupported) as e:
        b.register_mem_pool_host(host)
    msg = str(e.value)
    assert "page_first_kv_split" in msg
    for layout in SUPPORTED_LAYOUTS_MHA:
        assert repr(layout) in msg
    mla = make_cpu_host_pool("page_first", mla=True)
    mla.layout = "page_head"
    b2 = _create({"store": "memory"}, mla)
    with pytest.raises(Unsupported, match="'page_head'.*supported: 'layer_first', 'page_first', 'page_first_direct'"):
        b2.register_mem_pool_host(mla)
    b.close()
    b2.close()


# -- failures never escape ------------------------------------------------------------


def test_a_store_that_raises_yields_misses_not_exceptions():
    host = make_cpu_host_pool("layer_first")
    b = backend(host, store=RAISING)
    swa = make_cpu_host_pool("page_first", layer_num=1)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = hashes(3)
    idx = alloc_pages(host, 3)
    sidx = alloc_pages(swa, 3)
    assert b.batch_get_v1(keys, idx) == [False] * 3
    assert b.batch_set_v1(keys, idx) == [False] * 3
    assert b.batch_exists(keys) == 0
    assert b.exists(keys[0]) is False
    assert b.get(keys[0], host.get_dummy_flat_data_page()) is None
    assert b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
    assert b.set(keys[0], host.get_data_page(idx[0])) is False
    assert sglang_generic_page_set(b, host, keys, idx) is False
    assert sglang_generic_page_get(b, host, keys, idx) == 0
    res = b.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-1:],
                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (res.kv_hit_pages, res.extra_pool_hit_pages, res.restorable_prefix_pages) == (0, {}, [])
    assert b.batch_get_v2([PoolTransfer(PoolName.SWA, sidx, keys=keys)]) == {PoolName.SWA: [False] * 3}
    assert b.batch_set_v2([PoolTransfer(PoolName.SWA, sidx, keys=keys)]) == {PoolName.SWA: [False] * 3}
    assert b.clear() is False
    # bad arguments from a caller are misses too
    assert b.batch_get_v1(keys, idx[:1]) == [False] * 3
    assert b._errors.total >= 14
    b.close()
    b.close()  # idempotent
    assert b.batch_get_v1(keys, idx) == [False] * 3  # closed store: misses


def test_store_needing_registered_memory_gets_the_host_buffers():
    host = make_cpu_host_pool("page_first")
    b = backend(host, store=REGISTERING)
    kvb = host.kv_buffer
    assert b.store.spans == [(kvb.data_ptr(), kvb.numel() * kvb.element_size())]
    keys = hashes(2, "reg")
    idx = alloc_pages(host, 2)
    fill_pages(host, idx, seed=1)
    assert b.batch_set_v1(keys, idx) == [True, True]
    fresh = make_cpu_host_pool("page_first")
    b2 = backend(fresh, store=REGISTERING)
    fidx = alloc_pages(fresh, 2, skip=1)
    assert b2.batch_get_v1(keys, fidx) == [True, True]
    assert pages_of(fresh, fidx) == pages_of(host, idx)
    b.close()
    b2.close()


def test_get_stats_returns_sglang_storage_metrics():
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host = make_cpu_host_pool("page_first")
    b = backend(host, metrics=True)
    keys = hashes(3, "stats")
    idx = alloc_pages(host, 3)
    b.batch_set_v1(keys, idx)
    b.batch_get_v1(keys, idx)
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert m.prefetch_bandwidth[0] > 0 and m.backup_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []  # drained, as SGLang's backends do
    assert b.clear() is True and b.batch_exists(keys) == 0
    b.close()


def test_concurrent_prefetch_and_backup_threads_keep_pages_intact():
    """SGLang's prefetch-IO and backup threads call the backend at once."""
    host = make_cpu_host_pool("page_head", host_tokens=4 * 64)
    b = backend(host, space="threads")
    ps = host.page_size
    idx = alloc_pages(host, 32)
    fill_pages(host, idx, seed=77)
    want = pages_of(host, idx)
    keys = hashes(32, "threads")
    readers = [make_cpu_host_pool("page_head", host_tokens=4 * 40) for _ in range(3)]
    rb = [backend(r, space="threads") for r in readers]
    errors: list = []

    def write():
        for i in range(0, 32, 4):
            if b.batch_set_v1(keys[i:i + 4], idx[i * ps:(i + 4) * ps]) != [True] * 4:
                errors.append("write failed")

    def read(j):
        ridx = alloc_pages(readers[j], 32)
        for _ in range(20):
            got = rb[j].batch_get_v1(keys, ridx)
            n = leading(got)
            for i in range(32):
                if got[i] and page_bytes(readers[j], ridx[i * ps]) != want[i]:
                    errors.append(f"reader {j} page {i} wrong bytes")
            if n == 32:
                break

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    for x in [b, *rb]:
        x.close()


FAULTY = "kvconnect.connectors.testing.stores:FaultyStore"


def _flat_page_nbytes(host) -> int:
    t = host.get_dummy_flat_data_page()
    return t.numel() * t.element_size()


def test_write_behind_answers_while_the_store_hangs_sheds_when_full_then_stores_the_staged_bytes():
    """A store slower than SGLang's write-through (here: its put blocks until released) must not
    hold the backup thread: with ``write_behind`` the call returns once the pages are copied,
    pages that do not fit the buffer are refused at once, and what was staged is stored with
    the bytes it had when staged."""
    import time

    host = make_cpu_host_pool("page_first")
    pnb = _flat_page_nbytes(host)
    b = backend(host, store=FAULTY, extra={"hang_on": ["put_from"], "hang_s": 60.0, "write_behind": 3 * pnb})
    keys = hashes(5, "wb")
    idx = alloc_pages(host, 5)
    fill_pages(host, idx, seed=11)
    want = pages_of(host, idx)
    ps = host.page_size
    t0 = time.monotonic()
    assert b.batch_set_v1(keys[:2], idx[:2 * ps]) == [True, True]
    deadline = time.monotonic() + 10
    while b.store.calls["put_from"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)                     # the writer thread is now blocked in the store
    assert b.batch_set_v1(keys[2:], idx[2 * ps:]) == [True, False, False]  # 3 slots: 2 in flight + 1
    assert time.monotonic() - t0 < 10        # neither call waited for the hanging store
    assert b.batch_exists(keys) == 0         # staged is not stored: a miss until confirmed
    fill_pages(host, idx, seed=12)           # the engine reuses its host pages at once
    b.store.release()
    assert b._write_behind.flush(30)
    assert b.kvconnect_stats()["write_behind"] == {"staged": 3, "written": 3, "failed": 0, "shed": 2,
                                                   "slots": 3, "pending": 0}
    assert b.batch_exists(keys) == 3
    fresh = alloc_pages(host, 3)
    assert b.batch_get_v1(keys[:3], fresh) == [True, True, True]
    assert pages_of(host, fresh) == want[:3]
    b.close()


def test_write_behind_close_writes_what_is_staged_and_bad_sizes_name_the_key():
    host = make_cpu_host_pool("layer_first")
    pnb = _flat_page_nbytes(host)
    b = backend(host, space="wbclose", extra={"write_behind": f"{8 * pnb}b"})
    keys = hashes(4, "wbclose")
    idx = alloc_pages(host, 4)
    fill_pages(host, idx, seed=5)
    want = pages_of(host, idx)
    assert b.batch_set_v1(keys, idx) == [True] * 4
    b.close()                                # flushes before the store closes
    reader = backend(make_cpu_host_pool("layer_first"), space="wbclose")
    ridx = alloc_pages(reader.kv.pool, 4)
    assert reader.batch_get_v1(keys, ridx) == [True] * 4
    assert pages_of(reader.kv.pool, ridx) == want
    reader.close()
    for bad in ("lots", -1, "2zb"):
        with pytest.raises(ConfigError, match="write_behind"):
            backend(make_cpu_host_pool("page_first"), space="wbbad", extra={"write_behind": bad})


def test_metrics_port_serves_the_store_counters_on_loopback():
    import re
    import urllib.request

    from kvconnect.connectors import metrics

    host = make_cpu_host_pool("page_first")
    b = backend(host, extra={"metrics_port": 0})
    port = b._metrics_port
    assert isinstance(port, int) and port > 0
    try:
        keys = hashes(2, "metrics")
        idx = alloc_pages(host, 2)
        assert b.batch_set_v1(keys, idx) == [True, True]
        assert b.batch_get_v1(keys + hashes(1, "miss"), alloc_pages(host, 3)) == [True, True, False]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        hits = [line for line in text.splitlines()
                if line.startswith("kvconnect_get_hits_total") and 'engine="sglang"' in line]
        assert hits and re.search(r" 2\.0$", hits[0]), hits
        # the rank as two labels (not one combined 'rank="tp0pp0"'), the miss with its cause
        assert 'tp_rank="0"' in hits[0] and 'pp_rank="0"' in hits[0] and 'rank="tp' not in text, hits
        missed = [line for line in text.splitlines() if line.startswith("kvconnect_store_misses_total{")
                  and 'engine="sglang"' in line and 'op="get"' in line and 'cause="not_found"' in line]
        assert missed and re.search(r" 1\.0$", missed[0]), missed
    finally:
        b.close()
        server = metrics._servers.pop(("127.0.0.1", port), None)
        if server is not None:
            server.shutdown()
            server.server_close()


# -- SGLang 0.5.23 parity: the engine context, the attach hook, BLOCK_GROUPS, scope ----------


def test_engine_context_carries_every_rank_of_the_storage_config():
    """TP, PP, attention CP, decode CP and DP ranks from SGLang's HiCacheStorageConfig reach
    the store as one EngineContext; SGLang's is_storage_writer is its writer rule."""
    from kvconnect.connectors.engines.sglang_hicache import engine_context

    cfg = HiCacheStorageConfig(
        tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=2, is_mla_model=True,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="m", dp_rank=5, dcp_size=2, dcp_rank=1,
        logical_page_size=8)
    ctx = engine_context(cfg)
    assert (ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size, ctx.cp_rank, ctx.cp_size) == (3, 4, 1, 2, 1, 2)
    assert (ctx.dcp_rank, ctx.dcp_size, ctx.dp_rank, ctx.rank_replicated) == (1, 2, 5, True)
    assert ctx.is_writer == cfg.is_storage_writer  # SGLang's own rule: tp_rank == dcp_rank under MLA
    for tp in range(4):
        c = HiCacheStorageConfig(tp_rank=tp, tp_size=4, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                 is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                 model_name="m")
        assert engine_context(c).is_writer == c.is_storage_writer


def test_dp_attention_replicas_share_pages_on_real_host_pools():
    """Two DP-attention replicas (SGLang's dp_rank 0 and 1, same attention TP rank) hold the
    same heads: the DP rank reaches the context but not the key, so replica 1 reads what
    replica 0 wrote, byte-exact."""
    pools = {dp: make_cpu_host_pool("page_first") for dp in (0, 1)}
    replicas = {dp: backend(host, space="dp", dp_rank=dp) for dp, host in pools.items()}
    try:
        assert {dp: b.context.dp_rank for dp, b in replicas.items()} == {0: 0, 1: 1}
        keys, idx = hashes(3, "dp"), {dp: alloc_pages(host, 3) for dp, host in pools.items()}
        fill_pages(pools[0], idx[0], seed=11)
        assert replicas[0].batch_set_v1(keys, idx[0]) == [True] * 3 and replicas[1].batch_exists(keys) == 3
        assert replicas[1].batch_get_v1(keys, idx[1]) == [True] * 3
        assert pages_of(pools[1], idx[1]) == pages_of(pools[0], idx[0])
    finally:
        for b in replicas.values():
            b.close()


def test_the_store_receives_the_engine_context():
    host = make_cpu_host_pool("page_first")
    b = backend(host, tp_rank=1, tp_size=2)
    assert b.store.context is b.context and b.store.context.tp_rank == 1 and b.store.context.engine == "sglang-hicache"
    b.close()


def test_rank_replicated_kv_on_a_store_other_processes_cannot_read_is_refused():
    """MLA with TP 2 on the in-process store: rank 1 would never see what rank 0 writes.
    The factory refuses it at construction, naming the store and the capability."""
    from kvconnect.connectors.base import MissingCapability

    with pytest.raises(MissingCapability) as e:
        KVConnectStorage(storage_config({**ISSUE_JSON, "store": "memory"}, tp_rank=1, tp_size=2, mla=True), {})
    assert e.value.store == "memory" and e.value.capability == "shared" and "TP rank 0 writes it" in str(e.value)
    KVConnectStorage(storage_config({**ISSUE_JSON, "store": "memory"}, tp_size=1, mla=True), {}).close()  # TP 1: fine


def test_on_host_pools_registered_refuses_an_attach_without_a_kv_pool():
    """SGLang 0.5.23 calls on_host_pools_registered once after registration; raising fails the attach."""
    b = KVConnectStorage(storage_config({**ISSUE_JSON, "store": SHARED, "space": "attach"}), {})
    with pytest.raises(Unsupported, match="without a KV host pool"):
        b.on_host_pools_registered()
    host = make_cpu_host_pool("page_first")
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(make_cpu_mamba_pool(), PoolName.MAMBA)
    b.on_host_pools_registered()
    b.close()


def test_block_groups_pool_reports_its_own_verdict_and_never_gates_kv():
    """SGLang 0.5.23 PoolHitPolicy.BLOCK_GROUPS through batch_exists_v2 on real host pools:
    the pool's own keys in groups of group_pages, one group per block of block_pages FULL
    (KV) pages; its verdict is the FULL pages its leading complete groups cover."""
    kv = make_cpu_host_pool("page_first", page_size=2)
    blocks = make_cpu_host_pool("page_first", page_size=2, layer_num=1)
    b = backend(kv, space="bg")
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(blocks, PoolName.INDEXER)
    b.on_host_pools_registered()
    keys = hashes(8, "full")
    kidx = alloc_pages(kv, 8)
    fill_pages(kv, kidx, seed=9)
    assert b.batch_set_v1(keys, kidx) == [True] * 8
    group_keys = hashes(6, "groups")  # 3 blocks of 4 FULL pages, 2 keys each
    gidx = alloc_pages(blocks, 6)
    fill_pages(blocks, gidx, seed=10)
    present = [0, 1, 2, 4, 5]  # group 1 misses its second key
    for i in present:
        ps = blocks.page_size
        assert b.batch_set_v2([PoolTransfer(PoolName.INDEXER, gidx[i * ps:(i + 1) * ps], keys=[group_keys[i]],
                                            hit_policy=PoolHitPolicy.BLOCK_GROUPS)]) == {PoolName.INDEXER: [True]}
    t = PoolTransfer(PoolName.INDEXER, keys=group_keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=4,
                     group_pages=2)
    res = b.batch_exists_v2(keys, [t])
    assert res.kv_hit_pages == 8 and res.restorable_prefix_pages == list(range(1, 9))  # KV not gated
    assert res.extra_pool_hit_pages == {PoolName.KV: 8, PoolName.INDEXER: 4}  # only block 0 is whole
    # the pool's pages read back byte-exact into a fresh pool
    fresh = make_cpu_host_pool("page_first", page_size=2, layer_num=1)
    b2 = backend(make_cpu_host_pool("page_first", page_size=2), space="bg")
    b2.register_mem_host_pool_v2(fresh, PoolName.INDEXER)
    fidx = alloc_pages(fresh, 2, skip=1)
    got = b2.batch_get_v2([PoolTransfer(PoolName.INDEXER, fidx, keys=group_keys[:2],
                                        hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    assert got == {PoolName.INDEXER: [True, True]} and pages_of(fresh, fidx) == pages_of(blocks, gidx[:4])
    b.close()
    b2.close()


def test_a_real_mamba_pool_is_rank_sharded_under_mla():
    """SGLang 0.5.23's MambaPoolHost (built on CPU): its pages go through SGLang's flat
    pages, keyed per TP rank even where the KV is rank-replicated, and both ranks write."""
    ranks, mambas = [], []
    for tp in range(2):
        b = backend(make_cpu_host_pool("page_first", mla=True), space="mamba", tp_rank=tp, tp_size=2, mla=True)
        m = make_cpu_mamba_pool()
        b.register_mem_host_pool_v2(m, PoolName.MAMBA)
        b.on_host_pools_registered()
        io = b._pools["mamba"]
        assert not io.zero_copy and not io.keyspace.rank_replicated and io.is_writer
        ranks.append(b)
        mambas.append(m)
    keys = hashes(3, "state")
    idx = [alloc_pages(m, 3) for m in mambas]
    for tp in range(2):
        fill_pages(mambas[tp], idx[tp], seed=20 + tp)
        got = ranks[tp].batch_set_v2([PoolTransfer(PoolName.MAMBA, idx[tp], keys=keys,
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert got == {PoolName.MAMBA: [True] * 3}
    for tp in range(2):
        fresh = make_cpu_mamba_pool()
        ranks[tp].register_mem_host_pool_v2(fresh, PoolName.MAMBA)
        fidx = alloc_pages(fresh, 3, skip=2)
        got = ranks[tp].batch_get_v2([PoolTransfer(PoolName.MAMBA, fidx, keys=keys,
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert got == {PoolName.MAMBA: [True] * 3}
        assert pages_of(fresh, fidx) == pages_of(mambas[tp], idx[tp])  # its own state, not the other rank's
    for b in ranks:
        b.close()


def test_clear_and_delete_touch_only_what_this_rank_owns():
    """Two engines (another model) and two ranks share a store: clear and delete on rank 0
    of engine A remove A's rank-0 pages only; rank 1, engine B and the replicated pages a
    reader rank never wrote stay."""
    hosts = {name: make_cpu_host_pool("page_first") for name in ("a0", "a1", "b0")}
    a0 = backend(hosts["a0"], space="scope", tp_rank=0, tp_size=2, model="model/a")
    a1 = backend(hosts["a1"], space="scope", tp_rank=1, tp_size=2, model="model/a")
    b0 = backend(hosts["b0"], space="scope", model="model/b")
    mla = [backend(make_cpu_host_pool("page_first", mla=True), space="scope", tp_rank=r, tp_size=2, mla=True,
                   model="model/a") for r in range(2)]
    keys = hashes(4, "scope")
    for b, h in ((a0, hosts["a0"]), (a1, hosts["a1"]), (b0, hosts["b0"])):
        idx = alloc_pages(h, 4)
        fill_pages(h, idx, seed=3)
        assert b.batch_set_v1(keys, idx) == [True] * 4
    midx = alloc_pages(mla[0].kv.pool, 4)
    fill_pages(mla[0].kv.pool, midx, seed=4)
    assert mla[0].batch_set_v1(keys, midx) == [True] * 4
    assert a0.batch_delete(keys[:1]) == [True]
    assert [b.batch_exists(keys) for b in (a0, a1, b0, mla[1])] == [0, 4, 4, 4]
    assert a0.batch_set_v1(keys[:1], alloc_pages(hosts["a0"], 1)) == [True]
    assert a0.clear() is True and a0.batch_exists(keys) == 0
    assert [b.batch_exists(keys) for b in (a1, b0, mla[1])] == [4, 4, 4]
    assert mla[1].clear() is True and mla[1].batch_delete(keys) == [False] * 4  # a reader owns no MLA pages
    assert mla[0].batch_exists(keys) == 4
    assert mla[0].clear() is True and mla[1].batch_exists(keys) == 0
    for b in (a0, a1, b0, *mla):
        b.close()
