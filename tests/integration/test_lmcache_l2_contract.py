# SPDX-License-Identifier: Apache-2.0
"""LMCache's own L2 adapter contract suite, run against the kvconnect plugin.

Upstream: LMCache 0.5.6, ``tests/v1/distributed/test_mock_l2_adapter.py`` (the contract of
``L2AdapterInterface`` in ``lmcache/v1/distributed/l2_adapters/base.py``, written against
``MockL2Adapter``; the 0.5.6 wheel ships no tests). Every upstream class and test is here
under its upstream name, with the upstream assertions, re-expressed in this file's own
helpers. The adapter is ``KVConnectL2Adapter`` built by LMCache's plugin factory from an
``--l2-adapter`` JSON, over two stores:

* ``memory``: private, 1 MiB (the upstream mock's ``max_size_gb=0.001``);
* ``hf3fs``: HF3FS data files shared through a real metadata service process
  (``kvconnect.connectors.testing.hf3fs.MetaProcess``), 4 MiB files, one service per test.

What changed from upstream, and why:

1. The ``adapter`` fixture builds the plugin (per store) instead of ``MockL2Adapter``;
   ``TestCloseInterface`` builds it the same way.
2. ``TestBandwidthSimulation.test_store_completion_is_delayed_by_bandwidth`` is left out:
   it tests the mock's simulated bandwidth, which no real store has.
   ``test_fast_bandwidth_completes_quickly`` stays (a store completes in under 1 s).
3. The usage tests also assert the exact figures: bytes used equal to the bytes stored,
   capacity equal to the store's (memory ``capacity``; HF3FS ``file_size`` before the first
   data file, then the open files' whole pages), and who evicts
   (``supports_global_eviction``: the private memory store yes, the shared HF3FS store no).
4. Waits poll the event fd until the result is there (upstream waits for one signal): a
   family's fd is signalled once per finished task and results may be read in any order.
"""

from __future__ import annotations

import argparse
import select
import time

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="needs lmcache (pip install \"kvconnect[lmcache]\")")

import torch  # noqa: E402

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2AdapterListener  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from kvconnect.connectors.testing.lmcache import plugin_json  # noqa: E402

LAYOUT = MemoryLayoutDesc(shapes=[], dtypes=[])
MEMORY_CAPACITY = 1 << 20
HF3FS_FILE_SIZE = 4 << 20
WAIT_S = 5.0


def _hf3fs_available() -> bool:
    import importlib.util

    return (importlib.util.find_spec("kvconnect.connectors.hf3fs.store") is not None
            and importlib.util.find_spec("grpc") is not None)


STORES = ["memory", pytest.param("hf3fs", marks=pytest.mark.skipif(not _hf3fs_available(),
                                                                    reason="needs connectors/hf3fs and grpcio"))]


class Recorder(L2AdapterListener):
    """Every listener event, in order."""

    def __init__(self) -> None:
        self.stored: list[list[ObjectKey]] = []
        self.accessed: list[list[ObjectKey]] = []
        self.deleted: list[list[ObjectKey]] = []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored.append(list(keys))

    def on_l2_keys_accessed(self, keys):
        self.accessed.append(list(keys))

    def on_l2_keys_deleted(self, keys):
        self.deleted.append(list(keys))


def key(i: int, model: str = "test_model", salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name=model, kv_rank=0, cache_salt=salt)


def obj(n: int = 1024, value: float = 1.0) -> TensorMemoryObj:
    """A CPU ``TensorMemoryObj`` of ``n`` float32 (``4 n`` bytes) filled with ``value``."""
    data = torch.full((n,), value, dtype=torch.float32)
    meta = MemoryObjMetadata(shape=torch.Size([n]), dtype=torch.float32, address=0, phy_size=4 * n,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(data, meta, parent_allocator=None)


def signalled(fd: int, timeout: float = WAIT_S) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(timeout * 1000):
        try:
            consume_fd(fd)
        except BlockingIOError:
            pass
        return True
    return False


def until(query, fd: int, timeout: float = WAIT_S):
    """``query()`` once it is not None/empty, waiting on ``fd`` in between."""
    deadline = time.monotonic() + timeout
    while True:
        r = query()
        if r:
            return r
        left = deadline - time.monotonic()
        if left <= 0:
            return r
        signalled(fd, min(left, 0.2))


def store_done(a, keys, objs) -> dict:
    tid = a.submit_store_task(keys, objs)
    done = until(a.pop_completed_store_tasks, a.get_store_event_fd())
    assert tid in done, done
    return done


def lookup_bitmap(a, keys):
    tid = a.submit_lookup_and_lock_task(keys, LAYOUT)
    return until(lambda: a.query_lookup_and_lock_result(tid), a.get_lookup_and_lock_event_fd())


def load_bitmap(a, keys, objs):
    tid = a.submit_load_task(keys, objs)
    return until(lambda: a.query_load_result(tid), a.get_load_event_fd())


class Store:
    """One store's adapter params, its metadata service (HF3FS) and expected capacity."""

    def __init__(self, name: str, tmp_path):
        self.name = name
        self.meta = None
        if name == "memory":
            self.params = {"store": "memory", "capacity": MEMORY_CAPACITY}
            self.capacity, self.shared = MEMORY_CAPACITY, False
        else:
            from kvconnect.connectors.testing.hf3fs import MetaProcess

            self.meta = MetaProcess(tmp_path / "meta", fsync="never").start()
            self.params = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "kv"), "file_size": HF3FS_FILE_SIZE,
                           "numjobs": 2, "entries": 8, "metadata_server_url": self.meta.url}
            self.capacity, self.shared = HF3FS_FILE_SIZE, True

    def adapter(self):
        cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[plugin_json(self.params)]))
        buf = torch.zeros(4096, dtype=torch.uint8)
        a = create_l2_adapter(cfg.adapters[0], l1_memory_desc=L1MemoryDesc(ptr=buf.data_ptr(), size=buf.numel(),
                                                                           align_bytes=1))
        a._test_l1 = buf  # keep the L1 stand-in alive as long as the adapter
        return a

    def close(self) -> None:
        if self.meta is not None:
            self.meta.stop()


@pytest.fixture(params=STORES)
def backend(request, tmp_path):
    s = Store(request.param, tmp_path)
    yield s
    s.close()


@pytest.fixture
def adapter(backend):
    a = backend.adapter()
    yield a
    a.close()


# =============================================================================
# Event fds
# =============================================================================


class TestEventFdInterface:
    def test_get_store_event_fd_returns_valid_fd(self, adapter):
        fd = adapter.get_store_event_fd()
        assert isinstance(fd, int) and fd >= 0

    def test_get_lookup_and_lock_event_fd_returns_valid_fd(self, adapter):
        fd = adapter.get_lookup_and_lock_event_fd()
        assert isinstance(fd, int) and fd >= 0

    def test_get_load_event_fd_returns_valid_fd(self, adapter):
        fd = adapter.get_load_event_fd()
        assert isinstance(fd, int) and fd >= 0

    def test_event_fds_are_different(self, adapter):
        fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
        assert len(set(fds)) == 3


# =============================================================================
# Store
# =============================================================================


class TestStoreInterface:
    def test_submit_store_task_returns_task_id(self, adapter):
        assert isinstance(adapter.submit_store_task([key(1)], [obj()]), int)

    def test_submit_store_task_signals_event_fd(self, adapter):
        adapter.submit_store_task([key(1)], [obj()])
        assert signalled(adapter.get_store_event_fd())

    def test_pop_completed_store_tasks_returns_completed(self, adapter):
        done = store_done(adapter, [key(1)], [obj()])
        (result,) = done.values()
        assert result.is_successful()
        assert result.bytes_transferred() == 4096

    def test_pop_completed_store_tasks_clears_completed(self, adapter):
        assert len(store_done(adapter, [key(1)], [obj()])) == 1
        assert adapter.pop_completed_store_tasks() == {}

    def test_submit_multiple_store_tasks(self, adapter):
        tids = [adapter.submit_store_task([key(i)], [obj(value=float(i))]) for i in range(3)]
        assert len(set(tids)) == 3
        done: dict = {}
        deadline = time.monotonic() + WAIT_S
        while len(done) < 3 and time.monotonic() < deadline:
            signalled(adapter.get_store_event_fd(), 0.2)
            done.update(adapter.pop_completed_store_tasks())
        assert set(done) == set(tids)
        assert all(done[t].is_successful() for t in tids)

    def test_store_batch_of_objects(self, adapter):
        keys = [key(i) for i in range(5)]
        done = store_done(adapter, keys, [obj(value=float(i)) for i in range(5)])
        (result,) = done.values()
        assert result.is_successful() and result.bytes_transferred() == 5 * 4096


# =============================================================================
# Lookup and lock
# =============================================================================


class TestLookupAndLockInterface:
    def test_submit_lookup_returns_task_id(self, adapter):
        assert isinstance(adapter.submit_lookup_and_lock_task([key(1)], LAYOUT), int)

    def test_lookup_signals_event_fd(self, adapter):
        adapter.submit_lookup_and_lock_task([key(1)], LAYOUT)
        assert signalled(adapter.get_lookup_and_lock_event_fd())

    def test_lookup_nonexistent_key_returns_bitmap_with_zeros(self, adapter):
        bm = lookup_bitmap(adapter, [key(999)])
        assert bm is not None and bm.test(0) is False

    def test_lookup_existing_key_returns_bitmap_with_ones(self, adapter):
        store_done(adapter, [key(1)], [obj()])
        bm = lookup_bitmap(adapter, [key(1)])
        assert bm is not None and bm.test(0) is True

    def test_lookup_mixed_keys(self, adapter):
        store_done(adapter, [key(1)], [obj()])
        bm = lookup_bitmap(adapter, [key(1), key(999)])
        assert bm.test(0) is True and bm.test(1) is False

    def test_query_lookup_result_returns_none_for_unknown_task(self, adapter):
        assert adapter.query_lookup_and_lock_result(99999) is None

    def test_query_lookup_result_clears_result(self, adapter):
        tid = adapter.submit_lookup_and_lock_task([key(1)], LAYOUT)
        first = until(lambda: adapter.query_lookup_and_lock_result(tid), adapter.get_lookup_and_lock_event_fd())
        assert first is not None
        assert adapter.query_lookup_and_lock_result(tid) is None


# =============================================================================
# Unlock
# =============================================================================


class TestUnlockInterface:
    def test_submit_unlock_does_not_raise(self, adapter):
        adapter.submit_unlock([key(1)])

    def test_unlock_after_lock(self, adapter):
        store_done(adapter, [key(1)], [obj()])
        assert lookup_bitmap(adapter, [key(1)]).test(0) is True
        adapter.submit_unlock([key(1)])


# =============================================================================
# Load
# =============================================================================


class TestLoadInterface:
    def test_submit_load_task_returns_task_id(self, adapter):
        assert isinstance(adapter.submit_load_task([key(1)], [obj()]), int)

    def test_load_signals_event_fd(self, adapter):
        adapter.submit_load_task([key(1)], [obj()])
        assert signalled(adapter.get_load_event_fd())

    def test_load_nonexistent_key_returns_bitmap_with_zeros(self, adapter):
        bm = load_bitmap(adapter, [key(999)], [obj()])
        assert bm is not None and bm.test(0) is False

    def test_load_existing_key_copies_data(self, adapter):
        store_done(adapter, [key(1)], [obj(100, 42.0)])
        dst = obj(100, 0.0)
        assert load_bitmap(adapter, [key(1)], [dst]).test(0) is True
        assert torch.all(dst.tensor == 42.0)

    def test_query_load_result_returns_none_for_unknown_task(self, adapter):
        assert adapter.query_load_result(99999) is None

    def test_query_load_result_clears_result(self, adapter):
        tid = adapter.submit_load_task([key(1)], [obj()])
        assert until(lambda: adapter.query_load_result(tid), adapter.get_load_event_fd()) is not None
        assert adapter.query_load_result(tid) is None


# =============================================================================
# End to end
# =============================================================================


class TestEndToEndWorkflow:
    def test_store_lookup_load_workflow(self, adapter):
        k = key(1)
        (result,) = store_done(adapter, [k], [obj(256, 123.0)]).values()
        assert result.is_successful()
        assert lookup_bitmap(adapter, [k]).test(0) is True
        dst = obj(256, 0.0)
        assert load_bitmap(adapter, [k], [dst]).test(0) is True
        assert torch.all(dst.tensor == 123.0)
        adapter.submit_unlock([k])

    def test_multiple_objects_workflow(self, adapter):
        keys = [key(i) for i in range(5)]
        (result,) = store_done(adapter, keys, [obj(64, float(i * 10)) for i in range(5)]).values()
        assert result.is_successful()
        bm = lookup_bitmap(adapter, keys)
        assert all(bm.test(i) is True for i in range(5))
        dsts = [obj(64, 0.0) for _ in range(5)]
        bm = load_bitmap(adapter, keys, dsts)
        for i in range(5):
            assert bm.test(i) is True
            assert torch.all(dsts[i].tensor == float(i * 10))


# =============================================================================
# Close
# =============================================================================


class TestCloseInterface:
    def test_close_does_not_raise(self, backend):
        backend.adapter().close()

    def test_close_after_operations(self, backend):
        a = backend.adapter()
        store_done(a, [key(1)], [obj()])
        a.close()


# =============================================================================
# Timing (upstream: bandwidth simulation; only the store-is-quick case applies)
# =============================================================================


class TestBandwidthSimulation:
    def test_fast_bandwidth_completes_quickly(self, adapter):
        t0 = time.monotonic()
        adapter.submit_store_task([key(1)], [obj(1000)])
        assert signalled(adapter.get_store_event_fd())
        assert time.monotonic() - t0 < 1.0


# =============================================================================
# Eviction: delete, usage, listeners
# =============================================================================


class TestEvictionInterface:
    def test_delete_removes_key(self, adapter):
        store_done(adapter, [key(1)], [obj()])
        adapter.delete([key(1)])
        assert lookup_bitmap(adapter, [key(1)]).test(0) is False

    def test_delete_nonexistent_key_does_not_raise(self, adapter):
        adapter.delete([key(999)])

    def test_delete_multiple_keys(self, adapter):
        keys = [key(i) for i in range(3)]
        store_done(adapter, keys, [obj() for _ in keys])
        adapter.delete(keys)
        bm = lookup_bitmap(adapter, keys)
        assert [bm.test(i) for i in range(3)] == [False, False, False]

    def test_get_usage_empty_adapter_is_zero(self, adapter, backend):
        u = adapter.get_usage()
        assert u.total_bytes_used == 0
        assert u.usage_fraction == 0.0
        assert u.bytes_by_cache_salt == {}
        # exact: the store's capacity; LMCache evicts only from the private store
        assert u.total_capacity_bytes == backend.capacity
        assert adapter.supports_global_eviction is (not backend.shared)

    def test_get_usage_increases_after_store(self, adapter, backend):
        store_done(adapter, [key(1)], [obj(1024)])
        u = adapter.get_usage()
        assert u.total_bytes_used > 0
        assert 0.0 < u.usage_fraction <= 1.0
        # exact: 4096 bytes of 1 MiB (memory) or of the 4 MiB file's 1024 pages (hf3fs)
        assert u.total_bytes_used == 4096 and u.total_capacity_bytes == backend.capacity
        assert u.usage_fraction == 4096 / backend.capacity
        st = adapter.report_status()
        assert (st["stored_object_count"], st["current_size_bytes"], st["max_capacity_bytes"]) == (
            1, 4096, backend.capacity)
        assert st["usage"]["bytes_used_from"] == "store" and st["usage"]["capacity_from"] == "store"

    def test_get_usage_decreases_after_delete(self, adapter):
        store_done(adapter, [key(1)], [obj(1024)])
        assert adapter.get_usage().total_bytes_used == 4096
        adapter.delete([key(1)])
        u = adapter.get_usage()
        assert u.total_bytes_used == 0
        assert u.usage_fraction == 0.0

    def test_bytes_by_cache_salt_populated_from_cache_salt(self, adapter):
        alice = [key(i, model="m", salt="alice") for i in (1, 2)]
        bob = key(3, model="m", salt="bob")
        o = obj(128)  # 512 bytes
        for k in alice + [bob]:
            store_done(adapter, [k], [o])
        u = adapter.get_usage()
        assert dict(u.bytes_by_cache_salt) == {"alice": 1024, "bob": 512}
        assert u.total_bytes_used == 1536
        adapter.delete([alice[0]])
        u = adapter.get_usage()
        assert dict(u.bytes_by_cache_salt) == {"alice": 512, "bob": 512}
        assert u.total_bytes_used == 1024
        adapter.delete([alice[1]])
        u = adapter.get_usage()
        assert "alice" not in u.bytes_by_cache_salt
        assert dict(u.bytes_by_cache_salt) == {"bob": 512}

    def test_listener_notified_on_store(self, adapter):
        rec = Recorder()
        adapter.register_listener(rec)
        store_done(adapter, [key(1)], [obj()])
        assert len(rec.stored) == 1 and key(1) in rec.stored[0]
        assert rec.deleted == []

    def test_listener_notified_on_delete(self, adapter):
        rec = Recorder()
        adapter.register_listener(rec)
        store_done(adapter, [key(1)], [obj()])
        adapter.delete([key(1)])
        assert len(rec.deleted) == 1 and key(1) in rec.deleted[0]

    def test_listener_delete_skips_missing_keys(self, adapter):
        rec = Recorder()
        adapter.register_listener(rec)
        store_done(adapter, [key(1)], [obj()])
        adapter.delete([key(1), key(999)])
        assert len(rec.deleted) == 1
        assert key(1) in rec.deleted[0] and key(999) not in rec.deleted[0]

    def test_listener_notified_on_load(self, adapter):
        rec = Recorder()
        adapter.register_listener(rec)
        store_done(adapter, [key(1)], [obj(100, 42.0)])
        assert load_bitmap(adapter, [key(1)], [obj(100, 0.0)]).test(0) is True
        assert len(rec.accessed) == 1 and key(1) in rec.accessed[0]

    def test_listener_load_skips_missing_keys(self, adapter):
        rec = Recorder()
        adapter.register_listener(rec)
        store_done(adapter, [key(1)], [obj(100, 42.0)])
        bm = load_bitmap(adapter, [key(1), key(999)], [obj(100, 0.0), obj(100, 0.0)])
        assert bm.test(0) is True and bm.test(1) is False
        assert len(rec.accessed) == 1
        assert key(1) in rec.accessed[0] and key(999) not in rec.accessed[0]

    def test_multiple_listeners_all_notified(self, adapter):
        r1, r2 = Recorder(), Recorder()
        adapter.register_listener(r1)
        adapter.register_listener(r2)
        store_done(adapter, [key(1)], [obj()])
        assert len(r1.stored) == 1 and len(r2.stored) == 1
