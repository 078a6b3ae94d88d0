"""The logical KV dtype and the stored scale format are part of every key space: pages written
by an engine of one KV dtype are misses for an engine of another, per integration.

SGLang keeps every fp8 variant in ``uint8`` host pools (its own L3 keys carry no dtype,
sglang issue #33268), so the pools below are real SGLang fp8 pools whose buffers say
``uint8`` for both ``fp8_e4m3`` and ``fp8_e5m2``: only the key space tells them apart.
"""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvconnect.connectors.base import ConfigError  # noqa: E402
from kvconnect.connectors.testing.sglang import fill_pages, make_cpu_host_pool, page_bytes, storage_config  # noqa: E402
from kvconnect.connectors.testing.stores import clear_spaces  # noqa: E402
from kvconnect.namespace import resolve_kv_dtype  # noqa: E402

SHARED = "kvconnect.connectors.testing.stores:SharedMemoryStore"


@pytest.fixture(autouse=True)
def _fresh_spaces():
    clear_spaces()
    yield
    clear_spaces()


def _hicache(host, space: str, kv_cache_dtype=None):
    extra = {"store": SHARED, "space": space}
    if kv_cache_dtype is not None:
        extra["kv_cache_dtype"] = kv_cache_dtype
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config=extra, layout=host.layout), host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


def _keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


def _pages(host, idx) -> list[bytes]:
    return [page_bytes(host, idx[i * host.page_size]) for i in range(len(idx) // host.page_size)]


@pytest.mark.parametrize("written, other", [
    (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")),  # same uint8 pages, other fp8
    (("float8_e4m3fn", "mxfp8"), ("float8_e4m3fn", "fp8_e4m3")),  # block scales in the pages vs none
    (("bfloat16", None), ("float16", None)),  # same page bytes, other 16-bit float
])
def test_hicache_pages_of_one_kv_dtype_are_misses_for_another(written, other):
    n = 4
    keys = _keys(n, "dtype")
    w_host = make_cpu_host_pool("page_first", dtype=written[0])
    writer = _hicache(w_host, "dt", written[1])
    w_idx = w_host.alloc(n * w_host.page_size)
    fill_pages(w_host, w_idx, seed=7)
    assert writer.batch_set_v1(keys, w_idx) == [True] * n

    o_host = make_cpu_host_pool("page_first", dtype=other[0])
    assert o_host.get_dummy_flat_data_page().nbytes == w_host.get_dummy_flat_data_page().nbytes
    reader = _hicache(o_host, "dt", other[1])
    o_idx = o_host.alloc(n * o_host.page_size)
    before = _pages(o_host, o_idx)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, o_idx) == [False] * n
    assert _pages(o_host, o_idx) == before  # nothing was written into the reader's pool
    assert reader.kv.keyspace.prefix != writer.kv.keyspace.prefix

    # the same dtype reads them back byte-exact
    s_host = make_cpu_host_pool("page_first", dtype=written[0])
    same = _hicache(s_host, "dt", written[1])
    s_idx = s_host.alloc(n * s_host.page_size)
    assert same.batch_exists(keys) == n
    assert same.batch_get_v1(keys, s_idx) == [True] * n
    assert _pages(s_host, s_idx) == _pages(w_host, w_idx)
    for b in (writer, reader, same):
        b.close()


def test_hicache_fp8_key_space_names_the_logical_dtype_not_uint8():
    host = make_cpu_host_pool("page_first", dtype="float8_e4m3fn")
    assert str(host.dtype) == "torch.uint8"  # what SGLang's host pool knows
    b = _hicache(host, "names", "fp8_e4m3")
    assert (b.kv.keyspace.dtype, b.kv.keyspace.kv_scales) == ("float8_e4m3fn", "")
    mx = _hicache(make_cpu_host_pool("page_first", dtype="float8_e4m3fn"), "names", "mxfp8")
    assert (mx.kv.keyspace.dtype, mx.kv.keyspace.kv_scales) == ("float8_e4m3fn", "mxfp8")
    bf = _hicache(make_cpu_host_pool("page_first", dtype="bfloat16"), "names", "auto")
    assert (bf.kv.keyspace.dtype, bf.kv.keyspace.kv_scales) == ("bfloat16", "")
    for x in (b, mx, bf):
        x.close()


def test_hicache_bad_kv_cache_dtype_fails_at_construction_naming_the_key():
    host = make_cpu_host_pool("page_first")
    with pytest.raises(ConfigError, match=r"'kv_cache_dtype'.*accepted: .*fp8_e4m3.*fp8_e5m2"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra_config={"store": "memory", "kv_cache_dtype": "fp7"}), host)


def test_declared_dtype_names_byte_containers_never_overrides_a_real_buffer_dtype():
    assert resolve_kv_dtype("torch.uint8", "fp8_e5m2") == ("float8_e5m2", "")
    assert resolve_kv_dtype("torch.uint8", None) == ("uint8", "")  # unknown fp8: a space of its own
    assert resolve_kv_dtype("torch.bfloat16", "auto") == ("bfloat16", "")
    assert resolve_kv_dtype("torch.bfloat16", "fp8_e4m3") == ("bfloat16", "")  # a draft's own bf16 KV
    assert resolve_kv_dtype("float8_e4m3fn", "mxfp8") == ("float8_e4m3fn", "mxfp8")


@pytest.mark.parametrize("written, other", [
    (("uint8", "fp8_e4m3"), ("uint8", "fp8_e5m2")),  # what vLLM's KV spec says for both: uint8
    (("uint8", "fp8"), ("uint8", "fp8_per_token_head")),  # a format kvconnect does not know: its own space
    (("bfloat16", "auto"), ("float16", "auto")),
])
def test_vllm_blocks_of_one_cache_dtype_are_misses_for_another(written, other):
    """vLLM's connector keys blocks by ``vllm_kv_dtype(spec.dtype, cache_config.cache_dtype)``
    (``_model_geometry``); the spec dtypes here are those vLLM 0.32 gives for the cache dtypes."""
    import numpy as np

    from kvconnect.connectors.buffers import buffer_address
    from kvconnect.connectors.engines.vllm_pages import PageGeometry, vllm_kv_dtype
    from kvconnect.connectors.memory import MemoryStore
    from kvconnect.connectors.views import PrefixedStore

    def geometry(stored, cache_dtype):
        dtype, scales = vllm_kv_dtype(stored, cache_dtype)
        return PageGeometry(layers=2, kv_heads=2, head_dim=8, block_size=16, dtype=dtype, kv_scales=scales,
                            itemsize=1 if stored == "uint8" else 2, layout="layer_first")

    store = MemoryStore()
    w, o = geometry(*written), geometry(*other)
    assert w.page_nbytes == o.page_nbytes
    keys = _keys(3, "vllm")
    blocks = [np.random.default_rng(i).integers(0, 255, w.page_nbytes, dtype=np.uint8) for i in range(3)]
    wv = PrefixedStore.for_keyspace(store, w.keyspace(model="m"))
    assert wv.put_from(keys, [[(buffer_address(b), b.nbytes)] for b in blocks]) == [True] * 3
    out = [np.zeros(w.page_nbytes, np.uint8) for _ in range(3)]
    ov = PrefixedStore.for_keyspace(store, o.keyspace(model="m"))
    assert ov.exists(keys) == [False] * 3
    assert ov.get_into(keys, [[(buffer_address(b), b.nbytes)] for b in out]) == [False] * 3
    assert all(not b.any() for b in out)
    same = PrefixedStore.for_keyspace(store, geometry(*written).keyspace(model="m"))
    assert same.get_into(keys, [[(buffer_address(b), b.nbytes)] for b in out]) == [True] * 3
    assert all((a == b).all() for a, b in zip(out, blocks))
    assert vllm_kv_dtype("uint8", "fp8_e4m3") == ("float8_e4m3fn", "")
    assert vllm_kv_dtype("bfloat16", "auto") == ("bfloat16", "")  # unchanged keys for unquantized caches


def test_pd_relay_rooms_of_one_kv_dtype_are_not_found_by_a_decode_of_another():
    """The PD relay's room namespace carries ``KVArgs.kv_cache_dtype_str``: a decode whose KV
    dtype differs from the prefill's finds no room (SGLang's own bootstrap check aside)."""
    import numpy as np

    from kvconnect.connectors.buffers import buffer_address
    from kvconnect.connectors.engines.pd_transport import (
        BufferLayout, PDConfig, StoreRelay, kv_dtype_tag, room_namespace)

    kv = np.arange(4 * 256, dtype=np.uint8)
    aux = np.zeros(4 * 16, np.uint8)
    layout = BufferLayout(kv_ptrs=(buffer_address(kv),), kv_lens=(kv.nbytes,), kv_item_lens=(256,),
                          aux_ptrs=(buffer_address(aux),), aux_lens=(aux.nbytes,), aux_item_lens=(16,))
    relay = StoreRelay(PDConfig(transport="relay", store={"store": SHARED, "space": "pd-dtype"}), layout)
    try:
        def keys(kv_cache_dtype):
            return relay.keys(room_namespace("kvcpd", "127.0.0.1", 5000, 7, kv_dtype_tag(kv_cache_dtype)), 4)

        prefill = keys("fp8_e4m3")
        relay.put_blocks(prefill, np.arange(4), list(range(prefill.nblocks)))
        relay.put_tail(prefill, 0, None, 7)
        assert relay.markers_present([keys("fp8_e4m3"), keys("fp8_e5m2"), keys("mxfp8"), keys("auto")]) == \
            [True, False, False, False]
        assert kv_dtype_tag("auto") == kv_dtype_tag(None) == ""  # rooms of unquantized pairs: as before
        assert kv_dtype_tag("mxfp8") == "float8_e4m3fn+mxfp8"
    finally:
        relay.close()


def test_lmcache_chunks_of_one_l1_dtype_are_misses_for_another():
    """LMCache's ``ObjectKey`` carries no dtype: the plugin keys chunks by the dtype of the
    L1 objects stored and loaded and of the layout a lookup names (what LMCache's prefetch
    passes), so a bf16 server never reads an fp16 server's chunks of the same size."""
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    from kvconnect.connectors.engines.lmcache_l2 import KVConnectL2Adapter
    from kvconnect.connectors.memory import MemoryStore
    from kvconnect.connectors.testing.lmcache_adapter import CHUNK, L1, load, lookup, okeys, store

    def typed(n, dtype, seed=None):
        l1 = L1(n)
        if seed is not None:
            l1.fill_random(seed)
        for o in l1.objs:
            o.metadata.dtype = dtype
        return l1

    def layout(dtype):
        return {0: MemoryLayoutDesc(shapes=[torch.Size([CHUNK // 2])], dtypes=[dtype])}

    shared = MemoryStore()
    bf16, fp16, bf16_again = (KVConnectL2Adapter({"store": "memory"}, store=shared) for _ in range(3))
    try:
        keys = okeys(3, model="org/m")
        src = typed(3, torch.bfloat16, seed=11)
        assert store(bf16, keys, src.objs).is_successful()
        assert lookup(fp16, keys, layout(torch.float16)) == []
        dst = typed(3, torch.float16)
        assert load(fp16, keys, dst.objs) == []
        assert all(dst.data(i) == bytes(CHUNK) for i in range(3))  # untouched
        assert lookup(bf16_again, keys, layout(torch.bfloat16)) == [0, 1, 2]
        same = typed(3, torch.bfloat16)
        assert load(bf16_again, keys, same.objs) == [0, 1, 2]
        assert [same.data(i) for i in range(3)] == [src.data(i) for i in range(3)]
        bf16_again.submit_unlock(keys)
    finally:
        for a in (bf16, fp16, bf16_again):
            a.close()
