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
